"""Exact fusion (passes/fuse_exact.py, cadence_fx/fusion.py): runs of pointwise ops become fused
regions, each admitted only when its fused form gives the stock bits on the class's real inputs.

On the CPU the pass makes no regions by default (``exact_ops.DEVICES``); the tests that exercise the
whole path here let it fuse on the CPU too (Inductor's C++), where some regions are exact and some
are not -- which is what the verification is for. Every stream is compared with ``torch.equal``
against a stock module over whole turns (re-primed per speaker, flushes), and every test asserts
what ran: regions fused, regions refused, their reasons. The device tests check each op of
``EXACT_OPS`` against ATen over random and edge inputs, per dtype, and the conformer stream replayed
with fused regions inside its graphs."""
from __future__ import annotations

import operator

import pytest
import torch

import cadence_fx
from cadence_fx import fusion
from cadence_fx.fusion import FusedRegion, regions
from cadence_fx.passes import exact_ops
from cadence_fx.passes.exact_ops import EXACT_OPS, fusible
from cadence_fx.passes.fx_utils import aten
from cadence_fx.passes.pipeline import Options

from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_conformer import CONFORMER_ADAPTER, make_model, run_turns
from helpers import same

TURNS = [(0, [8, 12, 8, 4]), (1, [12, 8])]


@pytest.fixture(scope="module")
def stock():
    return run_turns(make_model(), TURNS, seed=5)[0]


def _compiled(**options):
    return cadence_fx.compile(make_model(), CONFORMER_ADAPTER, options=Options(**options))


def _all_regions(compiled):
    return [r for e in compiled.classes.values() for r in regions(e.gm)]


def test_conformer_stream_runs_fused_regions_bit_exact(fuse_on_cpu, stock):
    compiled = _compiled()
    ours = run_turns(compiled, TURNS, seed=5)[0]
    assert same(stock, ours)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (k.calls, 0) and k.calls == len(stock)
    found = _all_regions(compiled)
    assert found and all(r.state in ("fused", "stock") for r in found)   # every one decided
    fused = [r for r in found if r.state == "fused"]
    assert len(fused) == k.fused_regions > 0
    assert k.fusions_refused == len(found) - len(fused)
    assert all(r.reason for r in found if r.state == "stock")
    # the regions hold only ops of the whitelist, at least two kernels each
    assert all(len(r.ops) >= 2 for r in found)
    names = {str(op) for op in EXACT_OPS} | {"aten.copy_.default"}   # and the write one ends on
    assert all(op in names for r in found for op in r.ops)
    assert all("aten.copy_.default" not in r.ops[:-1] for r in found)
    # the records name each region of a class, and the stock graph is gone from the top level
    e = next(iter(compiled.classes.values()))
    assert len(e.records.fusion.regions) == len(regions(e.gm)) > 0


def _written(module) -> int:
    """The position of the input a region's graph writes."""
    from cadence_fx.passes.fx_utils import written_bases
    (base,) = written_bases(module.graph)
    return [n for n in module.graph.nodes if n.op == "placeholder"].index(base)


def _first_result(module) -> torch.Tensor:
    """A region's first output, or what it writes when it has none (traced value)."""
    outs = module.graph.find_nodes(op="output")[0].args[0]
    if outs:
        return outs[0].meta["val"]
    return [n for n in module.graph.nodes if n.op == "placeholder"][_written(module)].meta["val"]


def test_a_region_whose_fused_form_differs_stays_stock_with_the_reason(fuse_on_cpu, stock, monkeypatch):
    def off_by_one_ulp(module, args, graph=None):
        """An inexact compiler: one ULP up on its first output (on what it writes, for a region
        that only writes)."""
        def run(*a):
            out = list(module(*a))
            if out and out[0].is_floating_point():
                out[0] = torch.nextafter(out[0], torch.full_like(out[0], float("inf")))
            elif not out and _first_result(module).is_floating_point():
                w = a[_written(module)]
                w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))
            return out
        return run
    monkeypatch.setattr(fusion, "compile_region", off_by_one_ulp)
    compiled = _compiled()
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    found = _all_regions(compiled)
    floating = [r for r in found if _first_result(r.stock).is_floating_point()]
    assert floating and all(r.state == "stock" and "differs from stock" in r.reason for r in floating)
    assert compiled.counters.fusions_refused >= len(floating)
    assert compiled.counters.fused_regions == len(found) - len(floating)


