"""Admission and absorption: what a call must satisfy before a compiled class runs it.

Admission (§3.3): every region's frame extent is in its catalog, the extents occur together in the
joint catalog, and the call's frame width is declared or passes the adapter's admission predicate;
otherwise the call runs stock, with the reason. Bad input is refused with a ``ContractError``
naming the fix: state on another device than the weights, state of a float width neither declared
nor the weights', state whose shape contradicts the declaration.

Absorption (§3.2, copy-on-write prompt state): a region input that is not already the leading view
of its carry -- the first call, a turn reset restoring the prompt state -- is copied into the carry
once; the caller's tensor is never written. From then on the step's state *is* ``carry[..., :e]``.
"""
from __future__ import annotations

import difflib
import logging
import math
from typing import Dict, Iterable, Optional

import torch

from .catalog import Catalog, calls_in_region_units
from .passes.context import Carry
from .contract import Adapter, Region
from .counters import Counters
from .errors import ContractError, GuardError

__all__ = ["Admission", "check_paths", "check_envelopes"]

log = logging.getLogger(__name__)


class Admission:
    """The adapter's declarations, precomputed for the per-call checks."""

    def __init__(self, adapter: Adapter, catalog: Catalog, params: Dict[str, torch.Tensor], *,
                 strict: bool = False):
        self.adapter = adapter
        self.catalog = catalog
        self._params = params   # the compiled step's dict: it grows with lazily made weights
        devices = {p.device for p in params.values()}
        self._weights_device = devices.pop() if len(devices) == 1 else None  # checked when one
        dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
        self._weights_dtype = dtypes.pop() if len(dtypes) == 1 else None     # likewise
        # (what, path, declared element width or None): checked on every call
        self._placement_checked = [(f"region {r.name!r} state", r.input, r.element_bytes)
                                   for r in adapter.regions]
        if adapter.call_input is not None:
            self._placement_checked.append(("call input", adapter.call_input, None))
        self._extents = {r.name: set(catalog.region(r.name).extents) for r in adapter.regions}
        self._classes_ok = {e for e, _ in catalog.classes}
        self._declared = {r.name: [None if i == r.dim else adapter.dim_size(d, r)
                                   for i, d in enumerate(r.shape)] for r in adapter.regions}
        self.excluded: Optional[str] = None  # Criterion 3.5: a catalog too wide to specialise
        wide = [r for r in catalog.regions if not r.admissible]
        if wide:
            self.excluded = "; ".join(
                f"region {r.name!r} has K = {r.K} signature classes, over the width limit "
                f"{adapter.width_limit} (Criterion 3.5)" for r in wide) + (
                ": the step runs stock; raise the adapter's `width_limit` to "
                f"{max(r.K for r in wide)} if that many classes may be compiled, or leave the "
                "stage to an outer scheduler")
            if strict:
                raise GuardError(f"strict mode: {self.excluded}")
            log.warning("%s", self.excluded)

    # -- admission ------------------------------------------------------------------------
    def reason(self, by_path, carries: Dict[str, Carry]) -> Optional[str]:
        """Why this call cannot run a compiled class, or None when it is admitted. A call without
        any region state is the cache-free priming pass: a class of its own, keyed by its shapes."""
        if self.excluded:
            return self.excluded
        if torch.is_grad_enabled():
            grad = self._grad_reason(by_path)
            if grad is not None:
                return grad
        missing = [r.name for r in self.adapter.regions
                   if not isinstance(by_path.get(r.input), torch.Tensor)]
        if missing:   # (a key the state does not hold is a misspelt path, not a priming pass)
            self._check_declared_keys(by_path)
        if missing and len(missing) < len(self.adapter.regions):
            return (f"region(s) {missing} have no input state while the others have: a call "
                    "primes every region (the priming pass) or none; pass every region's state, "
                    "or none to prime")
        if missing:
            return None
        extents = []
        for r in self.adapter.regions:
            t = by_path[r.input]
            self._check_declared_shape(r, t, carries.get(r.name))
            e = t.shape[r.dim]
            if e not in self._extents[r.name]:
                return (f"region {r.name!r} extent {e} is not in the catalog "
                        f"{sorted(self._extents[r.name])} derived from its retention clocks; "
                        + _extent_fix(self.adapter, r, e, sorted(self._extents[r.name])))
            extents.append(e)
        if tuple(extents) not in self._classes_ok:
            return (f"region extents {tuple(extents)} never occur together in the catalog; pass "
                    "the states of one stream (every region's from the same call), or fix the "
                    "regions' `advance` clocks so that they move together as the stream does")
        ad = self.adapter
        if ad.call_input is not None:
            x = by_path.get(ad.call_input)
            if not isinstance(x, torch.Tensor):
                return (f"call input {ad.call_input!r} is missing; pass it, or fix the "
                        "adapter's `call_input`")
            w = x.shape[ad.call_dim]
            if not ad.admits(w):
                bound = (f"admission {ad.admission} = {ad.clocks[ad.admission]}" if ad.admission
                         else "no admission clock")
                return (f"call width {w} is neither a declared call width "
                        f"{list(ad.call_widths())} nor admitted ({bound}); declare a clock of "
                        f"{w} in `call_frames`, or an `admission` clock of at least {w} for "
                        "partial calls")
        return None

    def _grad_reason(self, by_path) -> Optional[str]:
        """With grad mode on, stock builds an autograd graph when a weight or an input requires
        grad, and its results require grad; a compiled call keeps no graph. Such a call runs the
        stock step (counted, with this reason), never a result with another ``requires_grad``."""
        weight = next((n for n, p in self._params.items() if p.requires_grad), None)
        arg = next((p for p, v in by_path.items()
                    if isinstance(v, torch.Tensor) and v.requires_grad), None)
        if weight is None and arg is None:
            return None
        what = f"weight {weight!r}" if weight is not None else f"input {arg!r}"
        return (f"grad mode is on and {what} requires grad, so the stock step builds an autograd "
                "graph (its results require grad), which a compiled call does not: the stock step "
                "runs; call the step under torch.inference_mode() (or torch.no_grad()), or freeze "
                "the weights with module.requires_grad_(False)")

    def _check_declared_keys(self, by_path) -> None:
        """A region path into a container the call has, naming a key it does not have, is a
        declaration that does not fit the step: it would fall back on every call, or, when no
        region's key is found, pass for the priming pass. Checked at the first call that hands
        the container over (compile time knows the step's arguments, not their keys)."""
        for r in self.adapter.regions:
            parent = r.input.rpartition(".")[0]
            if not parent or r.input in by_path:
                continue
            keys = sorted(p[len(parent) + 1:] for p in by_path if p.startswith(parent + "."))
            if keys:
                present = [q.name for q in self.adapter.regions if q.input in by_path]
                raise ContractError(
                    f"region {r.name!r} of adapter {self.adapter.name!r} reads {r.input!r}, but "
                    f"the step's {parent!r} holds {keys}; " + (
                        f"compile with adapter.select({', '.join(repr(n) for n in present)}) or "
                        "fix the region's `input`" if present else
                        f"fix the region's `input` (to prime, pass {parent.split('.')[0]!r} as "
                        "None, or the region's entry as None)"))

    def check_placement(self, by_path) -> None:
        """Region state and the call input must sit where the step's weights are. Floating region
        state whose element width contradicts both the region's declared ``element_bytes`` and the
        dtype every floating weight has is refused too (a float64 cache for float32 weights):
        a carry could never hold it, and the stock step would fail deep inside."""
        device, dtype = self._weights_device, self._weights_dtype
        for what, path, width in self._placement_checked:
            t = by_path.get(path)
            if not isinstance(t, torch.Tensor):
                continue
            if device is not None and t.device != device:
                raise ContractError(
                    f"{what} {path!r} is on {t.device}, but the step's weights are on "
                    f"{device}; move it with .to({str(device)!r})")
            if (width is not None and dtype is not None and t.dtype != dtype
                    and t.is_floating_point() and t.element_size() != width):
                raise ContractError(
                    f"{what} {path!r} is {t.dtype} ({t.element_size()}-byte elements), but the "
                    f"region declares element_bytes={width} and the step's weights are {dtype}; "
                    f"cast it with .to({dtype})")

    def _check_declared_shape(self, r: Region, t: torch.Tensor, carry: Optional[Carry]) -> None:
        """The state must have the declared shape outside the frame dim. Stock code may reserve
        more rows than it ever writes (Token2Wav's 16 solver-step slots for 10 steps): larger dims
        are accepted when the rows beyond the declaration hold zeros; absorption drops them."""
        if not r.shape or (carry is not None and carry.holds(t)):
            return
        want = self._declared[r.name]
        got = list(t.shape)
        bad = len(got) != len(want) or any(w is not None and w > g for w, g in zip(want, got))
        if not bad:
            for i, (w, g) in enumerate(zip(want, got)):
                if w is not None and g > w and t.narrow(i, w, g - w).any():
                    bad = True
        if bad:
            raise ContractError(
                f"region {r.name!r} of adapter {self.adapter.name!r} declares shape "
                f"{tuple('frames' if w is None else w for w in want)} but the step received "
                f"{tuple(got)} at {r.input!r}; fix the region's shape clocks")

    # -- absorption -----------------------------------------------------------------------
    def allocate(self, r: Region, like, carries: Dict[str, Carry]) -> Carry:
        """The region's carry: allocated once, zero-filled, at the declared extent (room
        included), with ``like``'s dtype and device and its sizes where the region declares none."""
        carry = carries.get(r.name)
        if carry is None:
            shape = [self.adapter.dim_size(d, r) for d in r.shape] if r.shape else list(like.shape)
            shape[r.dim] = self.catalog.region(r.name).declared_extent
            # a normal tensor even under inference_mode: later calls may run in other modes
            with torch.inference_mode(False), torch.no_grad():
                carry = Carry(r, torch.zeros(shape, dtype=like.dtype, device=like.device))
            carries[r.name] = carry
        return carry

    def _adoptable(self, r: Region, t: torch.Tensor) -> bool:
        """``t`` has the layout ``allocate`` would give the carry: the declared shape at the
        declared extent, contiguous, alone in its storage, a normal tensor (an inference tensor
        cannot be written outside inference mode) that needs no gradient."""
        shape = [self.adapter.dim_size(d, r) for d in r.shape] if r.shape else list(t.shape)
        shape[r.dim] = self.catalog.region(r.name).declared_extent
        storage = t.untyped_storage()
        return (list(t.shape) == shape and t.is_contiguous() and t.storage_offset() == 0
                and storage.nbytes() == t.numel() * t.element_size()
                and not t.is_inference() and not t.requires_grad)

    def absorb(self, r: Region, t: torch.Tensor, carries: Dict[str, Carry],
               counters: Counters, adopt: bool = False) -> torch.Tensor:
        """``t`` as the leading view of the region's carry (allocated on first sight at the
        declared extent), copying it in unless it already is that view. ``adopt``: a ``t`` that
        arrives before the carry exists, in the carry's exact layout, becomes the carry."""
        if adopt and r.name not in carries and self._adoptable(r, t):
            carries[r.name] = Carry(r, t.detach())
            counters.adoptions += 1
            return carries[r.name].view(t.shape[r.dim])
        carry = self.allocate(r, t, carries)
        frames = t.shape[r.dim]
        if carry.is_stale(t):
            raise GuardError(
                f"region {r.name!r}: this state is a view of the carry, but not the one the last "
                f"call returned; the carry was overwritten since. To retry a chunk, keep "
                f"state.clone() (or copy.deepcopy of the state) before the call and pass the clone")
        if carry.holds(t):
            return carry.view(frames)
        if t.device != carry.tensor.device or t.dtype != carry.tensor.dtype:
            c = carry.tensor
            raise ContractError(
                f"region {r.name!r}: state arrived as {t.dtype} on {t.device}, but its carry is "
                f"{c.dtype} on {c.device} (the stream's first state fixed it); pass the state as "
                f"state.to({str(c.device)!r}, {c.dtype}), or compile another step for "
                f"{t.dtype} states")
        src = t
        for i, size in enumerate(carry.tensor.shape):
            if i != r.dim and src.shape[i] > size:  # undeclared rows, checked to be zero
                src = src.narrow(i, 0, size)
        with torch.no_grad():
            if src.untyped_storage().data_ptr() == carry.tensor.untyped_storage().data_ptr():
                src = src.clone()
            carry.view(frames).copy_(src)
        counters.absorptions += 1
        return carry.view(frames)


