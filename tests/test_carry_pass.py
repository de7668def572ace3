"""The carry pass (passes/carry_retention.py) on small hand-written steps, and the shadow auditor.

Unit tests drive the pass directly (``trace_step`` + ``PassContext`` + ``carry_retention``) and check
op counts before and after, ``graph.lint()``, ``PassResult.modified``, the rewrite record and
``torch.equal`` against stock eager; stream tests run the same steps through ``cadence_fx.compile``.
Near-misses are patterns close to a rewrite that must not be rewritten into wrong code.
"""
from __future__ import annotations

import collections
import importlib
import re

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.audit import Auditor
from cadence_fx.catalog import build_catalog
from cadence_fx.context import Carry, PassContext, RegionBinding
from cadence_fx.contract import APPEND, Adapter, PromptRetained, Region, Ring, SlidingWindow
from cadence_fx.counters import Counters
from cadence_fx.errors import CadenceError, ShadowMismatch
from cadence_fx.fx_utils import aten
from cadence_fx.tracing import leaves_with_paths, trace_step

carry_pass = importlib.import_module("cadence_fx.passes.carry_retention")  # the module, not the function
carry_window = importlib.import_module("cadence_fx.passes._carry_window")

CAT, COPY, INDEX_COPY = aten.cat.default, aten.copy_.default, aten.index_copy_.default


# -- hand-written steps -----------------------------------------------------------------------------
# State tensors are (batch=1, channels=3, frames); the frame dim is 2.

def _adapter(retention, *, output="1", envelope=None, stock_shape=None, **clocks):
    clocks = {"c": 2, "d": 3, "b": 1, **clocks}
    return Adapter(name="hand", clocks=clocks,
                   regions=(Region(name="hist", input="cache", output=output, dim=2,
                                   retention=retention, advance="c", ordering=APPEND,
                                   shape=("b", "d", None), envelope=envelope,
                                   stock_shape=stock_shape),),
                   call_frames=("c",), call_input="x", call_dim=2, admission="c")


class Retain(nn.Module):
    """Prompt + retained history of a fresh concatenation: ``cat([X[:P], X[L-R:]])`` (eq. 3)."""
    P, R = 2, 4

    def retain(self, xc):
        return torch.cat([xc[:, :, :self.P], xc[:, :, -self.R:]], dim=2)

    def forward(self, x, cache):
        xc = torch.cat([cache, x], dim=2)
        if xc.shape[2] > self.P + self.R:
            xc = self.retain(xc)
        return x * 2, xc


RETAIN = _adapter(PromptRetained("p", "r"), p=2, r=4)


class TwoSources(Retain):
    """Near-miss: the slices come from two different tensors."""

    def retain(self, xc):
        return torch.cat([xc[:, :, :self.P], (xc * 0.5)[:, :, -self.R:]], dim=2)


class WrongPart(Retain):
    """Near-miss: keeps the R frames right after the prompt instead of the last R."""

    def retain(self, xc):
        return torch.cat([xc[:, :, :self.P], xc[:, :, self.P:self.P + self.R]], dim=2)


class Strided(Retain):
    """Near-miss: keeps every other one of the last 2R frames (a strided slice)."""

    def retain(self, xc):
        return torch.cat([xc[:, :, :self.P], xc[:, :, -2 * self.R::2]], dim=2)


class OtherDim(Retain):
    """Near-miss: frame-dim slices of one tensor, concatenated along the channel dim."""
    P = R = 3

    def retain(self, xc):
        return torch.cat([xc[:, :, :self.P], xc[:, :, -self.R:]], dim=1)


OTHER_DIM = _adapter(PromptRetained("p", "r"), p=3, r=3)


class ChannelCat(Retain):
    """Near-miss: slices and concatenation both along the channel dim (an identity)."""

    def retain(self, xc):
        tail = xc[:, :, -self.R:]
        return torch.cat([tail[:, :1], tail[:, 1:]], dim=1)