def test_a_region_whose_compile_fails_stays_stock_with_the_reason(fuse_on_cpu, stock, monkeypatch):
    def broken(module, args, graph=None):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(fusion, "compile_region", broken)
    compiled = _compiled()
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    found = _all_regions(compiled)
    assert found and all(r.state == "stock" and r.reason == "compile failed: RuntimeError: no compiler here"
                         for r in found)
    assert (compiled.counters.fused_regions, compiled.counters.fusions_refused) == (0, len(found))


def test_no_regions_on_a_cpu_step_by_default_nor_when_switched_off(stock, monkeypatch):
    compiled = _compiled()
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    e = next(iter(compiled.classes.values()))
    assert not _all_regions(compiled)
    assert e.records.fusion.skipped == "fusion is for device steps (cuda); this step runs on cpu"
    monkeypatch.setattr(exact_ops, "DEVICES", ("cuda", "cpu"))
    off = _compiled(fuse_exact=False)
    assert same(stock, run_turns(off, TURNS, seed=5)[0])
    assert not _all_regions(off) and off.counters.fused_regions == 0
    assert "fuse_exact" not in [p.name for p in next(iter(off.classes.values())).records.passes]


def _node(fn, *args):
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def _fill_fusible(fn, *xs) -> bool:
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, pre_dispatch=True)(*xs)
    (fill,) = [n for n in gm.graph.nodes if n.target is aten.full_like.default]
    return fusible(fill)


def test_the_whitelist_keeps_out_what_stock_computes_differently():
    x, y = torch.randn(4), torch.randn(4)
    assert fusible(_node(lambda a, b: a + b, x, y))
    assert fusible(_node(lambda a, b: a * b, x, y))
    assert not fusible(_node(lambda a, b: torch.add(a, b, alpha=2), x, y))   # may contract to FMA
    assert not fusible(_node(lambda a, b: torch.sub(a, b, alpha=0.5), x, y))
    assert fusible(_node(lambda a: a / 3.0, x))        # as ATen computes it: a * (1 / 3) in fp32
    assert not fusible(_node(lambda a: a + 0, x)) and not fusible(_node(lambda a: a * 1, x))
    assert not fusible(_node(lambda a: a * 0, x))            # Inductor folds it to zeros
    assert not fusible(_node(lambda a: a * -1, x))           # the device compiler makes it a sign flip
    assert not fusible(_node(lambda a: a / 1.00000001, x))   # its fp32 reciprocal is 1.0
    assert not fusible(_node(lambda a: torch.full_like(a, 0.0), x))   # a fill Inductor folds into its users
    i = torch.arange(4)
    assert not fusible(_node(lambda a: torch.clamp(a, min=0.0), x))   # -0 against +0
    assert fusible(_node(lambda a: torch.clamp(a, 0, 2), i))            # integers: nothing rounded
    assert not fusible(_node(lambda a: torch.clamp(a, min=0.5), i))     # a float bound promotes
    # an integer fill fuses where only integer ops read it (folding is exact there) ...
    assert _fill_fusible(lambda a: torch.where(a > 1, torch.full_like(a, -1), a), i)
    # ... not where a float reads it (x * 0 folded is 0; NaN * 0 is NaN)
    assert not _fill_fusible(lambda a, f: f * torch.full_like(a, 0), i, x)
    assert not _fill_fusible(lambda a: torch.full_like(a, 0.5, dtype=torch.float32) + a, i)
    assert not _fill_fusible(lambda a, f: f * torch.full_like(a, 0).view(2, 2), i, x.view(2, 2))
    # ... nor through integer ops Inductor carries the uniform value through (the float add of
    # zeros is then dropped: -0.0 stays -0.0, where ATen's add makes +0.0)
    assert not _fill_fusible(lambda a, f: f + torch.full_like(a, 0).clamp(0, 5), i, x)
    assert not _fill_fusible(lambda a, f: f * (torch.full_like(a, 1) + a * 0 + 1), i, x)
    assert not fusible(_node(lambda a: a.to(torch.float16), x))     # fp16: not in the op test
    assert not fusible(_node(lambda a: a.float(), torch.arange(4)))   # int -> float: not in the op test
    assert not fusible(_node(lambda a: a.int(), x))                      # NaN, inf: undefined
    assert not fusible(_node(lambda a: torch.nn.functional.gelu(a), x))  # erf: never exact fused
    assert not fusible(_node(lambda a: torch.softmax(a, 0), x))
    assert not fusible(_node(lambda a: a.double() + 1, x))              # dtype not a model's
    assert not fusible(_node(lambda a: a.add_(1), x))                    # in place: order matters
    assert fusible(_node(lambda a: a.float(), x.to(torch.bfloat16)))
    assert fusible(_node(lambda a: a.to(torch.bfloat16), x))
    # division by a device tensor is div_rn on both sides; on the CPU the divisor is on the host
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: a / b)(x, y)
    div = next(n for n in gm.graph.nodes if n.target is aten.div.Tensor)
    assert not fusible(div)