def _extent_fix(adapter: Adapter, r: Region, e: int, extents) -> str:
    """The fix for a state whose extent is not in the region's catalog: beyond the retention
    bound, the clocks are wrong; off the grid, the advance is too coarse for the calls."""
    lo, hi = extents[0], extents[-1]
    if e > hi:
        return (f"it holds more than the {hi} frames retention keeps: fix the retention clocks "
                f"({', '.join(r.retention.clocks())}), or pass the state as retention cuts it")
    if e < lo:
        return (f"it holds fewer than the {lo} frames a stream starts with: fix the retention "
                f"clocks ({', '.join(r.retention.clocks())}), or pass the state the stock loop "
                "hands back")
    s = adapter.clocks[r.advance]
    step = math.gcd(s, e - lo)
    widths = adapter.call_widths()
    # an advance on the grid of the calls' gcd counts their frames (or is coarser than they are)
    if widths and (calls_in_region_units(adapter, r) or s % math.gcd(*widths) == 0):
        step = math.gcd(step, *widths)
        why = f"the gcd of the call widths {list(widths)} and of {e - lo}, the frames past {lo}"
    else:
        why = f"a divisor of {e - lo}, the frames past {lo}"
    return (f"lower the region's `advance` ({r.advance} = {s}) to {step} ({why}), so that every "
            "extent the stream reaches is in the catalog")