class EnvelopeRetain(nn.Module):
    """Token2Wav-style: the state is written into an over-sized buffer by slice assignment and
    returned as a view of it; retention then concatenates two slices of that view."""
    P, R = 2, 6

    def __init__(self):
        super().__init__()
        self.register_buffer("env", torch.zeros(1, 3, 32), persistent=False)

    def retain(self, state):
        return torch.cat([state[:, :, :self.P], state[:, :, -self.R:]], dim=2)

    def forward(self, x, cache):
        held, t = cache.shape[2], x.shape[2]
        self.env[:, :, :held + t] = torch.cat([cache, x], dim=2)
        state = self.env[:, :, :held + t]
        if state.shape[2] > self.P + self.R:
            state = self.retain(state)
        return x * 2, state


class EnvelopeWrongPart(EnvelopeRetain):
    def retain(self, state):
        return torch.cat([state[:, :, :self.P], state[:, :, self.P:self.P + self.R]], dim=2)


ENVELOPE = _adapter(PromptRetained("p", "r"), envelope="env", stock_shape=("b", "d", "frames"),
                    p=2, r=6, frames=32)
# The same region without its envelope: the carry is sized to the retention bound (8 frames), but the
# step writes P + R + c = 10 frames into the buffer before retention.
ENVELOPE_UNDECLARED = _adapter(PromptRetained("p", "r"), p=2, r=6)


class Window(nn.Module):
    """Sliding window with append ordering: ``cat([C[:l], x])`` while growing, a tail slice after."""
    W = 6

    def forward(self, x, cache):
        xc = torch.cat([cache, x], dim=2)
        if xc.shape[2] > self.W:
            xc = xc[:, :, -self.W:]
        return x + 1, xc


WINDOW = _adapter(SlidingWindow("w"), w=6)


class MiniRing(nn.Module):
    """Moshi-style: a ring written in place at ``(offset + t) % capacity`` (through ``cache[0]``,
    as RingToy writes ``kv[0]``)."""

    def forward(self, x, cache, offset):
        idx = (torch.arange(x.shape[2]) + offset) % cache.shape[2]
        cache[0].index_copy_(1, idx, x[0])
        return cache.mean(2), cache, offset + x.shape[2]


class MiniRingReturnsWrite(MiniRing):
    """The same ring, returning the value of the in-place write (which *is* the region input)."""

    def forward(self, x, cache, offset):
        idx = (torch.arange(x.shape[2]) + offset) % cache.shape[2]
        cache = cache.index_copy_(2, idx, x)
        return cache.mean(2), cache, offset + x.shape[2]


RING = _adapter(Ring("cap"), cap=4, c=1)


class AliasedOutput(nn.Module):
    """Near-miss: besides the new state the step returns its old state (a view of the region input).
    Writing the new state into the carry would change that other result."""
    W = 4

    def __init__(self, view=lambda t: t):
        super().__init__()
        self.view = view

    def forward(self, x, cache):
        xc = torch.cat([cache, x], dim=2)
        return xc[:, :, -self.W:], self.view(cache)


ALIASED = _adapter(SlidingWindow("w"), output="0", w=4)


class LateWrite(nn.Module):
    """Near-miss: the new state is formed, then the old state (the region input, i.e. the carry)
    is written in place. Writing the new state into the carry before that write would let it
    change the new state too."""
    W = 4

    def forward(self, x, cache):
        new = torch.cat([cache, x], dim=2)[:, :, -self.W:]
        cache.mul_(0.5)
        return x * 2, new


LATE = _adapter(SlidingWindow("w"), w=4)


class EnvelopeSpare(nn.Module):
    """An envelope with a spare slot: the state lives in slot 0 of ``env`` (2, d, 16), slot 1 is
    never written but is read (summed with slot 0) on every call. The region declares one slot,
    so the carry may stand in for the envelope only while slot 1 holds zeros. Once the window is
    full the state is ``env[0:1, :, l+c-W:l+c]``: a view of the carry at an offset."""
    W = 4

    def __init__(self, spare: float = 0.0, channels: int = 3):
        super().__init__()
        env = torch.zeros(2, channels, 16)
        env[1] = spare
        self.register_buffer("env", env, persistent=False)

    def forward(self, x, cache):
        held, t = cache.shape[2], x.shape[2]
        self.env[0:1, :, :held + t] = torch.cat([cache, x], dim=2)
        y = self.env[:, :, :held + t].sum(0)
        state = self.env[0:1, :, :held + t]
        if held + t > self.W:
            state = state[:, :, -self.W:]
        return y, state


