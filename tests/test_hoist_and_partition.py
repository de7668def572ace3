"""Constant hoisting, shape-enumeration partitioning, guarded lowering, and the runtime's admission
guards (strict mode, catalog extents, declared shapes).

Passes are driven directly on traced steps (op counts, ``graph.lint()``, ``modified``, records) and
through ``cadence_fx.compile`` (``torch.equal`` against stock eager at every call).
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import math

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.catalog import build_catalog
from cadence_fx.passes.context import PassContext
from cadence_fx.contract import APPEND, Adapter, Effects, Region, SlidingWindow
from cadence_fx.counters import Counters
from cadence_fx.errors import ContractError, GuardError
from cadence_fx.passes.fx_utils import aten
from cadence_fx.models.toy import CONV_ADAPTER, ConvLeftContextToy
from cadence_fx.passes.pipeline import Options
from cadence_fx.replay import EagerBackend, GuardedPiece, guard_pieces
from cadence_fx.tracing import trace_step
from helpers import side_by_side

hoist_pass = importlib.import_module("cadence_fx.passes.hoist_constants")
partition_pass = importlib.import_module("cadence_fx.passes.shape_enumeration")
lower_pass = importlib.import_module("cadence_fx.passes.lower_guarded")

# A window of the last 4 frames of (1, 3, frames) states, 2 frames a call (extents 0, 2, 4).
WINDOW = Adapter(name="window", clocks={"w": 4, "c": 2, "d": 3, "b": 1},
                 regions=(Region(name="win", input="cache", output="1", dim=2,
                                 retention=SlidingWindow("w"), advance="c", ordering=APPEND,
                                 shape=("b", "d", None)),),
                 call_frames=("c",), call_input="x", call_dim=2, admission="c")


def _window(x, cache, w=4):
    return torch.cat([cache, x], dim=2)[:, :, -w:]


def _table(n=3):
    """A DiT-style frequency table: input-independent, rebuilt by the stock step on every call."""
    return torch.exp(torch.arange(n, dtype=torch.float32) * (-math.log(1e4) / n))


# -- steps -------------------------------------------------------------------------------------------

class Hoistable(nn.Module):
    def forward(self, x, cache):
        freqs = _table().to(x)
        return x * freqs.view(1, 3, 1), _window(x, cache)


class RandomDraw(nn.Module):
    def forward(self, x, cache):
        return x + torch.randn(3).view(1, 3, 1), _window(x, cache)


class FromParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x, cache):
        return x * torch.exp(self.scale * 2).view(1, 3, 1), _window(x, cache)


class FromBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("base", torch.arange(3.0), persistent=False)

    def forward(self, x, cache):
        return x * torch.exp(self.base * 0.5).view(1, 3, 1), _window(x, cache)


class FromInput(nn.Module):
    def forward(self, x, cache):
        return x * torch.exp(x.mean(dim=2, keepdim=True)), _window(x, cache)


class Mutated(nn.Module):
    """An accumulator built from a constant and then written in place: not a constant."""

    def forward(self, x, cache):
        acc = torch.zeros(1, 3)
        acc.add_(x.sum(dim=2))
        return acc * 2, _window(x, cache)


class MutatedThroughView(nn.Module):
    """The same accumulator, written through an ``unsqueeze`` view of the constant."""

    def forward(self, x, cache):
        acc = torch.zeros(3).unsqueeze(0)
        acc.add_(x.sum(dim=2))
        return acc * 2, _window(x, cache)


class ReturnsTable(nn.Module):
    """The table is also a result of the step: the caller owns it and may write it."""

    def forward(self, x, cache):
        table = _table(2)  # broadcast over the frames
        return x * table, _window(x, cache), table


class ReturnsTableView(nn.Module):
    """A view of the table is a result of the step."""

    def forward(self, x, cache):
        table = _table(2)
        return x * table, _window(x, cache), table[:1]


class HostSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, cache):
        h = self.lin(x.transpose(1, 2)).transpose(1, 2)
        peak = h.abs().max().item()  # a host sync in the middle of the step
        return h / peak, _window(x, cache)


class DataDependent(nn.Module):
    def forward(self, x, cache):
        h = x * 2
        where = torch.nonzero(h > 0)
        return h + 1, _window(x, cache), where


class BoolMask(nn.Module):
    """``x[mask] = v`` keeps its shape but turns the mask into indices on the host (Moshi's
    ``LMGen._step`` does this to blank tokens that are not generated yet)."""

    def forward(self, x, cache):
        h = x * 2
        h[h < 0] = 0.0
        return h + 1, _window(x, cache)


class Plain(nn.Module):
    def forward(self, x, cache):
        return x * 2 + 1, _window(x, cache)


# -- helpers ----------------------------------------------------------------------------------------

def _op_counts(gm) -> collections.Counter:
    return collections.Counter(n.target if n.op == "call_function" else n.op
                               for n in gm.graph.nodes if n.op in ("call_function", "get_attr",
                                                                   "call_module"))


def _arange(counts) -> int:
    return sum(v for t, v in counts.items() if "arange" in str(t))


def _named(frames=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(1, 3, 2, generator=g), "cache": torch.randn(1, 3, frames, generator=g)}


def _traced(module, named):
    traced = trace_step(module, module.forward, named)
    ctx = PassContext(adapter=WINDOW, class_key="test", inputs=list(traced.inputs), regions=[],
                      module_buffers=dict(module.named_buffers()), counters=Counters(),
                      backend=EagerBackend())
    return traced, ctx


def _flat(module, ctx, named):
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return [state[s.name] if s.kind in ("param", "buffer") else named[s.name] for s in ctx.inputs]


def _run_pass(fn, gm, ctx):
    before = _op_counts(gm)
    result = fn(gm, ctx)
    result.graph_module.graph.lint()
    result.graph_module.recompile()
    return result, before, _op_counts(result.graph_module)


def _stock(module, named, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = module(**named)
    return list(out)


def _equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), f"result {i} differs from stock"


def _stream(make, calls=5, *, seed=0, rng_seed=None, adapter=WINDOW, **compile_kw):
    """Compiled vs stock over ``calls`` calls of width 2 from an empty window; results compared."""
    g = torch.Generator().manual_seed(seed)
    c, stock = cadence_fx.compile(make(), adapter, **compile_kw), make()
    got_cache = ref_cache = torch.zeros(1, 3, 0)
    for i in range(calls):
        x = torch.randn(1, 3, 2, generator=g)
        if rng_seed is not None:
            torch.manual_seed(rng_seed + i)
        with torch.no_grad():
            got = c(x, got_cache)
        if rng_seed is not None:
            torch.manual_seed(rng_seed + i)
        with torch.no_grad():
            want = stock(x, ref_cache)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"call {i + 1}: result {k} differs from stock"
        got_cache, ref_cache = got[1], want[1]
    # every call is in the catalog (extents 0, 2, 4; width 2): each one ran a compiled class
    k = c.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (calls, calls, 0, {})
    assert len(c.classes) == k.traces == min(calls, 3)
    return c


# -- hoist_constants --------------------------------------------------------------------------------

def test_hoists_an_input_independent_table():
    named = _named()
    traced, ctx = _traced(Hoistable(), named)
    result, before, after = _run_pass(hoist_pass.hoist_constants, traced.gm, ctx)
    assert result.modified
    assert (_arange(before), before[aten.exp.default]) == (1, 1)
    assert (_arange(after), after[aten.exp.default]) == (0, 0)
    assert after["get_attr"] == 1
    (const,) = ctx.records.constants
    assert const.shape == (1, 3, 1) and const.host_to_device is False
    held = getattr(result.graph_module, const.name)
    assert torch.equal(held, _table().view(1, 3, 1))
    for _ in range(2):  # the held value is read, never written
        _equal(list(result.graph_module(*_flat(Hoistable(), ctx, named))), _stock(Hoistable(), named))
    assert torch.equal(held, _table().view(1, 3, 1))


def test_hoisted_stream_bit_exact():
    c = _stream(Hoistable, verify=True)
    assert all(len(e.records.constants) == 1 for e in c.classes.values())
    assert c.counters.fallbacks == 0


def test_constants_switch_turns_hoisting_off():
    c = _stream(Hoistable, constants=False)
    assert all(not e.records.constants for e in c.classes.values())
    assert all(p.name != "hoist_constants" for e in c.classes.values() for p in e.records.passes)


@pytest.mark.parametrize("module", [RandomDraw, FromParam, FromBuffer, FromInput, Mutated],
                         ids=["random", "param", "buffer", "input", "mutated"])
def test_does_not_hoist(module):
    named = _named()
    traced, ctx = _traced(module(), named)
    result, before, after = _run_pass(hoist_pass.hoist_constants, traced.gm, ctx)
    assert not result.modified and not ctx.records.constants
    assert after == before and after["get_attr"] == 0
    m = module()
    for i in range(2):
        torch.manual_seed(i)
        got = list(result.graph_module(*_flat(m, ctx, named)))
        _equal(got, _stock(m, named, seed=i))


@pytest.mark.parametrize("module", [RandomDraw, Mutated],
                         ids=["random", "mutated"])
def test_not_hoisted_streams_bit_exact(module):
    # RandomDraw draws from torch's generator on the step's device (the CPU): it says so
    drawing = dataclasses.replace(WINDOW, effects=Effects(device_rng=True))
    c = _stream(module, rng_seed=100, adapter=drawing if module is RandomDraw else WINDOW)
    assert all(not e.records.constants for e in c.classes.values())


def test_returned_table_itself_is_not_hoisted():
    """Upstream pieces of a returned table may be hoisted; the returned storage never is."""
    named = _named()
    traced, ctx = _traced(ReturnsTable(), named)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    returned = {n.name for n in out.all_input_nodes}
    result, _, _ = _run_pass(hoist_pass.hoist_constants, traced.gm, ctx)
    assert all(c.source not in returned for c in ctx.records.constants)
    m = ReturnsTable()
    for _ in range(2):
        _equal(list(result.graph_module(*_flat(m, ctx, named))), _stock(m, named))


def _caller_writes_the_returned_table(module, seed):
    """Three calls of one class; after each, the caller zeroes the returned table (or view)."""
    g = torch.Generator().manual_seed(seed)
    c, stock = cadence_fx.compile(module(), WINDOW), module()
    xs = [torch.randn(1, 3, 2, generator=g) for _ in range(3)]
    for got, want in side_by_side(c, stock, xs, torch.zeros(1, 3, 4)):
        _equal(list(got), list(want))
        got[2].zero_()
        want[2].zero_()
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (3, 0)


def test_returned_table_may_be_written_by_the_caller():
    _caller_writes_the_returned_table(ReturnsTable, seed=1)


def test_does_not_hoist_a_tensor_mutated_through_a_view():
    named = _named()
    traced, ctx = _traced(MutatedThroughView(), named)
    result, _, _ = _run_pass(hoist_pass.hoist_constants, traced.gm, ctx)
    m = MutatedThroughView()
    for _ in range(2):
        _equal(list(result.graph_module(*_flat(m, ctx, named))), _stock(m, named))


def test_returned_view_of_a_table_is_not_shared_across_calls():
    _caller_writes_the_returned_table(ReturnsTableView, seed=2)


# -- shape_enumeration ------------------------------------------------------------------------------

def _aten_counts(gm) -> collections.Counter:
    """aten ops of a graph, or of all its pieces once partitioned."""
    counts = collections.Counter(n.target for n in gm.graph.nodes
                                 if isinstance(n.target, torch._ops.OpOverload))
    for n in gm.graph.nodes:
        if n.op == "call_module":
            counts += _aten_counts(getattr(gm, n.target))
    return counts


def _partition(module, named):
    traced, ctx = _traced(module, named)
    unsplit = traced.gm
    want = list(unsplit(*_flat(module, ctx, named)))
    before = _aten_counts(unsplit)
    result, _, _ = _run_pass(partition_pass.shape_enumeration, unsplit, ctx)
    assert _aten_counts(result.graph_module) == before  # every op lands in exactly one piece
    return result, ctx, want


EAGER_WORK = [
    (HostSync, "host sync (.item())"),
    (DataDependent, "data-dependent output (aten::nonzero)"),
    (BoolMask, "boolean-mask indexing (aten::index_put_) syncs with the host through nonzero"),
]


@pytest.mark.parametrize("module,reason", EAGER_WORK, ids=["item", "nonzero", "bool-mask"])
def test_partition_splits_around_eager_work(module, reason):
    named = _named(frames=4)
    m = module()
    result, ctx, unsplit_out = _partition(m, named)
    assert result.modified
    pieces = ctx.records.pieces
    assert [p.kind for p in pieces] == ["graph", "eager", "graph"]
    assert [p.reasons for p in pieces] == [(), (reason,), ()]
    assert pieces[1].nodes == 1 and pieces[1].depends_on == (0,)
    top = result.graph_module
    assert [n.target for n in top.graph.nodes if n.op == "call_module"] == \
        ["piece_0", "piece_1", "piece_2"]  # run in graph order
    got = list(top(*_flat(m, ctx, named)))
    _equal(got, unsplit_out)
    _equal(got, _stock(m, named))


def test_partition_of_a_capturable_step_is_one_piece():
    named = _named(frames=4)
    result, ctx, unsplit_out = _partition(Plain(), named)
    assert [(p.kind, list(p.reasons)) for p in ctx.records.pieces] == [("graph", [])]
    _equal(list(result.graph_module(*_flat(Plain(), ctx, named))), unsplit_out)


@pytest.mark.parametrize("module,reason", EAGER_WORK, ids=["item", "nonzero", "bool-mask"])
def test_partitioned_stream_bit_exact(module, reason):
    # the masked write of one value would be a select (passes/mask_writes.py): kept here as the
    # boolean-mask case of the partition, with that pass off
    c = _stream(lambda: _seeded(module), calls=5, options=Options(mask_writes=False))
    for e in c.classes.values():
        assert [(p.kind, list(p.reasons)) for p in e.records.pieces] == \
            [("graph", []), ("eager", [reason]), ("graph", [])]
    k = c.counters
    assert (k.compiled_calls, k.eager_pieces, k.guarded_eager, k.replays) == (5, 5, 10, 0)


def _seeded(module):
    torch.manual_seed(0)  # HostSync's Linear: the compiled and the stock copy get the same weights
    return module()


# -- lower_guarded ----------------------------------------------------------------------------------

def test_lowering_wraps_every_piece_and_counts_on_cpu():
    named = _named(frames=4)
    m = HostSync()
    result, ctx, unsplit_out = _partition(m, named)
    lowered, before, after = _run_pass(lower_pass.lower_guarded, result.graph_module, ctx)
    assert lowered.modified and after == before  # same graph; the pieces changed behind it
    guard_pieces(lowered.graph_module, ctx)   # the runtime's pieces of the pass's specs
    pieces = [getattr(lowered.graph_module, f"piece_{i}") for i in range(3)]
    assert all(isinstance(p, GuardedPiece) for p in pieces)
    assert [p.kind for p in pieces] == ["graph", "eager", "graph"]
    assert ctx.records.pieces[0].aliased_inputs == 2  # the Linear's weight and bias
    k = ctx.counters
    for call in range(1, 4):
        _equal(list(lowered.graph_module(*_flat(m, ctx, named))), unsplit_out)
        assert (k.guarded_eager, k.eager_pieces, k.replays, k.fallbacks) == (2 * call, call, 0, 0)


def _add(a, b):
    return (a + b,)


class _ReplayBackend:
    """A stand-in device-graph backend (CPU): its replay runs the piece's module."""
    name = "test"

    def __init__(self):
        self.captures = 0

    def lower(self, piece, args):
        self.captures += 1
        return (lambda a: piece.module(*a)), None


