"""Explicit streaming state for stock modules that keep theirs on themselves.

Moshi's streaming modules hold their state in dataclasses hung on each module
(``_streaming_state``: ring KV caches, conv ``previous``/``partial`` frames, offsets). A compiled
step needs that state as arguments: ``ExplicitState`` enters streaming once, reads the fresh state
into a dict (per-layer ring caches stacked into one tensor per stack, each layer's cache bound to
its slice), binds a state dict into the dataclasses at the start of each call and reads it back
after. ``cadence_fx/models/moshi.py`` builds the Mimi and full-frame steps on it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["ExplicitState"]


@dataclasses.dataclass(frozen=True)
class _Slot:
    key: str            # state dict key
    holder: object      # the stock dataclass (or RingKVCache) holding the tensor
    attr: str
    index: Optional[int] = None  # layer index into a stacked region


def _slots(roots: Dict[str, nn.Module], stacks: Dict[str, str]) -> Iterator[_Slot]:
    """Every tensor of the stock streaming state under ``roots``. ``stacks`` maps a layer-list
    prefix (``"encoder_transformer.transformer.layers"``) to the region whose slices its ring
    caches are."""
    for root_name, root in roots.items():
        found: List[Tuple[str, nn.Module]] = []
        root._apply_named_streaming(lambda name, m: found.append((name, m)))
        for name, module in found:
            path = f"{root_name}.{name}" if name else root_name
            state = module._streaming_state
            if state is None:
                raise RuntimeError(f"{path} is not streaming; the step enters streaming itself")
            for f in dataclasses.fields(state):
                value = getattr(state, f.name)
                if isinstance(value, torch.Tensor):
                    yield _Slot(f"{path}:{f.name}", state, f.name)
                elif type(value).__name__ == "RingKVCache":
                    prefix = next((p for p in stacks if path.startswith(p + ".")), None)
                    if prefix is not None:   # "<prefix>.<layer>.self_attn"
                        layer = int(path[len(prefix) + 1:].split(".")[0])
                        yield _Slot(stacks[prefix], value, "cache", layer)
                    else:
                        yield _Slot(f"{path}:kv_cache.cache", value, "cache")
                    yield _Slot(f"{path}:kv_cache.end_offset", value, "end_offset")


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_bits(t: torch.Tensor) -> bool:
    """Every element's bits are zero: +0, not -0.0 (made again as zeros it would lose its sign)
    nor a NaN. Read through an integer view of the same storage: a reduction with no temporary
    the size of ``t`` (the 7B LM's stacked rings are 1.6 GB)."""
    if t.is_floating_point():
        t = t.view(_SAME_SIZE_INT[t.element_size()])
    return not t.any()


@dataclasses.dataclass(frozen=True)
class _Zeros:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def make(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class ExplicitState(nn.Module):
    """Shared by the thin steps: enter streaming once, bind a state dict per call, read it back."""

    def _setup(self, enter: List[nn.Module], stacks: Dict[str, str], renames: Dict[str, str],
               batch: int) -> None:
        """Enter streaming on ``enter`` once; remember the fresh state as the initial one."""
        self._stacks, self._renames = stacks, renames
        # the stock context of each module: closing it leaves streaming as the stock loop does
        self._streaming = [module.streaming(batch) for module in enter]
        try:
            fresh = self._read_fresh()
        except BaseException:
            self.close()      # the modules leave streaming: a step can be made again
            raise
        self._keep_initial(fresh)
        # the modules' own streaming caches are let go (bound to the stacked copy instead), and
        # that copy is the first initial_state(): the state exists once, as in the stock loop
        self._bind(fresh)
        self._first: Optional[Dict[str, torch.Tensor]] = fresh

    def close(self) -> None:
        """Leave streaming on the modules this step entered, as the stock ``streaming()``
        context does on exit: the modules hold nothing of the step's state afterwards and can
        stream again on their own (the step itself cannot run after this)."""
        while self._streaming:
            self._streaming.pop().close()

    def _roots(self) -> Dict[str, nn.Module]:
        """Path prefix -> module whose streaming state the step binds."""
        raise NotImplementedError

    def _all_slots(self) -> List[_Slot]:
        slots = []
        for s in _slots(self._roots(), self._stacks):
            slots.append(dataclasses.replace(s, key=self._renames.get(s.key, s.key)))
        return slots

    def _read_fresh(self) -> Dict[str, torch.Tensor]:
        """The modules' fresh streaming state as the step's dict, each stack of per-layer rings
        as one tensor the layers are rebound to slices of. The state never exists twice (the
        7B LM's rings are 1.6 GB): every layer's ring is let go before the stacked tensor is
        allocated, an all-zero ring (what entering streaming makes) as its shape, any other
        through a host copy."""
        state: Dict[str, torch.Tensor] = {}
        stacked: Dict[str, List[_Slot]] = {}
        for s in self._all_slots():
            if s.index is None:
                state[s.key] = getattr(s.holder, s.attr).clone()
            else:
                stacked.setdefault(s.key, []).append(s)
        for key, slots in stacked.items():
            layers = max(s.index for s in slots) + 1
            if sorted(s.index for s in slots) != list(range(layers)):
                raise RuntimeError(f"{key}: ring caches of layers {sorted(s.index for s in slots)}")
            like = getattr(slots[0].holder, slots[0].attr)
            shape, dtype, device = like.shape, like.dtype, like.device
            del like
            for s in slots:
                layer = getattr(s.holder, s.attr)
                if (layer.shape, layer.dtype, layer.device) != (shape, dtype, device):
                    raise RuntimeError(f"{key}: the ring cache of layer {s.index} is "
                                       f"{tuple(layer.shape)} {layer.dtype}, layer 0's "
                                       f"{tuple(shape)} {dtype}: they cannot stack")
            del layer
            held: Dict[int, torch.Tensor] = {}     # layer -> host copy of a ring that is not zero
            released: List[_Slot] = []
            try:
                with torch.no_grad():
                    for s in slots:
                        layer = getattr(s.holder, s.attr)
                        if not _zero_bits(layer):
                            held[s.index] = layer.to("cpu")
                        del layer
                        setattr(s.holder, s.attr, None)   # the layer's ring is let go here
                        released.append(s)
                    out = torch.zeros((layers, *shape), dtype=dtype, device=device)
            except BaseException:
                # (out of memory): every ring let go is put back, from its host copy or as
                # zeros, so the modules are as they were
                with torch.no_grad():
                    for s in released:
                        setattr(s.holder, s.attr, held[s.index].to(device) if s.index in held
                                else torch.zeros(shape, dtype=dtype, device=device))
                raise
            with torch.no_grad():
                for s in slots:
                    if s.index in held:
                        out[s.index].copy_(held.pop(s.index))
                    setattr(s.holder, s.attr, out[s.index])
            state[key] = out
        return state

    def _keep_initial(self, state: Dict[str, torch.Tensor]) -> None:
        """Remember the fresh state: all-zero tensors (the KV rings, 1.6 GB for the 7B LM) as
        their shape only, so the step holds no second copy of the state; the others (a few
        bytes each) as copies, never the tensors of the state handed out, which are written
        (in place by the stock step, or as carries a donating compiled step took over)."""
        self._initial = {k: (_Zeros(v.shape, v.dtype, v.device) if _zero_bits(v) else v.clone())
                         if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def initial_state(self) -> Dict[str, torch.Tensor]:
        """A fresh state (what entering streaming makes), to start a stream or a turn."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v.make() if isinstance(v, _Zeros)
                    else v) for k, v in self._initial.items()}

    def reset_state(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Start a new turn in ``state`` itself, as the stock ``reset_streaming`` does: every
        tensor refilled in place with its fresh value (nothing allocated; on a compiled step the
        state the last call returned stays the carry's view), plain values reset. Returns it."""
        with torch.no_grad():
            for k, v in self._initial.items():
                t = state.get(k)
                if isinstance(v, _Zeros) and isinstance(t, torch.Tensor):
                    t.zero_()
                elif isinstance(v, torch.Tensor) and isinstance(t, torch.Tensor):
                    t.copy_(v)
                else:
                    state[k] = v.make() if isinstance(v, _Zeros) else \
                        v.clone() if isinstance(v, torch.Tensor) else v
        return state

    def _bind(self, state: Dict[str, torch.Tensor]) -> List[Tuple[_Slot, torch.Tensor]]:
        slots = self._all_slots()
        missing = {s.key for s in slots} - set(state)
        if missing:
            raise KeyError(f"state is missing {sorted(missing)[:4]}; start from initial_state()")
        bound = []
        for s in slots:
            value = state[s.key] if s.index is None else state[s.key][s.index]
            setattr(s.holder, s.attr, value)
            bound.append((s, value))
        return bound

    def _read_back(self, state, bound: List[Tuple[_Slot, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        out = dict(state)
        for s, value in bound:
            now = getattr(s.holder, s.attr)
            if s.index is None:
                out[s.key] = now  # fields the stock code reassigns (LMGen's ``offsets``)
            elif now is not value:
                raise RuntimeError(f"the stock code replaced the ring cache bound to "
                                   f"{s.key}[{s.index}]; it must be written in place")
        return out