def check_paths(adapter: Adapter, arguments) -> None:
    """Every region input and the call input must name an argument of the step (``arguments``:
    its ``inspect.Signature``); otherwise every call would fall back. Raises a ``ContractError``
    naming the path, the step's arguments and an adapter that fits, checked at compile time."""
    params = arguments.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if takes_any:
        return
    bad = [(f"region {r.name!r}", r.input) for r in adapter.regions
           if r.input.split(".", 1)[0] not in names]
    if adapter.call_input is not None and adapter.call_input.split(".", 1)[0] not in names:
        bad.append(("call input", adapter.call_input))
    if not bad:
        return
    fits = [r.name for r in adapter.regions if r.input.split(".", 1)[0] in names]
    hint = []
    if fits and len(fits) < len(adapter.regions):
        hint.append(f"adapter.select({', '.join(repr(n) for n in fits)})")
    hint += [repr(n) for n in _registered_fitting(names) if n != adapter.name]
    what = "; ".join(f"{who} reads {path!r}" for who, path in bad)
    raise ContractError(
        f"adapter {adapter.name!r} does not fit this step: {what}, but the step's arguments are "
        f"{names}. " + (f"Use {' or '.join(hint)}." if hint else
                        "Fix the paths (`input`, `call_input`) to name the step's arguments."))