def test_guarded_piece_replays_and_falls_back_on_guard_failures():
    gm = torch.fx.symbolic_trace(_add)
    k, backend = Counters(), _ReplayBackend()
    piece = GuardedPiece(gm, "piece_0", "graph", [], ["carry hist", None], [False, False], [True],
                         backend, k)
    a, b = torch.ones(3), torch.arange(3.0)
    for _ in range(2):
        assert torch.equal(piece(a, b)[0], a + b)
    assert (k.replays, k.guarded_eager, k.fallbacks, backend.captures) == (2, 0, 0, 1)
    assert torch.equal(piece(a, b * 2)[0], a + 2 * b)  # a free input may move
    assert (k.replays, k.fallbacks) == (3, 0)
    moved = a.clone()
    assert torch.equal(piece(moved, b)[0], a + b)  # the fixed one may not: eager, then re-capture
    assert (k.fallbacks, k.invalidations) == (1, 1)
    assert k.reasons == {"piece_0: fixed-address input(s) ['carry hist'] moved (invalidated)": 1}
    assert torch.equal(piece(moved, b)[0], a + b)
    assert (k.replays, backend.captures) == (4, 2)
    assert torch.equal(piece(torch.ones(4), torch.ones(4))[0], torch.full((4,), 2.0))
    assert k.reasons["piece_0: signature differs from the captured one"] == 1
    assert k.replays == 4


