"""The carry pass's window, retention and materialize rewrites, asserted exactly (the rewrite
records, the copies left in the graph, ``torch.equal`` against stock).

Written against mutants of the carry pass that the stream tests let through
(``bench/mutation.py``, ``bench/results/2026-11-30-mutation.md``; run J's survivors:
``.mutation/ledger/run-J-carry-dispositions.md``)."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.audit import Auditor
from cadence_fx.catalog import build_catalog
from cadence_fx.context import Carry, PassContext, RegionBinding
from cadence_fx.contract import APPEND, Adapter, PromptRetained, Region, Ring, SlidingWindow
from cadence_fx.counters import Counters
from cadence_fx.tracing import trace_step

carry_pass = importlib.import_module("cadence_fx.passes.carry_retention")  # the module, not the function

COPY, CLONE, CAT = (torch.ops.aten.copy_.default, torch.ops.aten.clone.default,
                    torch.ops.aten.cat.default)
SLICE = torch.ops.aten.slice.Tensor


def _adapter(w, c):
    return Adapter(name="only-window", clocks={"W": w, "c": c},
                   regions=(Region(name="k", input="cache", output="1", dim=2,
                                   retention=SlidingWindow("W"), advance="c", ordering=APPEND,
                                   shape=(1, 2, None)),),
                   call_frames=("c",), call_input="x", call_dim=2)


class OnlyWindow(nn.Module):
    """Attention over a window of the last ``W`` frames: nothing but the window reads the
    concatenation, taken in one of the forms streaming code writes it."""

    def __init__(self, form, w, c):
        super().__init__()
        self.form, self.w, self.c = form, w, c

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        n, w = full.shape[2], self.w
        keep = min(w, n)
        steady = n == cache.shape[2] + self.c and cache.shape[2] == w
        if self.form == "narrow":
            new = full.narrow(2, n - keep, keep)
        elif self.form == "split":
            new = full.split([n - keep, keep], 2)[1]
        elif self.form == "split-int" and steady:      # uneven: [c, W] with c > W
            new = full.split(self.c, 2)[1]
        elif self.form == "chunk" and steady:          # [W, W]
            new = full.chunk(2, 2)[1]
        elif self.form == "chunk-uneven" and steady:   # chunk(3) of 10 frames: [4, 4, 2]
            new = full.chunk(3, 2)[2]
        elif self.form == "split-one" and steady:      # one-frame parts
            new = full.split(1, 2)[1]
        elif self.form == "chunk-one":                 # a window of the one part
            new = full.chunk(1, 2)[0][:, :, -w:]
        elif self.form == "slice-of-slice":            # a window of a longer slice
            new = full[:, :, -(w + 1):][:, :, 1:] if n > w else full
        else:
            new = full[:, :, -w:]
        return new.softmax(2).sum(2, keepdim=True), new


# form -> (W, c, copies in the steady class, its rewrite record). Where the window starts inside
# the old frames and is the one thing read of the concatenation, it is read from C[:W] after they
# move down first (two pieces), x written after them: three copies, no temporary. Otherwise (it
# starts inside x, c > W; or it is taken from a longer part or slice) x is written into the room
# and the window moves down last: by c, in one piece, or through one temporary.
CLONES = {"chunk-one": 1, "slice-of-slice": 1}
FORMS = {
    "chunk-one": (6, 2, 2, "cat (append, 6 + 2 frames) became in-place writes; its window [2, 8) is C[:6]"),
    "slice-of-slice": (6, 2, 2, "cat (append, 6 + 2 frames) became in-place writes; its window [2, 8) is C[:6]"),
    "narrow": (6, 2, 3, "cat (append, 6 + 2 frames) became in-place writes; its window [2, 8) is C[:6]"),
    "split": (6, 2, 3, "cat (append, 6 + 2 frames) became in-place writes; its window [2, 8) is C[:6]"),
    "split-one": (1, 1, 1, "cat (append, 1 + 1 frames) became in-place writes; its window [1, 2) is C[:1]"),
    "split-int": (4, 6, 2, "cat (append, 4 + 6 frames) became in-place writes; its window [6, 10) is C[:4]"),
    "chunk": (6, 6, 1, "cat (append, 6 + 6 frames) became in-place writes; its window [6, 12) is C[:6]"),
    "chunk-uneven": (2, 8, 2, "cat (append, 2 + 8 frames) became in-place writes; its window [8, 10) is C[:2]"),
}


def _graph_nodes(entry):
    """The class's rewritten graph before partitioning."""
    return list(entry.records.get("graph", entry.gm).graph.nodes)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_window_read_alone_moves_first_whatever_its_form(form):
    w, c, copies, detail = FORMS[form]
    model = OnlyWindow(form, w, c)
    compiled = cadence_fx.compile(model, _adapter(w, c))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 2, c, generator=g) for _ in range(4)]
    ours = ref = torch.zeros(1, 2, 0)
    for x in xs:
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.carry_addresses) == (4, 0, 1)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((w,), c)]
    assert [r["detail"] for r in steady.records["rewrites"]] == [detail]
    nodes = _graph_nodes(steady)
    assert sum(n.target is COPY for n in nodes) == copies
    assert sum(n.target is CLONE for n in nodes) == CLONES.get(form, 0)
    assert not [n for n in nodes if n.target is CAT]


class CloneState(nn.Module):
    """The new state is a clone of a fresh result's tail (not a window of the old state): it is
    materialized into the carry once. ``users`` > 1: the clone is also read by the step;
    ``kwargs``: the clone names its memory format."""

    def __init__(self, users=1, kwargs=False):
        super().__init__()
        self.users, self.kwargs = users, kwargs

    def forward(self, x, cache):
        tail = (torch.cat([cache, x], 2) * 2)[:, :, -4:]
        new = tail.clone(memory_format=torch.contiguous_format) if self.kwargs else tail.clone()
        y = x + 1 if self.users == 1 else x + new.sum()
        return y, new