def test_inductor_sees_a_division_by_a_number_as_atens_product_with_its_reciprocal():
    x = torch.randn(8)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a: (a / 3.0 + a,))(x)
    form = fusion.inductor_form(gm)
    ops = [(n.target, n.args[1]) for n in form.graph.nodes if n.op == "call_function"]
    inverse = (torch.tensor(1.0) / torch.tensor(3.0)).item()    # in fp32, as the kernel's opmath
    assert ops[0] == (aten.mul.Tensor, inverse) and inverse != 1 / 3
    assert any(n.target is aten.div.Tensor for n in gm.graph.nodes)   # the region keeps its own


def _fused_graph(f, *args):
    """``f`` traced and run through fusion's passes alone (the rewrites that prepare it, then
    ``fuse_exact``), on the CPU: (graph module, regions)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from cadence_fx import passes
    from cadence_fx.passes.context import PassContext
    from cadence_fx.passes.pipeline import FUSION_PREP
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*[a.clone() for a in args])
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*[a.clone() for a in args])
    ctx = PassContext(adapter=None, class_key="k", inputs=[], regions=[], module_buffers={})
    for name in (*FUSION_PREP, "fuse_exact"):
        gm = getattr(passes, name)(gm, ctx).graph_module
    gm.graph.lint()
    gm.recompile()
    fusion.make_regions(gm, ctx)   # the runtime's regions of the pass's specs
    return gm, regions(gm)


def test_a_write_closes_the_regions_open_before_it(fuse_on_cpu):
    """``a`` reads ``w`` before ``w.add_(1)``: it may not run with ``b``, after the write."""
    def f(x, w):
        a = w * 3.0
        w.add_(1)
        b = w * 5.0
        return (a + b) * x,

    x, w = torch.randn(8), torch.randn(8)
    gm, found = _fused_graph(f, x, w)
    expected = f(x, w.clone())
    for _ in range(2):   # the first call verifies (stock result), the second runs the verdict
        assert torch.equal(gm(x, w.clone())[0], expected[0])
    assert [len(r.ops) for r in found] == [3]          # b, a + b, * x; ``a`` alone stays stock
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][:2] == [
        aten.mul.Tensor, aten.add_.Tensor]


def test_a_value_read_by_a_stock_kernel_closes_its_region(fuse_on_cpu):
    """``s`` (a reduction) reads ``a``: the region holding ``a`` must run before it."""
    def f(x):
        a = x * 2.0
        s = a.sum()
        return (a * 3.0 + s) * x,

    x = torch.randn(16)
    gm, found = _fused_graph(f, x)
    assert all(torch.equal(gm(x)[0], f(x)[0]) for _ in range(2))
    assert [len(r.ops) for r in found] == [3]          # the three after the sum; ``a`` stays stock


def test_host_side_work_in_a_device_step_stays_out_of_regions():
    """A step on a device (``meta`` stands in for it here) with position arithmetic on the host:
    the host ops are not fused with the device ops, nor made a region of their own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from cadence_fx.passes.fuse_exact import regions_in_order

    def f(x, pos):
        return x * 2.0 + x, (pos * 3 + 1) * 2

    x, pos = torch.randn(8, device="meta"), torch.arange(4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x, pos)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x, pos)
    on_device = regions_in_order(gm.graph, "meta")
    assert [[n.target for n in r] for r in on_device] == [[aten.mul.Tensor, aten.add.Tensor]]
    assert len(regions_in_order(gm.graph, "cpu")[0]) == 3       # the host ones, on a host step