def test_eager_backend_pieces_run_guarded_eager():
    k = Counters()
    piece = GuardedPiece(torch.fx.symbolic_trace(_add), "piece_0", "graph", [], [None, None],
                         [False, False], [True], EagerBackend(), k)
    for call in range(1, 4):
        assert torch.equal(piece(torch.ones(2), torch.ones(2))[0], torch.full((2,), 2.0))
        assert (k.guarded_eager, k.replays, k.fallbacks) == (call, 0, 0)


# -- admission: strict mode, catalog extents, declared shapes ------------------------------------------

def _conv_call(c, stock, att_frames=3, conv_channels=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = (torch.randn(1, 32, 4, generator=g), torch.randn(1, conv_channels, 2, generator=g),
            torch.randn(1, 64, att_frames, generator=g))
    with torch.no_grad():
        got = c(*args)
        want = stock(*(a.clone() for a in args))
    return list(got), list(want)


def test_strict_raises_on_an_extent_outside_the_catalog():
    c = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER, strict=True)
    with pytest.raises(GuardError, match=r"strict mode: region 'att' extent 3 is not in the catalog "
                                         r"\[0, 4\]"):
        _conv_call(c, ConvLeftContextToy())
    assert c.counters.traces == 0


def test_strict_admits_catalog_calls():
    c = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER, strict=True)
    got, want = _conv_call(c, ConvLeftContextToy(), att_frames=4)
    _equal(got, want)
    assert c.counters.compiled_calls == 1 and c.counters.fallbacks == 0