def _lockstep(compiled, model, calls: int, seed: int) -> None:
    """``calls`` 2-frame chunks through the compiled step and the stock module side by side,
    each from its own last state: every output and state equal."""
    g = torch.Generator().manual_seed(seed)
    ours = ref = torch.zeros(1, 2, 0)
    for _ in range(calls):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)


@pytest.mark.parametrize("users,kwargs,clones", [(1, False, 0), (2, False, 1), (1, True, 1)],
                         ids=["copied-from-its-source", "read-by-the-step", "memory-format"])
def test_a_cloned_state_is_copied_from_its_source_once(users, kwargs, clones):
    """A clone read only as the new state is not made: the carry copies its source, once, as
    stock copies it. A clone the step reads too, or one with arguments, stays."""
    model = CloneState(users, kwargs)
    compiled = cadence_fx.compile(model, _adapter(4, 2))
    _lockstep(compiled, model, calls=3, seed=1)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (3, 0)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    assert [r["kind"] for r in steady.records["rewrites"]] == ["materialize"]
    nodes = _graph_nodes(steady)
    assert sum(n.target is COPY for n in nodes) == 1
    assert sum(n.target is CLONE for n in nodes) == clones


class KeepsItsState(nn.Module):
    """Once the window is full the new state is a clone of the old state (the carry itself):
    its source is the carry, so the clone is kept and the carry copies the clone."""

    def forward(self, x, cache):
        new = cache.clone() if cache.shape[2] == 4 else torch.cat([cache, x], 2)[:, :, -4:]
        return x + 1, new


def test_a_clone_of_the_carry_is_kept_as_the_source_of_the_copy():
    model = KeepsItsState()
    compiled = cadence_fx.compile(model, _adapter(4, 2))
    _lockstep(compiled, model, calls=4, seed=2)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (4, 0)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    assert [r["kind"] for r in steady.records["rewrites"]] == ["materialize"]
    nodes = _graph_nodes(steady)
    assert (sum(n.target is COPY for n in nodes), sum(n.target is CLONE for n in nodes)) == (1, 1)


class SumsItsState(nn.Module):
    """A window whose step reduces the whole old state (``cache.sum()``)."""

    def forward(self, x, cache):
        return x + cache.sum(), torch.cat([cache, x], 2)[:, :, -4:]


@pytest.mark.xfail(strict=True, reason="the state is handed to the step as a carry view "
                   "C[..., :e], not contiguous when the frame dim is not the outermost; a "
                   "reduction over all of it may round differently from stock's contiguous cache")
def test_a_full_reduction_over_the_state_is_bit_exact():
    model = SumsItsState()
    compiled = cadence_fx.compile(model, _adapter(4, 2))
    g = torch.Generator().manual_seed(2)
    ours = ref = torch.zeros(1, 2, 0)
    same = []
    for _ in range(6):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        same.append(torch.equal(y, y_ref) and torch.equal(ours, ref))
    assert compiled.counters.compiled_calls == 6
    assert same == [True] * 6, same


# -- the envelope rewrite (passes/_carry_envelope.py) ------------------------------------------------

def _envelope_adapter(slots=3, frames=16):
    """A 4-frame window advancing 2 frames a call (the carry holds 6), whose stock code keeps it in
    slot 0 of a ``(slots, 2, frames)`` envelope buffer ``env``."""
    return Adapter(name="envelope-window", clocks={"W": 4, "c": 2},
                   regions=(Region(name="k", input="cache", output="1", dim=2,
                                   retention=SlidingWindow("W"), advance="c", ordering=APPEND,
                                   shape=(1, 2, None), envelope="env",
                                   stock_shape=(slots, 2, frames)),),
                   call_frames=("c",), call_input="x", call_dim=2)


class EnvelopeReads(nn.Module):
    """The window is written into slot 0 of ``env`` and the new state is its last 4 frames, a
    view of the envelope. Besides, the step reads: ``tail``, all but the oldest frame of the state
    (a slice of a slice starting past 0); ``last-slot``, the last slot through a slice and a
    negative select (slots 1 and 2 hold ``spare``, never written); ``slot-added-in-place``, slot
    2 as the source of an in-place add; ``frames-added-in-place``, frames [6, 8) of slot 0
    (never written: zeros); ``permuted-copy``, a frames-first copy of every slot, doubled and
    summed over the slots (zeros but slot 0); ``as-double``, slot 0 summed over its frames in float64
    (``dtype`` is a keyword argument of the traced op); ``writes-slot-1``, none, but it writes x into slot 1;
    ``past-extent``, frame 7 of slot 0, one past the carry's 6 frames, by select (never written:
    zeros)."""
    W = 4

    def __init__(self, read, spare=0.0):
        super().__init__()
        self.read = read
        env = torch.zeros(3, 2, 16)
        env[1:] = spare
        self.register_buffer("env", env, persistent=False)

    def forward(self, x, cache):
        n = cache.shape[2] + x.shape[2]
        self.env[0:1, :, :n] = torch.cat([cache, x], 2)
        state = self.env[0:1, :, max(0, n - self.W):n]
        if self.read == "tail":
            y = state[:, :, 1:] * 2
        elif self.read == "last-slot":
            y = x + self.env[1:][-1][:, :x.shape[2]]
        elif self.read == "slot-added-in-place":
            y = x.clone()
            y.add_(self.env[2:3, :, :x.shape[2]])
        elif self.read == "frames-added-in-place":
            y = x.clone()
            y.add_(self.env[0:1, :, 6:8])
        elif self.read == "permuted-copy":
            y = (self.env[:, :, :n].permute(2, 1, 0).clone() * 2).sum(2, keepdim=True)
        elif self.read == "as-double":
            y = self.env[0:1, :, :n].sum(2, keepdim=True, dtype=torch.float64) * 2
        elif self.read == "writes-slot-1":
            self.env[1:2, :, :x.shape[2]] = x
            y = x * 2
        else:
            y = x + self.env[0, :, 7][None, :, None]
        return y, state