SPARE = _adapter(SlidingWindow("w"), w=4, envelope="env", stock_shape=("slots", "d", "frames"),
                 slots=2, frames=16)
SPARE_1 = SPARE.with_clocks(d=1)   # one channel: carry views along the frames are dense


# -- driving the pass directly ----------------------------------------------------------------------

def _op_counts(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _carry_pass(module, adapter, **named):
    """Trace ``module`` at ``named`` and run the carry pass alone, as the runtime binds it."""
    traced = trace_step(module, module.forward, named)
    gm, inputs = traced.gm, list(traced.inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_pos = {p: k for k, p in enumerate(traced.out_paths[i] for i in traced.out_tensor_index)}
    catalog = build_catalog(adapter)
    regions = []
    for r in adapter.regions:
        ph = next(n for n, s in zip(placeholders, inputs) if s.kind == "arg" and s.name == r.input)
        shape = [adapter.dim_size(d, r) for d in r.shape]
        shape[r.dim] = catalog.region(r.name).declared_extent
        regions.append(RegionBinding(r, ph, out_pos.get(r.output), Carry(r, torch.zeros(shape))))
    ctx = PassContext(adapter=adapter, class_key="test", inputs=inputs, regions=regions,
                      module_buffers=dict(module.named_buffers()), counters=Counters(),
                      auditor=Auditor())
    before = _op_counts(gm)
    result = carry_pass.carry_retention(gm, ctx)
    result.graph_module.graph.lint()
    result.graph_module.recompile()
    return result, ctx, before, _op_counts(result.graph_module)


def _run_rewritten(gm, ctx, module, named):
    """Run a rewritten graph the way the runtime does: region inputs copied into their carries,
    buffers private to the call."""
    by_path = dict(leaves_with_paths(named)[0])
    carries = {b.region.name: b.carry for b in ctx.regions}
    for b in ctx.regions:
        src = by_path[b.region.input]
        b.carry.view(src.shape[b.region.dim]).copy_(src)
    params = dict(module.named_parameters())
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    flat = [params[s.name] if s.kind == "param" else buffers[s.name] if s.kind == "buffer"
            else carries[s.name].tensor if s.kind == "carry" else by_path[s.name]
            for s in ctx.inputs]
    with torch.no_grad():
        return list(gm(*flat))


def _stock(make, named):
    with torch.no_grad():
        out = make()(**{k: v.clone() for k, v in named.items()})
    return [v for _, v in leaves_with_paths(out)[0] if isinstance(v, torch.Tensor)]


def _assert_equal_outputs(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), f"output {i} differs from stock"


def _kinds(ctx):
    return [r["kind"] for r in ctx.records["rewrites"]]


def _state(frames, seed=0):
    return torch.randn(1, 3, frames, generator=torch.Generator().manual_seed(seed))


def _stream(make, adapter, cache, widths, *, state_index=1, seed=0, **compile_kw):
    """Compiled vs stock over a stream of ``forward(x, cache)`` calls; every result compared.
    Every stream here stays in its catalog, so every call must have run a compiled class."""
    g = torch.Generator().manual_seed(seed)
    c = cadence_fx.compile(make(), adapter, **compile_kw)
    stock = make()
    got_cache, ref_cache = cache, cache.clone()
    for i, w in enumerate(widths):
        x = torch.randn(*cache.shape[:2], w, generator=g)
        with torch.no_grad():
            got, want = c(x, got_cache), stock(x, ref_cache)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"call {i + 1}: result {k} differs from stock"
        got_cache, ref_cache = got[state_index], want[state_index]
    k = c.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (len(widths),) * 2 + (0, {})
    return c


# -- rewrites ---------------------------------------------------------------------------------------

def test_retention_rewrite_writes_the_carry():
    named = {"x": _state(2, 1), "cache": _state(6, 2)}  # the class where retention fires (6 + 2 > 6)
    result, ctx, before, after = _carry_pass(Retain(), RETAIN, **named)
    assert result.modified
    assert _kinds(ctx) == ["retention"] and not ctx.records["near_misses"]
    assert (before[COPY], after[COPY]) == (0, 2)  # C[:P] = X[:P]; C[P:P+R] = X[L-R:L]
    assert [s.kind for s in ctx.inputs] == ["arg", "carry"]  # the region input now reads the carry
    got = _run_rewritten(result.graph_module, ctx, Retain(), named)
    _assert_equal_outputs(got, _stock(Retain, named))
    assert got[1].data_ptr() == ctx.regions[0].carry.tensor.data_ptr()


@pytest.mark.parametrize("module,frames", [(Retain, 6), (Window, 2)], ids=["retention", "append"])
def test_rewrite_removes_the_stock_concatenation(module, frames):
    named = {"x": _state(2, 1), "cache": _state(frames, 2)}
    result, ctx, before, after = _carry_pass(module(), RETAIN if module is Retain else WINDOW, **named)
    assert _kinds(ctx) in (["retention"], ["append"])
    assert after[CAT] < before[CAT]


def test_overlapping_envelope_retention_moves_in_place():
    """X is the carry itself (the envelope was replaced by it): dst [P, P+R) and src [L-R, L)
    overlap. Split into disjoint pieces it would take 3 copies, so it goes through one temporary:
    a clone and a copy."""
    named = {"x": _state(2, 1), "cache": _state(8, 2)}  # L = 10, P = 2, R = 6: shift 2, 3 pieces
    result, ctx, before, after = _carry_pass(EnvelopeRetain(), ENVELOPE, **named)
    assert result.modified
    assert _kinds(ctx) == ["envelope", "retention"] and not ctx.records["near_misses"]
    assert (before[COPY], after[COPY]) == (1, 1 + 1)
    assert len([n for n in result.graph_module.graph.nodes if n.target is aten.clone.default]) == 1
    assert "buffer" not in [s.kind for s in ctx.inputs]  # the envelope placeholder is gone
    got = _run_rewritten(result.graph_module, ctx, EnvelopeRetain(), named)
    _assert_equal_outputs(got, _stock(EnvelopeRetain, named))


def test_a_long_overlapping_move_goes_through_one_temporary():
    named = {"x": _state(1, 1), "cache": _state(8, 2)}  # L = 9: shift 1, six one-frame pieces
    result, ctx, before, after = _carry_pass(EnvelopeRetain(), ENVELOPE, **named)
    assert _kinds(ctx) == ["envelope", "retention"]
    assert after[COPY] - before[COPY] == 1
    assert len([n for n in result.graph_module.graph.nodes if n.target is aten.clone.default]) == 1
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, EnvelopeRetain(), named),
                          _stock(EnvelopeRetain, named))