def test_extent_outside_the_catalog_falls_back_with_reason():
    c = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER)
    for seed in range(2):
        got, want = _conv_call(c, ConvLeftContextToy(), seed=seed)
        _equal(got, want)
    k = c.counters
    assert (k.fallbacks, k.compiled_calls, k.traces) == (2, 0, 0)
    (reason,) = k.reasons
    assert reason == ("region 'att' extent 3 is not in the catalog [0, 4] derived from its "
                      "retention clocks; lower the region's `advance` (f_chunk = 4) to 1 (the gcd "
                      "of the call widths [4] and of 3, the frames past 0), so that every extent "
                      "the stream reaches is in the catalog")
    assert k.reasons[reason] == 2


# Two windows advancing together, 2 frames a call: "long" keeps 4 frames (extents 0, 2, 4), "short"
# keeps 2 (extents 0, 2). Each extent is in its region's catalog, but together they only reach
# (0, 0), (2, 2) and (4, 2).
TWO_WINDOWS = Adapter(
    name="two-windows", clocks={"long": 4, "short": 2, "c": 2, "d": 3, "b": 1},
    regions=tuple(Region(name=n, input=n, output=str(i + 1), dim=2, retention=SlidingWindow(n),
                         advance="c", ordering=APPEND, shape=("b", "d", None))
                  for i, n in enumerate(("long", "short"))),
    call_frames=("c",), call_input="x", call_dim=2, admission="c")


