"""Writes around the fused regions (passes/region_writes.py). A region that ends on a write: a copy
of one of its values into a tensor outside it -- a state update such as
``offset.copy_(offset + 1)`` or ``s.copy_(where(reset, s0, 0.5 * s + x))`` -- becomes the region
writing that tensor in place, one kernel less. In-place arithmetic on a temporary
(``t = zeros(1); t.add_(1)``) made functional, so regions take it in. Every test asserts what ran
(the region fused, the write it took over, the in-place ops rewritten, what stayed stock) and
compares bits with the stock graph; the near misses must be left alone."""
from __future__ import annotations

import torch

from cadence_fx import fusion
from cadence_fx.fusion import FusedRegion
from cadence_fx.passes.fx_utils import WRITES, aten, written_bases

from helpers import depformer_offsets
from test_fuse_exact import _fused_graph


def _ema(x, s, off):
    """Two state updates of the kind Moshi's frames make: a running value and an offset."""
    new = torch.where(x > 0, s * 0.5 + x, s)
    s.copy_(new)
    off.copy_(off + 1)
    return new * 2.0,


def _copies(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.copy_.default]


def _stream(gm, f, x, s, off, calls=3):
    """``calls`` calls of ``gm`` and of ``f`` from the same state: equal outputs and states, bit for bit."""
    mine, theirs = (s.clone(), off.clone()), (s.clone(), off.clone())
    for _ in range(calls):
        a, b = gm(x, *mine), f(x, *theirs)
        if not (torch.equal(a[0], b[0]) and all(torch.equal(fusion._bits(p), fusion._bits(q))
                                                for p, q in zip(mine, theirs))):
            return False
    return True


def test_a_copy_of_a_region_value_into_a_state_tensor_is_written_by_the_region(fuse_on_cpu):
    x, s, off = torch.randn(16), torch.randn(16), torch.zeros(1, dtype=torch.long)
    gm, found = _fused_graph(_ema, x, s, off)
    # no copy is left in the graph: each region writes its state tensor where the copy was
    assert _copies(gm) == []
    assert [(r.ops[-1], r.writes) for r in found] == [("aten.copy_.default", (1,)),
                                                      ("aten.copy_.default", (0,))]
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.meta[WRITES] for n in calls] == [(1,), (0,)]
    # the graph still says what it writes (the pieces' and the backends' lists of written inputs)
    assert [n.name for n in written_bases(gm.graph)] == ["s_1", "off_1"]
    # the running value is read and written: the verification must put it back between the two
    # runs, or the fused form would start from the stock run's result and differ
    assert _stream(gm, _ema, x, s, off)
    assert [r.state for r in found] == ["fused", "fused"]


def test_copies_that_broadcast_cast_or_read_what_they_write_stay_stock(fuse_on_cpu):
    def broadcast(x, s):
        s.copy_((x * 2.0 + 1.0)[:1])         # (1,) into (8,)
        return s * 1.5,

    def cast(x, s):
        s.copy_(x * 2.0 + 1.0)               # fp32 into bf16: a rounding, not a copy
        return s.float() * 1.5,

    def shifted(x, s):
        s[:-1].copy_(s[1:] * 2.0 + x[1:])    # reads the storage it writes, one element over
        return s * 1.5,

    x = torch.randn(8)
    for f, s in ((broadcast, torch.randn(8)), (cast, torch.randn(8).bfloat16()),
                 (shifted, torch.randn(8))):
        gm, found = _fused_graph(f, x, s)
        assert len(_copies(gm)) == 1, f.__name__
        assert all(not r.writes for r in found), f.__name__
        a, b = s.clone(), s.clone()
        for _ in range(2):
            assert torch.equal(gm(x, a)[0], f(x, b)[0]) and torch.equal(a, b), f.__name__


def test_a_view_made_only_to_be_written_into_is_given_to_the_region(fuse_on_cpu):
    """``s[:, :4].copy_(v)``: the slice stays outside the region, which writes through it."""
    def f(x, s):
        s[:, :4].copy_(torch.where(x > 0, x * 3.0, x + 1.0))
        return s * 1.0 + 2.0,

    x, s = torch.randn(2, 4), torch.randn(2, 6)
    gm, found = _fused_graph(f, x, s)
    writing = [r for r in found if r.writes]
    assert len(writing) == 1 and _copies(gm) == []
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.meta.get(WRITES))
    dst = call.args[call.meta[WRITES][0]]
    assert dst.target is aten.slice.Tensor and dst.args[0].name == "s_1"
    a, b = s.clone(), s.clone()
    for _ in range(2):
        assert torch.equal(gm(x, a)[0], f(x, b)[0]) and torch.equal(a, b)
    assert writing[0].state == "fused"


def _writing_region(**kw):
    """A region that writes its first input: ``s.copy_(s * 0.5 + x)``."""
    def g(s, x):
        s.copy_(s * 0.5 + x)
        return ()
    gm = torch.fx.experimental.proxy_tensor.make_fx(g)(torch.randn(4), torch.randn(4))
    return FusedRegion(gm, "w", ["mul", "add", "copy_"], writes=(0,), **kw)