def test_envelope_stream_bit_exact():
    c = _stream(EnvelopeRetain, ENVELOPE, _state(2), [2] * 7 + [1], verify=True)
    k = c.counters
    # extents 2, 4, 6, then 8 for five calls, each of which fires retention
    assert (k.fallbacks, k.carry_addresses, k.retentions) == (0, 1, 5)
    assert c.auditor.comparisons["hist"] == 5


def test_append_writes_only_the_new_frames():
    named = {"x": _state(2, 1), "cache": _state(2, 2)}
    result, ctx, before, after = _carry_pass(Window(), WINDOW, **named)
    assert result.modified and _kinds(ctx) == ["append"]
    assert (before[COPY], after[COPY]) == (0, 1)
    (write,) = [n for n in result.graph_module.graph.nodes if n.target is COPY]
    dst = write.args[0]  # C[:4][:, :, 2:4]: only the appended frames are written
    assert dst.target is aten.slice.Tensor and dst.args[1:] == (2, 2, 4)
    carry = ctx.regions[0].carry
    got = _run_rewritten(result.graph_module, ctx, Window(), named)
    _assert_equal_outputs(got, _stock(Window, named))
    assert torch.equal(carry.view(2), named["cache"])  # the held frames were not rewritten


def test_tail_slice_is_a_window_in_place():
    """Full window: ``cat([C[:6], x])[:, :, -6:]``, and nothing but the window reads the
    concatenation. The concatenation goes; the 4 kept frames move down by 2 first (two disjoint
    pieces), then the call's 2 frames are written after them: the window is C[:6]."""
    named = {"x": _state(2, 1), "cache": _state(6, 2)}
    result, ctx, before, after = _carry_pass(Window(), WINDOW, **named)
    assert result.modified and _kinds(ctx) == ["retention"]
    assert (before[COPY], after[COPY]) == (0, 2 + 1)
    nodes = result.graph_module.graph.nodes
    assert not [n for n in nodes if n.target is aten.cat.default]
    assert not [n for n in nodes if n.target is aten.clone.default]
    assert ctx.regions[0].carry.extent == 6 + 2   # the window plus one call of room
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, Window(), named),
                          _stock(Window, named))