class TwoWindows(nn.Module):
    def forward(self, x, long, short):
        y = x * 2 + long.sum(2, keepdim=True) - short.sum(2, keepdim=True)
        return y, _window(x, long, 4), _window(x, short, 2)


def test_extents_that_never_occur_together_fall_back_with_reason():
    """The caller restarts one region only: (4, 0) is in no class of the joint catalog, so the
    call runs stock with the reason (no new class is traced); the next call is back in it."""
    assert [e for e, _ in build_catalog(TWO_WINDOWS).classes] == [(0, 0), (2, 2), (4, 2)]
    g = torch.Generator().manual_seed(3)
    c, stock = cadence_fx.compile(TwoWindows(), TWO_WINDOWS), TwoWindows()
    got = want = (None, torch.zeros(1, 3, 0), torch.zeros(1, 3, 0))
    for i in range(5):
        x = torch.randn(1, 3, 2, generator=g)
        if i == 3:   # long holds 4 frames; short starts again from nothing
            got, want = (None, got[1], torch.zeros(1, 3, 0)), (None, want[1], torch.zeros(1, 3, 0))
        with torch.no_grad():
            got, want = c(x, got[1], got[2]), stock(x, want[1], want[2])
        _equal(list(got), list(want))
    k = c.counters
    assert dict(k.reasons) == {
        "region extents (4, 0) never occur together in the catalog; pass the states of one stream "
        "(every region's from the same call), or fix the regions' `advance` clocks so that they "
        "move together as the stream does": 1}
    assert (k.compiled_calls, k.fallbacks, k.traces) == (4, 1, 3)