def test_a_writing_region_whose_fused_write_differs_is_refused_and_keeps_the_stock_bits(monkeypatch):
    def writes_one_ulp_up(module, args, graph=None):
        def run(*a):
            out = module(*a)
            a[0].view(torch.int32).add_(1)
            return out
        return run
    monkeypatch.setattr(fusion, "compile_region", writes_one_ulp_up)
    region = _writing_region()
    s, x = torch.randn(4), torch.randn(4)
    expected = s * 0.5 + x
    region(s, x)
    assert region.state == "stock"
    assert region.reason == "written input 0 differs from stock in 4 of 4 elements"
    assert torch.equal(fusion._bits(s), fusion._bits(expected))    # the stock run's write stands


def test_a_writing_region_never_runs_fused_on_inputs_that_share_the_written_storage(monkeypatch):
    ran = []

    def recording(module, args, graph=None):
        def run(*a):
            ran.append(len(a))
            return module(*a)
        return run
    monkeypatch.setattr(fusion, "compile_region", recording)
    region = _writing_region()
    s, x = torch.randn(4), torch.randn(4)
    region(s, x)                       # verified on separate tensors: fused
    assert region.state == "fused" and len(ran) == 1
    shared = torch.randn(8)
    expected = shared[:4] * 0.5 + shared[4:]
    region(shared[:4], shared[4:])     # x shares s's storage: this call runs stock
    assert len(ran) == 1 and torch.equal(shared[:4], expected)
    region(s, x)
    assert len(ran) == 2
    # first seen on shared storage, it is refused with the reason
    refused = _writing_region()
    refused(shared[:4], shared[4:])
    assert (refused.state, refused.reason) == (
        "stock", "input 0, which it writes, shares storage with input 1")


def _inplace(gm):
    from cadence_fx.passes.region_writes import FUNCTIONAL
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in FUNCTIONAL]


def test_in_place_arithmetic_on_a_temporary_is_made_functional_and_fused(fuse_on_cpu):
    """The depformer's offsets: a fresh int64 counter stepped in place between its readers."""
    x = torch.arange(6)
    gm, found = _fused_graph(depformer_offsets, x)
    assert _inplace(gm) == []
    # the counter's steps join the regions around them: one region reads the zeros and x
    assert len(found) == 1 and {"aten.add.Tensor", "aten.mul.Tensor"} <= set(found[0].ops)
    for _ in range(2):
        assert all(torch.equal(p, q) for p, q in zip(gm(x), depformer_offsets(x)))
    assert found[0].state == "fused"


def test_in_place_arithmetic_that_others_can_see_stays_in_place(fuse_on_cpu):
    def on_input(x, s):
        s.add_(1.0)                          # the caller's tensor: the write is the point
        return s * 2.0 + x,

    def through_a_view(x, s):
        t = x * 2.0 + 1.0
        t[:2].add_(1.0)                      # a slice of the temporary: a partial write
        return t * s,

    def seen_through_an_old_view(x, s):
        t = x * 2.0 + 1.0
        v = t.view(2, 2)                     # made before the write, read after it: sees it
        t.add_(1.0)
        return v * s.view(2, 2),

    def rounding(x, s):
        t = (x * 2.0).bfloat16()
        t.add_(s)                            # bf16 += fp32 rounds to bf16; add would not
        return t.float() * 3.0,

    x, s = torch.randn(4), torch.randn(4)
    for f in (on_input, through_a_view, seen_through_an_old_view, rounding):
        gm, found = _fused_graph(f, x, s)
        assert len(_inplace(gm)) == 1, f.__name__
        a, b = s.clone(), s.clone()
        for _ in range(2):
            assert torch.equal(gm(x, a)[0], f(x, b)[0]) and torch.equal(a, b), f.__name__



def test_views_of_a_value_made_functional_alias_it_for_the_passes_after(fuse_on_cpu):
    """A view made after the write views the new value: the passes that follow must see that
    it shares the new value's storage, or ``cat_in_place`` moves the view's copy past the
    ``clamp_`` that writes it."""
    def f(x, a, b, buf):
        t = torch.zeros(2, 3)
        t.add_(x)
        p = t.view(2, 3)
        c1 = torch.cat([p, a], 0)
        t.clamp_(min=0)                  # writes p's storage after the first cat
        buf.copy_(torch.cat([c1, b], 0))
        return x + 0.5,

    x, a, b = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    gm, _ = _fused_graph(f, x, a, b, torch.zeros(6, 3))
    assert _inplace(gm) == []            # the add_ was made functional; the clamp_ stays
    mine, theirs = torch.zeros(6, 3), torch.zeros(6, 3)
    for _ in range(2):
        assert torch.equal(gm(x, a, b, mine)[0], f(x, a, b, theirs)[0])
        assert torch.equal(mine, theirs)