def _envelope_stream(read, spare=0.0, entry=False):
    """Three calls (extents 0, 2, 4) compiled and stock side by side, every result equal; the
    steady class's rewrite kinds and near-miss details (and, with ``entry``, the class)."""
    model = EnvelopeReads(read, spare)
    compiled = cadence_fx.compile(EnvelopeReads(read, spare), _envelope_adapter())
    g = torch.Generator().manual_seed(4)
    ours = ref = torch.zeros(1, 2, 0)
    for _ in range(3):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (3, 0)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    return ([r["kind"] for r in steady.records["rewrites"]],
            [m["detail"] for m in steady.records["near_misses"]]) + ((steady,) if entry else ())


def test_an_envelope_slice_of_a_slice_is_bounded_within_its_parent():
    """All but the oldest frame of the state (a slice of the slice [2, 6)) is frames [3, 6) of
    the carry's 6: the carry stands in for the envelope."""
    kinds, misses, steady = _envelope_stream("tail", entry=True)
    assert (kinds, misses) == (["envelope", "materialize"], [])
    envelope = steady.records["rewrites"][0]
    assert (envelope["region"], envelope["detail"]) == ("k", "env (3, 2, 16) -> carry (1, 2, 6)")


@pytest.mark.parametrize("read,spare,detail", [
    ("last-slot", 1.0, "envelope env: the step reads rows [1, 3) of dim 0 that are not declared "
                       "and not known to be zero"),
    ("last-slot", 0.0, "envelope env: the step's shapes do not follow the declared extent "
                       "(IndexError: "),
    ("slot-added-in-place", 1.0, "envelope env: the step reads rows [1, 3) of dim 0 that are not "
                                 "declared and not known to be zero"),
    ("frames-added-in-place", 0.0, "envelope env: the step reads [6, 8) of dim 2, beyond the "
                                   "declared 6; declare a larger extent or fix the clocks"),
    ("writes-slot-1", 0.0, "envelope env: the step writes [1, 2) of dim 0, beyond the declared 1; "
                           "declare a larger extent or fix the clocks"),
    ("past-extent", 0.0, "envelope env: the step reads [7, 8) of dim 2, beyond the declared 6; "
                         "declare a larger extent or fix the clocks"),
], ids=["last-slot-of-ones", "last-slot-of-zeros", "slot-added-in-place", "frames-added-in-place",
        "writes-slot-1",
        "one-frame-past-the-extent"])
def test_an_envelope_read_beyond_the_carry_is_a_near_miss_naming_its_rows(read, spare, detail):
    """The last slot (index -1 of slots [1, 3), i.e. slot 2) holding ones is refused by its rows;
    holding zeros it passes the check, but the one-slot carry has no slot 2 to select, so the
    envelope is put back. An in-place op reading a slot reads it; a slot written is refused
    whatever it holds. Frame 7 is past the frames the carry holds, on the frame dim, where zeros
    do not help."""
    kinds, (miss,) = _envelope_stream(read, spare)
    assert kinds == ["materialize"]
    assert miss.startswith(detail) if detail.endswith(": ") else miss == detail


@pytest.mark.parametrize("read,node,layout", [
    ("permuted-copy", "mul", ((6, 2, 1), (1, 6, 12), torch.float32)),
    ("as-double", "mul", ((1, 2, 1), (2, 1, 1), torch.float64)),
    ("last-slot", "slice_5", ((2, 2, 16), (32, 16, 1), torch.float32)),
])
def test_fake_values_after_the_envelope_is_replaced_are_those_of_the_rewritten_graph(read, node,
                                                                                     layout):
    """Replacing the (3, 2, 16) envelope by the (1, 2, 6) carry changes the shape of the copy of
    every slot, (6, 2, 3) -> (6, 2, 1), not its strides: the fake values downstream of it (the
    doubling) are recomputed too; a float64 sum is recomputed with its ``dtype`` keyword. Where
    the carry cannot stand in (``last-slot``: it has no slot 2), the envelope is put back and the
    values recomputed from it (slots [1, 3) of the envelope again). Every fake value of the
    rewritten graph is what fake propagation of that graph gives."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    kinds, misses, steady = _envelope_stream(read, entry=True)
    assert kinds == (["materialize"] if read == "last-slot" else ["envelope", "materialize"])
    assert [m["region"] for m in steady.records["near_misses"]] == ["k"] * (read == "last-slot")
    gm = steady.records["graph"]

    def layouts():
        return {n.name: (tuple(v.shape), v.stride(), v.dtype) for n in gm.graph.nodes
                if n.op == "call_function" and isinstance(v := n.meta.get("val"), torch.Tensor)}

    stored = layouts()
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, placeholders[0].fake_mode).propagate_dont_convert_inputs(*placeholders)
    fresh = layouts()   # (the copies the materialize rewrite inserts carry no fake value)
    assert stored == {name: fresh[name] for name in stored}
    assert stored[node] == layout


class HandsOutAViewOfTheWindow(nn.Module):
    """Besides the new state (the last 4 frames of the concatenation, which is also read whole)
    the step returns the window's oldest frame, a view of a view of the concatenation. Once the
    concatenation is a view of the carry, so is that frame: it is handed out as a copy."""

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        new = full[:, :, -4:]
        return full * 2, new, new[:, :, :1]


def test_a_view_of_a_view_of_the_concatenation_is_handed_out_as_a_copy():
    model = HandsOutAViewOfTheWindow()
    compiled = cadence_fx.compile(model, _adapter(4, 2))
    g = torch.Generator().manual_seed(5)
    ours = ref = torch.zeros(1, 2, 0)
    held = []
    for _ in range(5):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours, first), (y_ref, ref, first_ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
        held.append((first, first_ref))
    assert all(torch.equal(a, b) for a, b in held)   # none changed under a later call
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (5, 0)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    assert [r["kind"] for r in steady.records["rewrites"]] == ["retention"]


class SquareState(nn.Module):
    """A 2-frame window of 2 channels. Once it is full, the new state is the old state detached
    (``detached-state``: the same frames) or transposed (``transposed-state``: the shape of the
    carry's leading view, other values), or the concatenation starts with the old state
    transposed (``transposed-window``); ``every-other`` joins every other frame of a 4-frame
    old state (a strided view of it) with the 2 new frames."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        steady = cache.shape[2] == 2
        if self.form in ("detached-state", "transposed-state"):
            old = cache.detach() if self.form == "detached-state" else cache.transpose(1, 2)
            return x + 1, old if steady else torch.cat([cache, x], 2)[:, :, -2:]
        if self.form == "transposed-window":
            full = torch.cat([cache.transpose(1, 2) if steady else cache, x], 2)
            return full * 2, full[:, :, -2:]
        full = torch.cat([cache[:, :, ::2], x], 2)      # every-other
        return full * 2, full


def _square_stream(form, w, first):
    model = SquareState(form)
    compiled = cadence_fx.compile(model, _adapter(w, 2))
    g = torch.Generator().manual_seed(6)
    ours = torch.randn(1, 2, first, generator=g)
    ref, same = ours.clone(), []
    for _ in range(4):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        same.append(torch.equal(y, y_ref) and torch.equal(ours, ref))
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((w,), 2)]
    return compiled, steady, same