def test_ops_with_several_outputs_are_views_inside_a_region():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from cadence_fx.passes.fuse_exact import regions_in_order

    def g(x):
        a, b = x.chunk(2)
        return (a * b + a) * 3.0,

    x = torch.randn(8)
    gm = torch.fx.experimental.proxy_tensor.make_fx(g, pre_dispatch=True)(x)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
    (region,) = regions_in_order(gm.graph)
    assert [str(n.target) for n in region] == ["aten.chunk.default", "<built-in function getitem>",
                                               "<built-in function getitem>", "aten.mul.Tensor",
                                               "aten.add.Tensor", "aten.mul.Tensor"]


def test_a_fused_run_that_fails_is_refused_but_a_device_error_is_raised(monkeypatch):
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a: (a * 2.0 + a,))(torch.randn(4))

    def failing(error):
        def compile_(module, args, graph=None):
            def run(*a):
                raise error
            return run
        return compile_
    monkeypatch.setattr(fusion, "compile_region", failing(ValueError("bad launch")))
    region = FusedRegion(gm, "r", ["mul", "add"])
    assert torch.equal(region(torch.ones(4))[0], torch.full((4,), 3.0))
    assert (region.state, region.reason) == ("stock", "the fused code failed: ValueError: bad launch")
    monkeypatch.setattr(fusion, "compile_region", failing(torch.OutOfMemoryError("out of memory")))
    region = FusedRegion(gm, "r", ["mul", "add"])
    with pytest.raises(torch.OutOfMemoryError):
        region(torch.ones(4))
    assert region.state == "pending"     # decided on a later call


def test_equal_values_are_not_enough_bits_are_compared():
    zero, neg_zero = torch.zeros(3), -torch.zeros(3)
    assert torch.equal(zero, neg_zero)
    assert fusion._difference((zero,), (neg_zero,)) == "output 0 differs from stock in 3 of 3 elements"
    nan = torch.full((2,), float("nan"))
    payload = nan.clone()
    payload.view(torch.int32)[0] = 0x7FC00123
    assert fusion._difference((nan,), (nan.clone(),)) is None     # unequal under equal(), same bits
    assert fusion._difference((nan,), (payload,)) == "output 0 differs from stock in 1 of 2 elements"
    t = torch.randn(4, 4)
    assert "stock gives" in fusion._difference((t,), (t.t().contiguous().t(),))   # same values, strides
    assert fusion._difference((t,), (t, t)) == "2 outputs, stock has 1"