def test_window_stream_bit_exact():
    c = _stream(Window, WINDOW, torch.zeros(1, 3, 0), [2] * 6 + [1], verify=True)
    assert (c.counters.fallbacks, c.counters.carry_addresses) == (0, 1)
    assert c.counters.applications == 7 and c.auditor.comparisons["hist"] == 7


def test_ring_is_already_in_place():
    named = {"x": _state(1, 1), "cache": _state(4, 2), "offset": torch.tensor([3])}
    result, ctx, before, after = _carry_pass(MiniRing(), RING, **named)
    assert result.modified  # the region input now reads the carry
    assert _kinds(ctx) == ["in_place"] and not ctx.records["near_misses"]
    assert (before[COPY], after[COPY]) == (0, 0)
    assert before[INDEX_COPY] == after[INDEX_COPY] == 1
    got = _run_rewritten(result.graph_module, ctx, MiniRing(), named)
    _assert_equal_outputs(got, _stock(MiniRing, named))
    assert got[1].data_ptr() == ctx.regions[0].carry.tensor.data_ptr()


def test_ring_returning_the_in_place_write_is_in_place():
    named = {"x": _state(1, 1), "cache": _state(4, 2), "offset": torch.tensor([3])}
    result, ctx, before, after = _carry_pass(MiniRingReturnsWrite(), RING, **named)
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, MiniRingReturnsWrite(), named),
                          _stock(MiniRingReturnsWrite, named))
    assert _kinds(ctx) == ["in_place"] and after[COPY] == 0


def test_no_regions_leaves_the_graph_alone():
    named = {"x": _state(2, 1), "cache": _state(6, 2)}
    traced = trace_step(Retain(), Retain().forward, named)
    before = _op_counts(traced.gm)
    ctx = PassContext(adapter=RETAIN, class_key="test", inputs=list(traced.inputs), regions=[],
                      module_buffers={})
    result = carry_pass.carry_retention(traced.gm, ctx)
    result.graph_module.graph.lint()
    assert not result.modified and _op_counts(result.graph_module) == before
    assert not ctx.records["rewrites"]


# -- near-misses ------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", [TwoSources, WrongPart, ChannelCat],
                         ids=["two-sources", "wrong-part", "channel-cat"])
def test_retention_look_alikes_are_not_retention(module):
    """They take the generic write (the new state copied whole into the carry), never the
    retention moves, and the results stay bit-exact."""
    named = {"x": _state(2, 1), "cache": _state(6, 2)}
    result, ctx, before, after = _carry_pass(module(), RETAIN, **named)
    assert _kinds(ctx) == ["materialize"]
    assert after[COPY] - before[COPY] == 1
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, module(), named),
                          _stock(module, named))


@pytest.mark.parametrize("module", [TwoSources, WrongPart, ChannelCat],
                         ids=["two-sources", "wrong-part", "channel-cat"])
def test_retention_look_alike_streams_bit_exact(module):
    c = _stream(module, RETAIN, _state(2), [2] * 6, verify=True)
    assert c.counters.retentions == 0 and c.counters.fallbacks == 0