@pytest.mark.parametrize("form,w,first", [("detached-state", 2, 0), ("transposed-window", 2, 0),
                                          ("every-other", 4, 4)])
def test_a_view_of_the_old_state_other_than_its_leading_frames_is_not_the_carry(form, w, first):
    """The old state detached, or transposed, or every other frame of it, is not recognized as
    ``C[:frames]`` (a view chain of slices from the carry): the new state is copied into the
    carry, not taken as already in place, nor the concatenation as a window of the old state."""
    compiled, steady, same = _square_stream(form, w, first)
    assert same == [True] * 4
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.absorptions) == (4, 0, 1)
    assert [r["kind"] for r in steady.records["rewrites"]] == ["materialize"]


def test_a_transposed_old_state_as_the_new_state_is_bit_exact():
    """The new state is the old state transposed (a square state): stock returns it in the
    transposed layout, so it is not copied into the (contiguous) carry but handed back as a copy
    of that view, a near miss naming both layouts; the next call copies it in."""
    compiled, steady, same = _square_stream("transposed-state", 2, 0)
    assert compiled.counters.compiled_calls == 4
    assert steady.records["rewrites"] == []
    (miss,) = steady.records["near_misses"]
    assert "dims outermost first (2, 1)" in miss["detail"] and "(1, 2)" in miss["detail"]
    assert same == [True] * 4, same