def test_region_rewrite_keeps_views_used_after_it(fuse_on_cpu):
    """A view inside a region that is also read after it is made again outside, from the
    region's output, and the graph computes what it computed."""
    from cadence_fx.passes.context import PassContext
    from cadence_fx.passes.fuse_exact import fuse_exact

    def f(x, s, b):
        y = x * (1 + s) + b
        v = y.view(2, 8)          # read inside the region and after it
        return torch.mm(v.t(), v * 2), v

    args = (torch.randn(16), torch.randn(16), torch.randn(16))
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    FakeTensorProp(gm, FakeTensorMode()).propagate(*args)
    ctx = PassContext(adapter=None, class_key="k", inputs=[], regions=[], module_buffers={})
    expected = gm(*args)
    result = fuse_exact(gm, ctx)
    gm = result.graph_module
    gm.recompile()
    fusion.make_regions(gm, ctx)   # the runtime's regions of the pass's specs
    assert result.modified and len(regions(gm)) == 1
    r = regions(gm)[0]
    assert r.ops == ["aten.add.Tensor", "aten.mul.Tensor", "aten.add.Tensor", "aten.mul.Tensor"]
    for _ in range(2):   # verification's call, then the admitted form
        got = gm(*args)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert r.state in ("fused", "stock") and (r.state == "fused") == (r.reason is None)
    views_after = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert len(views_after) == 1 and views_after[0].args[0].target.__name__ == "getitem"


# -- on the device ------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _edges(dtype, n=4096, seed=0):
    """Random values of several magnitudes, with ±0, subnormals, ±inf, NaN payloads, ±3e38,
    ±88.7 planted at the front (integers: 0, ±1, ±7, the extremes)."""
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int64, torch.int32, torch.bool):
        x = torch.randint(-2 ** 30, 2 ** 30, (n,), generator=g, dtype=torch.int64)
        info = torch.iinfo(torch.int32 if dtype == torch.int32 else torch.int64)
        planted = torch.tensor([0, 1, -1, 7, -7, info.max, info.min], dtype=torch.int64)
        x[:len(planted)] = planted
        return (x > 0 if dtype == torch.bool else x.to(dtype)).cuda()
    x = torch.randn(n, generator=g) * torch.logspace(-6, 6, n).index_select(0, torch.randperm(n, generator=g))
    planted = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e-39, float("inf"), float("-inf"),
                            float("nan"), 3e38, -3e38, 88.7, -88.7, 1.0, -1.0, 0.5, 1e-7])
    x[:len(planted)] = planted
    x = x.to(dtype)
    if dtype == torch.float32:      # a NaN with a payload of its own
        x.view(torch.int32)[len(planted)] = 0x7FC00123
    return x.cuda()


def _dtypes(op):
    from cadence_fx.passes.exact_ops import FLOAT, INT
    kinds = EXACT_OPS[op][0]
    out = [torch.float32, torch.bfloat16] if set(FLOAT) <= set(kinds) else []
    out += [torch.int64] if set(INT) <= set(kinds) else []
    return out or [torch.bool]


def _op_case(op, dtype):
    """``(fn, make_inputs)``: the op as a model calls it, on inputs of ``dtype``."""
    cmp = op.overloadpacket in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge)
    scalar = 0.5 if dtype.is_floating_point else 3
    if cmp and op._overloadname == "Scalar" or op is aten.full_like.default:
        return lambda a, b: op(a, scalar)
    if op is aten.clamp.default:
        return lambda a, b: (op(a, -5, 5), op(a, None, 0), op(a, 3), op(a, 5, -5))   # min > max: max
    if op is aten.remainder.Scalar:
        return lambda a, b: (op(a, 7), op(a, -3))
    if op is aten.clone.default:
        return lambda a, b: op(a.t() if a.dim() == 2 else a)
    if op is aten.pow.Tensor_Scalar:
        return lambda a, b: op(a, 2)
    if op in (aten.cat.default, aten.stack.default):
        return lambda a, b: op([a, b], 0)
    if op is aten.where.self:
        return lambda a, b: op(a > b, a, b)
    if op in (aten.logical_and.default, aten.logical_or.default):
        return lambda a, b: op(a > b, b > a)
    if op in (aten._to_copy.default, aten.to.dtype, aten.to.device):
        to = {torch.bfloat16: torch.float32, torch.float32: torch.bfloat16}[dtype]
        if op is aten._to_copy.default:
            return lambda a, b: op(a, dtype=to)
        return lambda a, b: op(a, to) if op is aten.to.dtype else op(a, a.device, to)
    if len(op._schema.arguments) == 1 or op in (aten.silu.default,):
        return lambda a, b: op(a)
    return lambda a, b: op(a, b)


