"""``ExplicitState`` stacks the stock per-layer ring caches into one tensor per stack: the state
must never exist twice while it does (the 7B Moshi LM's rings are 1.6 GB), and a ring that is not
all zero must arrive in the stacked tensor unchanged."""
import dataclasses
import weakref

import pytest
import torch
from torch import nn

from cadence_fx.models import explicit_state as ES


class RingKVCache:               # the name is what ``explicit_state`` recognises
    def __init__(self, fill):
        self.cache = torch.full((2, 1, 2, 6, 4), float(fill))
        self.end_offset = torch.zeros(1, dtype=torch.long)


@dataclasses.dataclass
class _State:
    kv_cache: RingKVCache
    offset: torch.Tensor


class _Layer(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self._streaming_state = _State(RingKVCache(fill), torch.zeros(1))


class _Stack(nn.Module):
    """A streaming root with ``layers.<i>`` ring caches, as moshi's transformers have."""

    def __init__(self, fills):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(f) for f in fills)

    def _apply_named_streaming(self, fn):
        for i, layer in enumerate(self.layers):
            fn(f"layers.{i}", layer)

    def streaming(self, batch):
        return _Entered()


class _Entered:
    def close(self):
        pass


class _Step(ES.ExplicitState):
    def __init__(self, fills):
        super().__init__()
        self.stack = _Stack(fills)
        self._setup([self.stack], {"stack.layers": "kv"}, {}, batch=1)

    def _roots(self):
        return {"stack": self.stack}


def _spy(monkeypatch, rings, live_at_alloc):
    """Weak references to the stock rings as the step first lists them, and how many of them
    are alive when the stacked tensor is allocated."""
    slots = ES.ExplicitState._all_slots

    def listing(self):
        found = slots(self)
        if not rings:
            rings.extend(weakref.ref(getattr(s.holder, s.attr)) for s in found if s.index is not None)
        return found

    zeros, empty = torch.zeros, torch.empty

    def allocating(make):
        def alloc(*args, **kwargs):
            t = make(*args, **kwargs)
            if rings and t.dim() == 6:
                live_at_alloc.append(sum(r() is not None for r in rings))
            return t
        return alloc

    monkeypatch.setattr(ES.ExplicitState, "_all_slots", listing)
    monkeypatch.setattr(torch, "zeros", allocating(zeros))
    monkeypatch.setattr(torch, "empty", allocating(empty))


def test_every_ring_is_let_go_before_the_stacked_tensor_is_allocated(monkeypatch):
    rings, live = [], []
    _spy(monkeypatch, rings, live)
    step = _Step([0, 0, 0])
    assert len(rings) == 3 and live == [0]
    state = step.initial_state()
    assert state["kv"].shape == (3, 2, 1, 2, 6, 4) and not state["kv"].any()
    # every layer reads and writes its slice of the stacked tensor
    for i, layer in enumerate(step.stack.layers):
        assert layer._streaming_state.kv_cache.cache.data_ptr() == state["kv"][i].data_ptr()


def test_a_ring_that_is_not_zero_arrives_in_the_stacked_tensor_unchanged():
    step = _Step([0, 1.5, -2])
    kv = step.initial_state()["kv"]
    assert [float(kv[i].unique()) for i in range(3)] == [0.0, 1.5, -2.0]
    # and the step keeps it to start later turns from
    kv.fill_(7)
    again = step.reset_state({"kv": kv, **{k: v for k, v in step.initial_state().items() if k != "kv"}})
    assert [float(again["kv"][i].unique()) for i in range(3)] == [0.0, 1.5, -2.0]


def test_rings_that_cannot_stack_are_refused_before_any_is_let_go():
    stack = _Stack([0, 0])
    stack.layers[1]._streaming_state.kv_cache.cache = torch.zeros(2, 1, 2, 7, 4)

    class Odd(_Step):
        def __init__(self):
            ES.ExplicitState.__init__(self)
            self.stack = stack
            self._setup([self.stack], {"stack.layers": "kv"}, {}, batch=1)

    with pytest.raises(RuntimeError, match="layer 1 .* they cannot stack"):
        Odd()
    assert all(layer._streaming_state.kv_cache.cache is not None for layer in stack.layers)


def test_a_failed_allocation_puts_every_ring_back(monkeypatch):
    """Out of memory for the stacked tensor: every ring let go is bound again with its values,
    and the error reaches the caller."""
    step_layers = _Stack([0, 1.5, -2])
    zeros = torch.zeros

    def no_room(*args, **kwargs):
        t = zeros(*args, **kwargs)
        if t.dim() == 6:
            raise torch.OutOfMemoryError("no room for the stacked rings (test)")
        return t

    class Failing(_Step):
        def __init__(self):
            ES.ExplicitState.__init__(self)
            self.stack = step_layers
            self._setup([self.stack], {"stack.layers": "kv"}, {}, batch=1)

    monkeypatch.setattr(torch, "zeros", no_room)
    with pytest.raises(torch.OutOfMemoryError, match="stacked rings"):
        Failing()
    monkeypatch.setattr(torch, "zeros", zeros)
    rings = [layer._streaming_state.kv_cache.cache for layer in step_layers.layers]
    assert [float(r.unique()) for r in rings] == [0.0, 1.5, -2.0]
    assert all(r.shape == (2, 1, 2, 6, 4) for r in rings)


def test_a_ring_of_negative_zeros_keeps_its_sign():
    """-0.0 is not +0: such a ring is copied, not made again as zeros."""
    step = _Step([-0.0, 0, 0])
    kv = step.initial_state()["kv"]
    assert torch.signbit(kv[0]).all() and not torch.signbit(kv[1:]).any()


def test_zero_bits_are_read_through_the_storage():
    """+0 only: -0.0 and NaN are not zeros; integers and booleans by value."""
    z = ES._zero_bits
    assert z(torch.zeros(3, dtype=torch.bfloat16)) and z(torch.zeros(2, 3)) and z(torch.zeros(4, dtype=torch.long))
    assert not z(torch.tensor([0.0, -0.0])) and not z(torch.tensor([float("nan")], dtype=torch.bfloat16))
    assert not z(torch.tensor([False, True])) and z(torch.zeros(2, 3).t())    # a strided view too