class EnvelopeOfTheCarrysShape(nn.Module):
    """An envelope of exactly the carry's shape (1, 2, 6): the window is written into it, the new
    state is its last 4 frames, and the step also returns its first frame, a view of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("env", torch.zeros(1, 2, 6), persistent=False)

    def forward(self, x, cache):
        n = cache.shape[2] + x.shape[2]
        self.env[:, :, :n] = torch.cat([cache, x], 2)
        return self.env[:, :, :1], self.env[:, :, max(0, n - 4):n]


def test_a_result_viewing_an_envelope_of_the_carrys_shape_is_handed_out_as_a_copy():
    """The carry replaces the envelope without any value changing shape, so the other result
    keeps the envelope's storage in its fake value: that storage counts as the carry's, and in
    the steady class (the state copied into ``C[:4]``) the result is handed out as a copy, not as
    a view of the carry."""
    model = EnvelopeOfTheCarrysShape()
    compiled = cadence_fx.compile(EnvelopeOfTheCarrysShape(), _envelope_adapter(slots=1, frames=6))
    g = torch.Generator().manual_seed(7)
    ours = ref = torch.zeros(1, 2, 0)
    for i in range(4):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
        if i >= 2:   # extents 0, 2, then 4 (the steady class)
            carry = compiled.carries["k"].tensor
            assert y.untyped_storage().data_ptr() != carry.untyped_storage().data_ptr()
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (4, 0)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    assert [r["kind"] for r in steady.records["rewrites"]] == ["envelope", "materialize"]


def test_a_graph_without_fake_values_is_refused_with_the_fix():
    from cadence_fx.passes._carry_graph import fake_mode

    gm = torch.fx.symbolic_trace(nn.ReLU())   # no fake values on its nodes
    with pytest.raises(ValueError) as e:
        fake_mode(gm)
    assert str(e.value) == ("the traced graph carries no fake values; trace with "
                            "tracing_mode='fake'")


# -- the carry pass alone, record by record (passes/carry_retention.py) ------------------------------
# Each note the pass leaves is asserted whole: kind, region and text, as the report shows them.

def _region_adapter(retention, output="1", **clocks):
    """One region ``k`` of 2 channels, frame dim 2, advancing ``c`` = 2 frames a call."""
    return Adapter(name="direct", clocks={"c": 2, **clocks},
                   regions=(Region(name="k", input="cache", output=output, dim=2,
                                   retention=retention, advance="c", ordering=APPEND,
                                   shape=(1, 2, None)),),
                   call_frames=("c",), call_input="x", call_dim=2)


def _bound(module, adapter, extent=None, **named):
    """``module`` traced at ``named`` and its one region bound as the runtime binds it (a carry of
    the declared extent, or ``extent`` frames): the graph and the pass context, the pass not run."""
    traced = trace_step(module, module.forward, named)
    gm, inputs = traced.gm, list(traced.inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_pos = {p: k for k, p in enumerate(traced.out_paths[i] for i in traced.out_tensor_index)}
    (r,) = adapter.regions
    ph = next(n for n, s in zip(placeholders, inputs) if s.kind == "arg" and s.name == r.input)
    shape = [adapter.dim_size(d, r) for d in r.shape]
    shape[r.dim] = extent or build_catalog(adapter).region(r.name).declared_extent
    b = RegionBinding(r, ph, out_pos.get(r.output), Carry(r, torch.zeros(shape)))
    return gm, PassContext(adapter=adapter, class_key="test", inputs=inputs, regions=[b],
                           module_buffers=dict(module.named_buffers()), counters=Counters(),
                           auditor=Auditor())


def _carry_retention(gm, ctx):
    result = carry_pass.carry_retention(gm, ctx)
    result.graph_module.graph.lint()
    return result.graph_module


def _output(gm):
    return next(n for n in gm.graph.nodes if n.op == "output")


def _named(cache_frames, x_frames=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(1, 2, x_frames, generator=g),
            "cache": torch.randn(1, 2, cache_frames, generator=g)}


class Keeps(nn.Module):
    """``window``: the last 4 frames of ``cat([cache, x])``; ``all``: every frame of it."""

    def __init__(self, form="window"):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        full = torch.cat([cache, x], 2)
        return x + 1, full[:, :, -4:] if self.form == "window" else full


def test_a_new_state_without_a_fake_value_is_a_near_miss_and_left_as_it_is():
    """The new state lost its recorded value: the region is noted as a near miss, with the
    reason, and its state is handed out as computed (no carry write, no rewrite record)."""
    gm, ctx = _bound(Keeps(), _region_adapter(SlidingWindow("W"), W=4), **_named(4))
    state = _output(gm).args[0][1]
    del state.meta["val"]
    gm = _carry_retention(gm, ctx)
    assert ctx.records["near_misses"] == [
        {"kind": "near_miss", "region": "k", "detail": "the new state has no recorded shape"}]
    assert ctx.records["rewrites"] == []
    assert _output(gm).args[0][1] is state and not [n for n in gm.graph.nodes if n.target is COPY]


def test_a_new_state_beyond_the_declared_extent_is_a_near_miss_naming_both():
    """Six frames kept where the carry holds four: a near miss naming the frames and the extent,
    the state handed out as computed."""
    gm, ctx = _bound(Keeps("all"), _region_adapter(SlidingWindow("W"), W=4), extent=4,
                     **_named(4))
    state = _output(gm).args[0][1]
    gm = _carry_retention(gm, ctx)
    assert ctx.records["near_misses"] == [
        {"kind": "near_miss", "region": "k", "detail": "new state holds 6 frames, beyond the "
                                                       "declared extent 4; check the retention clocks"}]
    assert ctx.records["rewrites"] == []
    assert _output(gm).args[0][1] is state and not [n for n in gm.graph.nodes if n.target is COPY]


class RingOfFour(nn.Module):
    """A ring written in place at ``(offset + t) % 4``: the new state is the region input."""

    def forward(self, x, cache, offset):
        idx = (torch.arange(x.shape[2]) + offset) % cache.shape[2]
        cache.index_copy_(2, idx, x)
        return cache.mean(2), cache, offset + x.shape[2]


def test_a_state_already_in_the_carry_is_recorded_in_place():
    """The ring's new state is ``C[:4]`` itself: recorded ``in_place`` for its region, with the
    frames, and nothing copied."""
    named = {"x": torch.randn(1, 2, 1), "cache": torch.randn(1, 2, 4), "offset": torch.tensor([3])}
    gm, ctx = _bound(RingOfFour(), _region_adapter(Ring("cap"), cap=4, c=1), **named)
    gm = _carry_retention(gm, ctx)
    assert ctx.records["rewrites"] == [
        {"kind": "in_place", "region": "k", "detail": "state is already C[:4]"}]
    assert ctx.records["near_misses"] == [] and not [n for n in gm.graph.nodes if n.target is COPY]


class HalvesItsCacheLate(nn.Module):
    """The new state is formed, then the old state (the carry) is halved in place."""

    def forward(self, x, cache):
        new = torch.cat([cache, x], 2)[:, :, -4:]
        cache.mul_(0.5)
        return x * 2, new


def test_a_carry_write_after_the_new_state_is_a_near_miss_of_its_region():
    """The near miss names its region and the node writing the carry late; the state is handed
    out as computed."""
    gm, ctx = _bound(HalvesItsCacheLate(), _region_adapter(SlidingWindow("W"), W=4), **_named(4))
    state = _output(gm).args[0][1]
    gm = _carry_retention(gm, ctx)
    assert ctx.records["near_misses"] == [
        {"kind": "near_miss", "region": "k",
         "detail": "mul_ writes the carry after the new state is formed"}]
    assert ctx.records["rewrites"] == [] and _output(gm).args[0][1] is state


class KeepsPromptAndHistory(nn.Module):
    """Prompt + history, ``cat([X[:2], X[-4:]])`` of ``X = cat([cache, x])`` (``retain``), or of
    ``X = tanh(cat([cache, x]))``, a fresh tensor that is no join of the old state (``fresh``);
    the look-alikes: ``wrong-part`` keeps frames [2, 6) (not the last 4), ``two-sources`` takes
    the history from ``X * 0.5``, ``halved`` joins ``X[:2]`` with all of ``X * 0.5`` (no slice)."""

    def __init__(self, form="retain"):
        super().__init__()
        self.form = form

    def forward(self, x, cache):
        xc = torch.cat([cache, x], 2)
        if self.form == "fresh":
            xc = xc.tanh()
        if self.form == "wrong-part":
            return x * 2, torch.cat([xc[:, :, :2], xc[:, :, 2:6]], 2)
        if self.form == "two-sources":
            return x * 2, torch.cat([xc[:, :, :2], (xc * 0.5)[:, :, -4:]], 2)
        if self.form == "halved":
            return x * 2, torch.cat([xc[:, :, :2], xc * 0.5], 2)
        return x * 2, torch.cat([xc[:, :, :2], xc[:, :, -4:]], 2)


RETAIN = _region_adapter(PromptRetained("p", "r"), p=2, r=4)


def _run(gm, ctx, named):
    """The rewritten graph run as the runtime runs it: the region input copied into its carry."""
    carry = ctx.regions[0].carry
    carry.view(named["cache"].shape[carry.dim]).copy_(named["cache"])
    flat = [carry.tensor if s.kind == "carry" else named[s.name] for s in ctx.inputs]
    with torch.no_grad():
        return list(gm(*flat))


@pytest.mark.parametrize("cache", [4, 6], ids=["adjacent-parts", "frames-dropped"])
def test_retention_writes_both_parts_through_the_carrys_leading_views(cache):
    """``C[:2] = X[:2]; C[2:6] = X[L-4:L]`` for an ``X`` that is no join of the old state, each
    destination a slice of ``C[:6]`` from 0 (as the report's graph shows them); the region input
    reads ``C[:, :, 0:cache]``. With 4 frames held the two parts are adjacent (``X[:2]``,
    ``X[2:6]``): still retention."""
    named = _named(cache)
    gm, ctx = _bound(KeepsPromptAndHistory("fresh"), RETAIN, **named)
    gm = _carry_retention(gm, ctx)
    assert ctx.records["rewrites"] == [
        {"kind": "retention", "region": "k", "detail": "new state (6 frames) written into C[:6]"}]
    carry = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "carry_k")
    assert carry.next.args == (carry, 2, 0, cache)   # the region input, read from the carry
    dst = _output(gm).args[0][1]
    assert dst.args == (carry, 2, 0, 6)
    copies = [n for n in gm.graph.nodes if n.target is COPY]
    assert [c.args[0].args for c in copies] == [(dst, 2, 0, 2), (dst, 2, 2, 6)]
    with torch.no_grad():
        stock = KeepsPromptAndHistory("fresh")(named["x"], named["cache"].clone())
    got = _run(gm, ctx, named)
    assert all(torch.equal(a, b) for a, b in zip(got, stock))


@pytest.mark.parametrize("cache,moved", [(4, []), (6, [((2, 4), (4, 6))])],
                         ids=["adjacent-parts", "frames-dropped"])
def test_a_join_cut_to_prompt_and_history_is_written_in_place(cache, moved):
    """``X = cat([C[:l], x])`` read only by its cut: the kept old frames move down to
    ``C[2:6-2]`` (nothing moves when they are there already) and ``x`` goes to ``C[4:6]``; the
    prompt ``C[:2]`` is never written and no concatenation is left."""
    named = _named(cache)
    gm, ctx = _bound(KeepsPromptAndHistory(), RETAIN, **named)
    gm = _carry_retention(gm, ctx)
    (write,) = ctx.records["rewrites"]
    assert write["kind"] == "retention" and "C[0:2] stays where it is" in write["detail"]
    assert not ctx.records["near_misses"] and not [n for n in gm.graph.nodes if n.target is CAT]
    copies = [(c.args[0].args[2:], c.args[1].args[2:] if c.args[1].target is SLICE else "x")
              for c in gm.graph.nodes if c.target is COPY]
    assert copies == moved + [((4, 6), "x")]
    with torch.no_grad():
        stock = KeepsPromptAndHistory()(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(_run(gm, ctx, named), stock))


@pytest.mark.parametrize("form,cache,why", [
    ("wrong-part", 6, "it is not a window of the old state"),
    ("two-sources", 6, "cat_1 does not join the old state C[:l] with new frames"),
    ("halved", 2, "cat_1 does not join the old state C[:l] with new frames"),
])
def test_a_materialized_state_says_why_it_is_copied(form, cache, why):
    """A look-alike of retention is copied into the carry once, the record saying why: no window
    of the old state at all, or the window's own reason (not followed by a stacking reason, as
    the state is no join along another dim). ``halved`` has one slice of ``X`` and one product
    of it: not retention, so it is asked whether it is a window, and says why not."""
    named = _named(cache)
    gm, ctx = _bound(KeepsPromptAndHistory(form), RETAIN, **named)
    gm = _carry_retention(gm, ctx)
    assert ctx.records["rewrites"] == [
        {"kind": "materialize", "region": "k",
         "detail": f"new state (6 frames) written into C[:6]: copied once, because {why}"}]
    with torch.no_grad():
        stock = KeepsPromptAndHistory(form)(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(_run(gm, ctx, named), stock))


def test_a_retention_source_without_a_fake_value_is_materialized():
    """``X`` of ``cat([X[:2], X[-4:]])`` lost its recorded value: its length is unknown, so the
    retention moves are not attempted and the state is copied whole, exact."""
    named = _named(6)
    gm, ctx = _bound(KeepsPromptAndHistory(), RETAIN, **named)
    source = _output(gm).args[0][1].args[0][0].args[0]
    del source.meta["val"]
    gm = _carry_retention(gm, ctx)
    assert [(r["kind"], r["region"]) for r in ctx.records["rewrites"]] == [("materialize", "k")]
    with torch.no_grad():
        stock = KeepsPromptAndHistory()(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(_run(gm, ctx, named), stock))


class KeepsPromptAndHistoryOnDim0(nn.Module):
    """Prompt + history along dim 0, ``cat`` called without ``dim`` (traced without it too)."""

    def forward(self, x, cache):
        xc = torch.cat([cache, x])
        return x * 2, torch.cat([xc[:2], xc[-4:]])


def test_retention_along_dim_0_with_the_default_cat_dim():
    """A ``cat`` traced without its ``dim`` argument joins along dim 0: on a dim-0 region it is
    still retention (two parts of one source), written in place, exact."""
    adapter = Adapter(name="dim-0", clocks={"c": 2, "p": 2, "r": 4},
                      regions=(Region(name="k", input="cache", output="1", dim=0,
                                      retention=PromptRetained("p", "r"), advance="c",
                                      ordering=APPEND, shape=(None, 3)),),
                      call_frames=("c",), call_input="x", call_dim=0)
    g = torch.Generator().manual_seed(1)
    named = {"x": torch.randn(2, 3, generator=g), "cache": torch.randn(6, 3, generator=g)}
    gm, ctx = _bound(KeepsPromptAndHistoryOnDim0(), adapter, **named)
    assert [len(n.args) for n in gm.graph.nodes if n.target is CAT] == [1, 1]
    gm = _carry_retention(gm, ctx)
    assert [(r["kind"], r["region"]) for r in ctx.records["rewrites"]] == [("retention", "k")]
    assert not [n for n in gm.graph.nodes if n.target is CAT]
    with torch.no_grad():
        stock = KeepsPromptAndHistoryOnDim0()(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(_run(gm, ctx, named), stock))


class DropsItsOldestFrame(nn.Module):
    """The new state is the old state without its oldest frame: ``C[1:4]``, a view of the carry
    it is copied into, overlapping ``C[:3]``."""

    def forward(self, x, cache):
        return x + 1, cache[:, :, 1:]


def test_a_state_reading_the_carry_at_an_offset_is_copied_through_a_temporary():
    """Whether the state reads the carry is decided by its view chain, not by its recorded
    value: here that value no longer shares the carry's storage (as after a rewrite that
    recorded a fresh one), and the copy still goes through one temporary, exact."""
    from cadence_fx.passes._carry_graph import fake_mode

    named = _named(4)
    gm, ctx = _bound(DropsItsOldestFrame(), _region_adapter(SlidingWindow("W"), W=4), **named)
    state = _output(gm).args[0][1]
    state.meta["val"] = fake_mode(gm).from_tensor(torch.zeros(1, 2, 3))
    gm = _carry_retention(gm, ctx)
    assert [(r["kind"], r["region"]) for r in ctx.records["rewrites"]] == [("materialize", "k")]
    assert sum(n.target is CLONE for n in gm.graph.nodes) == 1
    assert all(torch.equal(a, b) for a, b in zip(_run(gm, ctx, named),
                                                  DropsItsOldestFrame()(**named)))


class ReturnsItsOldState(nn.Module):
    """Besides the new state (result 0) the step returns the old state, a view of the carry."""

    def forward(self, x, cache):
        return torch.cat([cache, x], 2)[:, :, -4:], cache


def test_an_old_state_handed_out_as_a_copy_keeps_its_fake_value():
    """The clone handed out in place of the old state carries the old state's fake value, as every
    node the pass inserts before later passes read shapes from them."""
    gm, ctx = _bound(ReturnsItsOldState(), _region_adapter(SlidingWindow("W"), output="0", W=4),
                     **_named(4))
    gm = _carry_retention(gm, ctx)
    copy = _output(gm).args[0][1]
    assert copy.target is CLONE
    v = copy.meta["val"]
    assert isinstance(v, torch.Tensor) and (tuple(v.shape), v.dtype) == ((1, 2, 4), torch.float32)
    assert v is copy.args[0].meta["val"]


def test_a_window_without_room_is_a_near_miss_of_its_region_with_the_reason():
    """The region declares 1 frame of room where a call adds 2, and the step reads the whole
    concatenation: the full window cannot be rewritten in place. The near miss names the
    region and the reason, and the copy's record repeats it."""
    adapter = dataclasses.replace(_adapter(4, 2), clocks={"W": 4, "c": 2, "one": 1}, regions=(
        dataclasses.replace(_adapter(4, 2).regions[0], room="one"),))
    model = HandsOutAViewOfTheWindow()
    compiled = cadence_fx.compile(model, adapter)
    g = torch.Generator().manual_seed(8)
    ours = ref = torch.zeros(1, 2, 0)
    for _ in range(4):
        x = torch.randn(1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours, _), (y_ref, ref, _) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((4,), 2)]
    why = ("cat holds 6 frames before the window drops any, but the carry holds 5; give the "
           "region `room` for a call's frames (1 more)")
    assert steady.records["near_misses"] == [{"kind": "near_miss", "region": "k", "detail": why}]
    assert steady.records["rewrites"] == [
        {"kind": "materialize", "region": "k",
         "detail": f"new state (4 frames) written into C[:4]: copied once, because {why}"}]