_CASES = [(op, dt) for op in sorted(EXACT_OPS, key=str) for dt in _dtypes(op)
          if not (op in (aten._to_copy.default, aten.to.dtype, aten.to.device) and dt == torch.int64)]


@pytest.mark.parametrize("op,dtype", _CASES, ids=[f"{op}-{dt}" for op, dt in _CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_whitelisted_op_fused_is_atens_bits_on_the_device(op, dtype):
    """The op alone, compiled as a region and compared bit for bit with ATen's kernel on three
    pairings of edge inputs (one of them makes NaNs: inf - inf, 0 * inf)."""
    fn = _op_case(op, dtype)
    a, b = _edges(dtype, seed=1), _edges(dtype, seed=2).flip(0)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: tuple(pytree_leaves(fn(a, b))),
                                                    pre_dispatch=True)(a, b)   # as cadence_fx traces
    assert any(n.target is op for n in gm.graph.nodes)
    region = FusedRegion(gm, "probe", [str(op)])
    region(a, b)
    assert region.state == "fused", region.reason
    for x, y in ((a, a.roll(1)), (a, a), (b, _edges(dtype, seed=3))):
        assert fusion._difference(gm(x, y), region(x, y)) is None


def pytree_leaves(x):
    return list(x) if isinstance(x, tuple) else [x]


CHAINS = {
    "adaLN": lambda x, s, b: x * (1 + s) + b,
    "gate": lambda x, g, y: x + g * y,
    "silu_mul": lambda a, b, c: torch.nn.functional.silu(a) * b,
    "euler": lambda x, dt, v: x + dt * v,
    "cfg": lambda a, w, b: (1 + w) * a - w * b,
    "div_number": lambda x, y, z: x / 0.7 + y * z,
    "rms_tail": lambda x, r, w: (x.float() * r).to(x.dtype) * w,
    # Moshi's form: the halves rotated, then stacked
    "rope": lambda x, cos, sin: torch.stack([x[..., :8] * cos[..., :8] - x[..., 8:] * sin[..., :8],
                                             x[..., :8] * sin[..., :8] + x[..., 8:] * cos[..., :8]], -1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_chains_fused_are_stock_bits_on_the_device(chain, dtype):
    xs = [_edges(dtype, seed=s).view(256, 16) for s in range(3)]
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda *a: (CHAINS[chain](*a),))(*xs)
    region = FusedRegion(gm, chain, [chain])
    region(*xs)
    assert region.state == "fused", region.reason
    for seed in range(3, 8):
        ys = [_edges(dtype, seed=seed * 3 + k).view(256, 16) for k in range(3)]
        assert fusion._difference(gm(*ys), region(*ys)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conformer_on_the_device_replays_fused_regions_bit_exact():
    stock_model, model = make_model().cuda(), make_model().cuda()
    turns = TURNS

    def on_device(step):
        def run(x, state):
            return step(x.cuda(), None if state is None else {k: v.cuda() for k, v in state.items()})
        return run

    ref = run_turns(on_device(stock_model), turns, seed=5)[0]
    compiled = cadence_fx.compile(model, CONFORMER_ADAPTER)
    ours = run_turns(on_device(compiled), turns, seed=5)[0]
    assert same(ref, ours)
    k = compiled.counters
    assert k.fallbacks == 0 and k.replays >= k.calls and k.fused_regions > 0
    found = _all_regions(compiled)
    assert all(r.state != "pending" for r in found)
    print({"regions": len(found), "fused": k.fused_regions, "refused": k.fusions_refused,
           "reasons": sorted({r.reason for r in found if r.reason})[:5]})


def test_a_restarted_server_loads_its_fused_regions_from_the_cache_and_verifies_them_again(
        fuse_on_cpu, stock, tmp_path):
    first = cadence_fx.compile(make_model(), CONFORMER_ADAPTER, cache_dir=tmp_path)
    assert same(stock, run_turns(first, TURNS, seed=5)[0])
    states = sorted(r.state for r in _all_regions(first))
    restarted = cadence_fx.compile(make_model(), CONFORMER_ADAPTER, cache_dir=tmp_path)
    assert same(stock, run_turns(restarted, TURNS, seed=5)[0])
    k = restarted.counters
    assert k.traces == 0 and k.compiled_loads == len(restarted.classes) > 0
    again = _all_regions(restarted)
    assert sorted(r.state for r in again) == states            # the same verdicts, made again
    assert k.fused_regions == states.count("fused") > 0


def test_the_report_says_what_fusion_made_of_each_class(fuse_on_cpu, stock, monkeypatch):
    calls = []

    def refuse_first(module, args, graph=None):   # the first region compiled is refused
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refused for the test")
        return module
    monkeypatch.setattr(fusion, "compile_region", refuse_first)
    compiled = _compiled()
    assert same(stock, run_turns(compiled, TURNS, seed=5)[0])
    rows = compiled.report().classes()
    found = _all_regions(compiled)
    assert sum(r["fusion"]["regions"] for r in rows) == len(found) > 1
    assert sum(r["fusion"]["fused"] for r in rows) == len(found) - 1 == compiled.counters.fused_regions
    assert [s for r in rows for s in r["fusion"]["stock"]] == [
        (next(r for r in found if r.state == "stock").region_name,
         "compile failed: RuntimeError: refused for the test")]
    text = str(compiled.report())
    assert "stock: compile failed: RuntimeError: refused for the test" in text
    assert f"{rows[0]['fusion']['regions']} regions" in text


def test_an_output_of_a_multi_output_view_joins_only_the_region_holding_the_view():
    """``b = chunk(x)[1]`` read after the region holding ``chunk`` closed: the region that reads
    ``b`` gets ``b`` (a tensor) as its input, not the chunk's list of outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from cadence_fx.passes.fuse_exact import regions_in_order

    def g(x):
        a, b = x.chunk(2)
        c = a * 2.0 + a
        s = c.sum()
        return (b * 3.0 + b) * s,

    x = torch.randn(8)
    gm = torch.fx.experimental.proxy_tensor.make_fx(g, pre_dispatch=True)(x)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
    late = [n for n in gm.graph.nodes if n.target is operator.getitem][1]
    next(n for n in gm.graph.nodes if n.target is aten.sum.default).append(late)   # b after the sum
    gm.graph.lint()
    first, second = regions_in_order(gm.graph)
    assert late not in first and late not in second
    assert [str(n.target) for n in second] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.mul.Tensor"]


def test_a_server_lifecycle_with_fused_regions_retry_new_speaker_and_mode_change(fuse_on_cpu):
    """As a server drives one compiled step: speaker 0 primed and streaming, a chunk retried from
    a clone of the state before it, speaker 1 primed mid-stream (the state of the speaker set
    aside is cloned, as the carry contract asks), a chunk under ``inference_mode`` (a new mode,
    a new class) -- every output and state bit-exact against stock run through the same script."""
    from streaming_conformer import chunk_feats, clone_state, prompt_feats

    xs = chunk_feats([8, 12, 8, 12], seed=11)

    def script(step):
        out = []

        def call(x, state, seed, mode=torch.no_grad):
            torch.manual_seed(seed)
            with mode():
                y, new = step(x, state)
            out.append((y.clone(), clone_state(new)))
            return new

        s0 = call(prompt_feats(0), None, 1)
        s0 = call(xs[0], s0, 2)
        before = clone_state(s0)                     # kept to retry the next chunk
        call(xs[1], s0, 3)
        s0 = clone_state(call(xs[1], clone_state(before), 3))   # the retry; kept while away
        s1 = clone_state(call(prompt_feats(1), None, 4))        # a new speaker, mid-stream
        s0 = call(xs[2], s0, 5)
        call(xs[3], s1, 6, mode=torch.inference_mode)
        return out

    stock = script(make_model())
    compiled = _compiled()
    assert same(stock, script(compiled))
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (k.calls, 0) and k.calls == len(stock)
    assert k.fused_regions > 0 and all(r.state != "pending" for r in _all_regions(compiled))