def test_strict_raises_on_a_width_the_adapter_does_not_admit():
    c = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER, strict=True)
    with pytest.raises(GuardError, match=r"call width 5 is neither a declared call width \[4\] "
                                         r"nor admitted \(admission f_chunk = 4\); declare a "
                                         r"clock of 5 in `call_frames`"):
        with torch.no_grad():
            c(torch.randn(1, 32, 5), torch.zeros(1, 32, 2), torch.zeros(1, 64, 4))


def test_state_contradicting_the_declared_shape_is_a_contract_error():
    c = cadence_fx.compile(ConvLeftContextToy(), CONV_ADAPTER)
    with pytest.raises(ContractError, match=r"region 'conv' of adapter 'toy-conv-left-context' "
                                            r"declares shape \(1, 32, 'frames'\) but the step "
                                            r"received \(1, 16, 2\) at 'conv_cache'"):
        _conv_call(c, ConvLeftContextToy(), att_frames=4, conv_channels=16)
    assert c.counters.compiled_calls == 0 and c.counters.fallbacks == 0


def test_state_with_nonzero_rows_beyond_the_declaration_is_a_contract_error():
    wide = WINDOW  # declares 3 channels; a 4th channel is tolerated only while it holds zeros
    c = cadence_fx.compile(Plain(), wide)
    with torch.no_grad():
        with pytest.raises(ContractError, match=r"region 'win'.*declares shape \(1, 3, 'frames'\) "
                                                r"but the step received \(1, 4, 2\)"):
            c(torch.randn(1, 4, 2), torch.ones(1, 4, 2))


class StateAttribute(nn.Module):
    """Module state in a plain tensor attribute (as Moshi's streaming state): advanced in place
    every call, so nothing computed from it is a constant."""

    def __init__(self):
        super().__init__()
        self.step_count = torch.zeros(1)

    def forward(self, x, cache):
        self.step_count.add_(1)
        literal = torch.tensor([[0.5], [1.0], [2.0]])  # a literal: hoistable
        return x * (self.step_count * 2) * literal, _window(x, cache)


def test_state_attributes_are_not_constants_but_literals_are():
    named = _named()
    traced, ctx = _traced(StateAttribute(), named)
    result, _, _ = _run_pass(hoist_pass.hoist_constants, traced.gm, ctx)
    assert len(ctx.records.constants) == 1  # the literal table, not the counter
    g = torch.Generator().manual_seed(5)
    c, stock = cadence_fx.compile(StateAttribute(), WINDOW), StateAttribute()
    xs = [torch.randn(1, 3, 2, generator=g) for _ in range(4)]
    for got, want in side_by_side(c, stock, xs, torch.zeros(1, 3, 4)):
        _equal(list(got), list(want))
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (4, 0)