def _registered_fitting(names) -> list:
    from cadence_fx import adapters   # the registry (declarations only)
    fitting = []
    for name in adapters.names():
        ad = adapters.get(name)
        heads = {r.input.split(".", 1)[0] for r in ad.regions}
        if ad.call_input is not None:
            heads.add(ad.call_input.split(".", 1)[0])
        if heads <= set(names):
            fitting.append(name)
    return fitting


def check_envelopes(adapter: Adapter, buffer_names: Iterable[str]) -> None:
    """Every region's ``envelope`` must name a buffer of the step's module, by its full dotted
    name or its last component (``att_cache_buffer`` for ``flow.decoder.att_cache_buffer``).
    A name that matches none would leave the envelope's memory held and its stock readers
    unguarded without a word: refused at compile time, with the module's buffers listed."""
    names = list(dict.fromkeys(buffer_names))
    tails = {n.rsplit(".", 1)[-1] for n in names} | set(names)
    for r in adapter.regions:
        if r.envelope is None or r.envelope in tails:
            continue
        shown = names[:_LISTED] + ([f"... {len(names) - _LISTED} more"] if len(names) > _LISTED else [])
        close = difflib.get_close_matches(r.envelope, sorted(tails), n=1)
        raise ContractError(
            f"region {r.name!r} of adapter {adapter.name!r} names the envelope {r.envelope!r}, "
            f"but the step's module has no buffer of that name (its buffers: "
            f"{', '.join(shown) or 'none'}); "
            + (f"did you mean {close[0]!r}? " if close else "")
            + "fix `envelope` to name the buffer the stock code over-reserves, or leave it out")


_LISTED = 24   # buffers named in that error; a large model lists the first ones and a count