def test_envelope_keeping_the_wrong_part_is_not_retention():
    named = {"x": _state(2, 1), "cache": _state(8, 2)}
    result, ctx, _, _ = _carry_pass(EnvelopeWrongPart(), ENVELOPE, **named)
    assert _kinds(ctx) == ["envelope", "materialize"]
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, EnvelopeWrongPart(), named),
                          _stock(EnvelopeWrongPart, named))
    c = _stream(EnvelopeWrongPart, ENVELOPE, _state(2), [2] * 6, verify=True)
    assert c.counters.retentions == 0


def test_strided_retention_slice_is_declined():
    named = {"x": _state(2, 1), "cache": _state(6, 2)}
    result, ctx, _, _ = _carry_pass(Strided(), RETAIN, **named)
    assert "retention" not in _kinds(ctx)
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, Strided(), named),
                          _stock(Strided, named))


def test_strided_retention_stream_bit_exact():
    _stream(Strided, RETAIN, _state(2), [2] * 4)


def test_concatenation_along_another_dim_is_a_near_miss():
    named = {"x": _state(2, 1), "cache": _state(6, 2)}  # new state (1, 6, 3): not the carry's shape
    result, ctx, before, after = _carry_pass(OtherDim(), OTHER_DIM, **named)
    assert not ctx.records["rewrites"]
    (miss,) = ctx.records["near_misses"]
    assert miss["region"] == "hist" and "does not match the declared carry" in miss["detail"]
    assert after[COPY] == before[COPY] == 0 and after[CAT] == before[CAT]
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, OtherDim(), named),
                          _stock(OtherDim, named))


def test_envelope_beyond_declared_extent_is_a_near_miss():
    named = {"x": _state(2, 1), "cache": _state(8, 2)}
    result, ctx, _, _ = _carry_pass(EnvelopeRetain(), ENVELOPE_UNDECLARED, **named)
    (miss,) = ctx.records["near_misses"]
    assert miss["region"] == "hist"
    assert re.search(r"envelope env: the step (reads|writes) \[\d+, 10\) of dim 2, beyond the "
                     r"declared 8", miss["detail"])
    assert "envelope" not in _kinds(ctx) and "buffer" in [s.kind for s in ctx.inputs]
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, EnvelopeRetain(), named),
                          _stock(EnvelopeRetain, named))


def test_envelope_beyond_declared_extent_stream():
    module = EnvelopeRetain()
    c = cadence_fx.compile(module, ENVELOPE_UNDECLARED, verify=True)
    g = torch.Generator().manual_seed(3)
    stock, got_cache = EnvelopeRetain(), _state(2)
    ref_cache = got_cache.clone()
    for _ in range(6):  # extents 2, 4, 6, then 8 three times (the near-miss class)
        x = torch.randn(1, 3, 2, generator=g)
        with torch.no_grad():
            (y, got_cache), (y_ref, ref_cache) = c(x, got_cache), stock(x, ref_cache)
        assert torch.equal(y, y_ref) and torch.equal(got_cache, ref_cache)
    misses = {e.key[1]: e.records["near_misses"] for e in c.classes.values()}
    assert len(misses) == 4
    assert sum(bool(m) for m in misses.values()) == 1
    assert c.counters.fallbacks == 0 and c.counters.carry_addresses == 1
    assert not module.env.any()  # the user's module buffer is never written by the compiled path


def test_result_aliasing_the_state_is_handed_out_as_a_copy():
    """A result sharing the carry's storage (here the old state) would change at the next
    carry write: the pass hands out a clone and still writes the new state into the carry."""
    named = {"x": _state(2, 1), "cache": _state(4, 2)}
    result, ctx, before, after = _carry_pass(AliasedOutput(), ALIASED, **named)
    assert not ctx.records["near_misses"]
    assert after[COPY] > before[COPY]
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, AliasedOutput(), named),
                          _stock(AliasedOutput, named))
    _stream(AliasedOutput, ALIASED, torch.zeros(1, 3, 0), [2] * 5, state_index=0)


def test_result_aliasing_the_old_state_survives_the_next_call():
    g = torch.Generator().manual_seed(0)
    c, stock = cadence_fx.compile(AliasedOutput(), ALIASED), AliasedOutput()
    got_cache = ref_cache = torch.zeros(1, 3, 0)
    held = []
    for _ in range(4):
        x = torch.randn(1, 3, 2, generator=g)
        with torch.no_grad():
            got, want = c(x, got_cache), stock(x, ref_cache)
        held.append((got[1], want[1].clone()))
        got_cache, ref_cache = got[0], want[0]
    assert all(torch.equal(a, b) for a, b in held)
    assert (c.counters.compiled_calls, c.counters.fallbacks, c.counters.carry_addresses) == (4, 0, 1)