def test_the_shadow_audit_is_an_eager_piece_with_its_reason():
    """With ``verify`` each carry write is followed by a host comparison: a piece of its own,
    eager, the reason in the report."""
    model = OnlyWindow("slice", 4, 2)
    compiled = cadence_fx.compile(model, _adapter(4, 2), verify=True)
    _lockstep(compiled, model, calls=3, seed=9)
    for entry in compiled.classes.values():
        assert [(p["kind"], p["reasons"]) for p in entry.records["pieces"]] == [
            ("graph", []), ("eager", ["shadow audit compares on the host"])]
    assert compiled.auditor.comparisons["k"] == 3


# -- stacked windows (passes/_carry_stacked.py) through the carry pass -------------------------------

class TwoLayerWindows(nn.Module):
    """Two layers' windows of the last 4 frames, each kept by concatenation on its slice of the
    old state (``cache[i]``), stacked into the new state ``(2, 1, 2, frames)``. ``window``: only
    the windows are read; ``full``: the whole concatenations are read; ``window-reversed``: only
    the windows, layer 1's concatenation computed first (so layer 0's window, read by nothing
    but the step, moves down at its concatenation; layer 1's cannot, layer 0 reads the old
    state after it); ``uneven``: as ``window``, but layer 1 keeps its first 4 frames."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def forward(self, x, cache):
        if self.read == "window-reversed":
            fulls = [torch.cat([cache[i], x[i]], 2) for i in (1, 0)][::-1]
        else:
            fulls = [torch.cat([cache[i], x[i]], 2) for i in range(2)]
        wins = [f[:, :, -4:] for f in fulls]
        if self.read == "uneven":
            wins[1] = fulls[1][:, :, :4]
        if self.read != "full":
            y = wins[0].softmax(2).sum(2, keepdim=True) + wins[1].softmax(2).sum(2, keepdim=True)
        else:
            y = (fulls[0] * 2).sum(2, keepdim=True) + (fulls[1] * 2).sum(2, keepdim=True)
        return y, torch.stack(wins)


def _stacked_stream(read, room=None):
    """Four calls (extents 0, 2, 4, 4) compiled and stock side by side, every result equal; the
    records of each class by its extent."""
    adapter = Adapter(name="two-layers", clocks={"W": 4, "c": 2, "one": 1},
                      regions=(Region(name="kv", input="cache", output="1", dim=3,
                                      retention=SlidingWindow("W"), advance="c", ordering=APPEND,
                                      shape=(2, 1, 2, None), room=room),),
                      call_frames=("c",), call_input="x", call_dim=3)
    model = TwoLayerWindows(read)
    compiled = cadence_fx.compile(model, adapter)
    g = torch.Generator().manual_seed(10)
    ours = ref = torch.zeros(2, 1, 2, 0)
    for _ in range(4):
        x = torch.randn(2, 1, 2, 2, generator=g)
        with torch.no_grad():
            (y, ours), (y_ref, ref) = compiled(x, ours), model(x, ref)
        assert torch.equal(y, y_ref) and torch.equal(ours, ref)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (4, 0)
    return {key[0][0][0]: e.records for key, e in compiled.classes.items()}


@pytest.mark.parametrize("read", ["window", "full", "window-reversed"])
def test_stacked_windows_are_recorded_by_their_parts_and_window(read):
    """Each class names the parts' concatenations, the frames held and added, and the window
    as the stock code takes it; bit-exact whether every window moves once after the writes
    (``window``, ``full``) or one of them already moved down at its concatenation
    (``window-reversed``: the other then moves on its own, from where it is)."""
    records = _stacked_stream(read)
    cats = "cat_1, cat" if read == "window-reversed" else "cat, cat_1"
    detail = ("2 windows (append, {} + 2 frames: " + cats + ") stacked along other dims became "
              "in-place writes on their carry slices; the window [{}, {}) is C[:{}]")
    assert {held: r["rewrites"] for held, r in records.items()} == {
        0: [{"kind": "append", "region": "kv", "detail": detail.format(0, 0, 2, 2)}],
        2: [{"kind": "append", "region": "kv", "detail": detail.format(2, 0, 4, 4)}],
        4: [{"kind": "retention", "region": "kv", "detail": detail.format(4, 2, 6, 4)}]}
    assert all(r["near_misses"] == [] for r in records.values())


def test_a_stacked_part_without_room_is_a_near_miss_and_the_state_is_copied_with_the_reason():
    """With 1 frame of room the full window's first part cannot be written in place: a near
    miss naming the part and the reason; the state is copied once, the record repeating it."""
    records = _stacked_stream("full", room="one")
    why = ("part [0]: cat holds 6 frames before the window drops any, but the carry holds 5; "
           "give the region `room` for a call's frames (1 more)")
    assert records[4]["near_misses"] == [{"kind": "near_miss", "region": "kv", "detail": why}]
    assert records[4]["rewrites"] == [
        {"kind": "materialize", "region": "kv",
         "detail": f"new state (4 frames) written into C[:4]: copied once, because {why}"}]


def test_a_view_of_the_rewritten_window_is_handed_out_as_a_copy_by_the_pass():
    """Once the concatenation is a view of the carry, so is the window's oldest frame (result
    2): the pass itself hands it out as a clone, so the rewritten graph returns no result but
    the new state that shares the carry's memory."""
    named = _named(4)
    gm, ctx = _bound(HandsOutAViewOfTheWindow(), _adapter(4, 2), **named)
    gm = _carry_retention(gm, ctx)
    assert _output(gm).args[0][2].target is CLONE
    got = _run(gm, ctx, named)
    carry = ctx.regions[0].carry.tensor.untyped_storage().data_ptr()
    assert [t.untyped_storage().data_ptr() == carry for t in got] == [False, True, False]
    with torch.no_grad():
        stock = HandsOutAViewOfTheWindow()(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(got, stock))


def test_stacked_parts_keeping_different_windows_are_copied_with_both_reasons():
    """Once the window is full, layer 1 keeps frames [0, 4) where layer 0 keeps [2, 6): the state
    is no window of one concatenation, nor one window of the carry. The copy's record gives both
    reasons, the first why it is no window, then why it is no join of windows."""
    records = _stacked_stream("uneven")
    assert [r["kind"] for r in records[2]["rewrites"]] == ["append"]
    assert records[4]["rewrites"] == [
        {"kind": "materialize", "region": "kv",
         "detail": "new state (4 frames) written into C[:4]: copied once, because the new state "
                   "is not a window of a concatenation along the frame dim; part [1] keeps frames "
                   "[0, 4) of 4 + 2, part [0] [2, 6) of 4 + 2: not one window of the carry"}]
    assert records[4]["near_misses"] == []