def _transposed(t):
    return t.transpose(1, 2)


def test_state_aliased_through_a_transpose_is_a_near_miss():
    named = {"x": _state(2, 1), "cache": _state(4, 2)}
    result, ctx, _, _ = _carry_pass(AliasedOutput(_transposed), ALIASED, **named)
    got = _run_rewritten(result.graph_module, ctx, AliasedOutput(_transposed), named)
    _assert_equal_outputs(got, _stock(lambda: AliasedOutput(_transposed), named))


def test_a_carry_write_after_the_new_state_is_a_near_miss():
    named = {"x": _state(2, 1), "cache": _state(4, 2)}
    result, ctx, before, after = _carry_pass(LateWrite(), LATE, **named)
    assert not ctx.records["rewrites"]
    (miss,) = ctx.records["near_misses"]
    assert miss["detail"] == "mul_ writes the carry after the new state is formed"
    assert after[CAT] == before[CAT] and after[COPY] == before[COPY] == 0
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, LateWrite(), named),
                          _stock(LateWrite, named))


def test_a_carry_write_after_the_new_state_stream():
    """Each class is compiled with the near miss recorded, and the stream stays bit-exact: the
    new state is handed out as computed, not written into the carry, and the next call copies
    it in (one absorption a call)."""
    c = _stream(LateWrite, LATE, torch.zeros(1, 3, 0), [2] * 5)
    misses = [[m["detail"] for m in e.records["near_misses"]] for e in c.classes.values()]
    assert misses == [["mul_ writes the carry after the new state is formed"]] * 3
    assert (c.counters.applications, c.counters.absorptions) == (0, 5)


def test_an_envelope_read_beyond_the_declaration_needs_zeros():
    """Slot 1 holds ones: the carry (one slot) cannot stand in for the envelope, since the step
    reads slot 1. With zeros it can, and the state, a view of the carry at an offset, is copied
    into ``C[:4]`` through a temporary."""
    named = {"x": _state(2, 1), "cache": _state(4, 2)}
    result, ctx, _, _ = _carry_pass(EnvelopeSpare(1.0), SPARE, **named)
    (miss,) = ctx.records["near_misses"]
    assert miss["detail"] == ("envelope env: the step reads rows [1, 2) of dim 0 that are not "
                              "declared and not known to be zero")
    assert _kinds(ctx) == ["materialize"] and "buffer" in [s.kind for s in ctx.inputs]
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, EnvelopeSpare(1.0), named),
                          _stock(lambda: EnvelopeSpare(1.0), named))

    result, ctx, before, after = _carry_pass(EnvelopeSpare(0.0), SPARE, **named)
    assert _kinds(ctx) == ["envelope", "materialize"] and not ctx.records["near_misses"]
    assert "buffer" not in [s.kind for s in ctx.inputs]
    # The temporary is needed: C[2:6] overlaps C[:4]. ``copy_`` refuses such a source when both
    # views are dense (the one-channel stream below) and, when it cannot tell, gives a result
    # that depends on the order the kernel copies in (threads, a GPU).
    assert after[aten.clone.default] == before[aten.clone.default] + 1
    _assert_equal_outputs(_run_rewritten(result.graph_module, ctx, EnvelopeSpare(0.0), named),
                          _stock(lambda: EnvelopeSpare(0.0), named))


@pytest.mark.parametrize("spare", [0.0, 1.0], ids=["zeros", "ones"])
def test_envelope_with_a_spare_slot_stream(spare):
    c = _stream(lambda: EnvelopeSpare(spare, channels=1), SPARE_1, torch.zeros(1, 1, 0),
                [2] * 5 + [1])
    kinds = {e.key[0]: [r["kind"] for r in e.records["rewrites"]] for e in c.classes.values()}
    if spare:
        assert kinds == {((0,), 2): ["materialize"], ((2,), 2): ["materialize"],
                         ((4,), 2): ["materialize"], ((4,), 1): ["materialize"]}
    else:   # the carry stands in for the envelope; a full window is copied down through a temporary
        assert kinds == {((0,), 2): ["envelope", "in_place"], ((2,), 2): ["envelope", "in_place"],
                         ((4,), 2): ["envelope", "materialize"],
                         ((4,), 1): ["envelope", "materialize"]}
    assert c.counters.carry_addresses == 1


# -- the shadow auditor -----------------------------------------------------------------------------

def test_auditor_passes_equal_writes_and_counts_them():
    a = Auditor()
    a.check("att", "retention", torch.arange(6.0), torch.arange(6.0))
    a.check("att", "append", torch.zeros(0), torch.zeros(0))
    assert a.comparisons == {"att": 2}


def test_auditor_names_region_call_and_difference():
    a = Auditor()
    a.call_index = 7
    stock, carry = torch.arange(6.0), torch.arange(6.0)
    carry[4] += 1.5
    with pytest.raises(ShadowMismatch, match=r"retention write of region 'att'.*at call 7 "
                                              r"\(max \|diff\| 1\.5\)"):
        a.check("att", "retention", stock, carry)
    with pytest.raises(ShadowMismatch, match=r"region 'conv'.*shapes \(6,\) vs \(5,\)"):
        a.check("conv", "materialize", stock, carry[:5])
    assert issubclass(ShadowMismatch, AssertionError) and issubclass(ShadowMismatch, CadenceError)


def test_auditor_catches_overlapping_moves_copied_high_to_low(monkeypatch):
    """The classic overlapping-move bug, planted in the pass: the retention pieces are copied high
    to low, so each piece reads frames an earlier piece already overwrote. verify=True must stop the
    stream at the first retention call (call 4: extents 2, 4, 6, then 8 + 2 > 8), naming the region;
    without verify the same bug silently corrupts the state."""
    original = carry_pass._try_retention

    def high_to_low(gm, b, state, dst):
        before = set(gm.graph.nodes)
        kind = original(gm, b, state, dst)
        copies = [n for n in gm.graph.nodes if n not in before and n.target is COPY]
        last = copies[-1]
        for n in reversed(copies[:-1]):  # reorder to c_k, ..., c_1; their arguments come earlier
            last.append(n)
            last = n
        return kind

    monkeypatch.setattr(carry_pass, "_try_retention", high_to_low)
    monkeypatch.setattr(carry_window, "PIECES_BEFORE_TEMPORARY", 8)   # the pieces, not a temporary
    with pytest.raises(ShadowMismatch, match=r"retention write of region 'hist'.*at call 4\b"):
        _stream(EnvelopeRetain, ENVELOPE, _state(2), [2] * 6, verify=True)
    with pytest.raises(AssertionError, match=r"call 4: result 1 differs from stock"):
        _stream(EnvelopeRetain, ENVELOPE, _state(2), [2] * 6)


def test_editing_the_handed_back_state_is_not_a_mismatch():
    """The carry *is* the state: an in-place edit of the state a call handed back is what the next
    call reads, in the compiled step as in stock, and the audit compares each write with the stock
    value computed from that same state. Corrupting the carry between calls is therefore not a
    shadow mismatch; the results simply follow the edit."""
    g = torch.Generator().manual_seed(4)
    c = cadence_fx.compile(EnvelopeRetain(), ENVELOPE, verify=True)
    stock = EnvelopeRetain()
    got_cache, ref_cache = _state(2), _state(2)
    for i in range(6):
        x = torch.randn(1, 3, 2, generator=g)
        with torch.no_grad():
            (y, got_cache), (y_ref, ref_cache) = c(x, got_cache), stock(x, ref_cache)
        assert torch.equal(y, y_ref) and torch.equal(got_cache, ref_cache)
        got_cache.mul_(-1)  # got_cache is the carry's leading view
        ref_cache = ref_cache * -1
    assert c.counters.carry_addresses == 1 and c.counters.absorptions == 1
    assert c.auditor.comparisons["hist"] == 3
