"""Exact fusion: runs of pointwise ops between the stock kernels become one fused region each,
admitted at run time only if it computes the same bits (``cadence_fx.fusion``). Case handled --
the DiT block's adaLN modulation and gated residual, Moshi's RoPE::

    before:  a = add(scale, 1); m = mul(x, a); y = add(m, shift); g = mul(gate, h); r = add(y, g)
             (five kernels between the norm and the next GEMM)
    after:   r = fused_3(scale, x, shift, gate, h)[0]      # one call; Inductor, eager numerics

GEMMs, convolutions, reductions (norms, softmax), copies into the carry and everything else stay
the stock kernels. A region holds only ops of ``EXACT_OPS``, whose fused form is the same
arithmetic as ATen's kernel -- one correctly rounded IEEE operation per element (add, sub, mul,
division by a device tensor, comparisons, selects, widening casts), or the same formula through the same
libdevice routine (exp, tanh, sin, cos, sqrt, rsqrt, sigmoid, silu) -- on dtypes the models use,
and views that launch no kernel. What stays out, and why:

* ``add``/``sub`` with ``alpha`` != 1: ATen's kernel may contract ``a + alpha * b`` into an FMA;
* division by a Python number or a host scalar: ATen multiplies by its reciprocal instead;
* narrowing casts (fp32 -> bf16): ATen makes every NaN the canonical one, the device keeps payloads;
* erf-GELU, softmax, LayerNorm, RMSNorm: never bit-exact when fused (a probe on the H200);
* anything in place: its order against the carry's writes is the graph's.

A region is a maximal run of such nodes in graph order (so no path leaves it and comes back),
with at least two kernels (one kernel gains nothing). Its outputs are the values used after it; a
view used after it is made again outside from the region's output. Regions are fused on device
steps only (``cadence_fx.fusion.DEVICES``): on the CPU, Inductor's C++ is not held to the stock numerics. Invariant:
the graph computes what it computed; each region decides at run time, on the class's real inputs,
whether it runs fused (``torch.equal`` of every output's bits, dtype and strides) or stock.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from cadence_fx.context import PassContext
from cadence_fx import fusion
from cadence_fx.fusion import FusedRegion
from cadence_fx.fx_utils import aten, graph_module, val

__all__ = ["fuse_exact", "EXACT_OPS", "fusible"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool)
MIN_KERNELS = 2


def _unit_alpha(n: Node) -> bool:
    return n.kwargs.get("alpha", 1) == 1 and len(n.args) <= 2


def _device_divisor(n: Node) -> bool:
    d = n.args[1] if len(n.args) > 1 else None
    return (isinstance(d, Node) and val(d) is not None and val(d).device.type != "cpu"
            and not n.kwargs.get("rounding_mode"))


def _widening_cast(n: Node) -> bool:
    """A cast on the same device that loses nothing (bf16/fp16 -> fp32, anything -> bool): a
    narrowing fp32 -> bf16 cast in ATen turns every NaN into the canonical one, the device's
    conversion instruction keeps its payload."""
    x = val(n.args[0]) if n.args else None
    to = n.kwargs.get("dtype")
    return (set(n.kwargs) <= {"dtype"} and len(n.args) == 1 and x is not None
            and (to in (torch.float32, torch.bool) or to == x.dtype))


def _always(n: Node) -> bool:
    return True


# op -> when the node may fuse; the comment says why its fused form is the stock arithmetic
EXACT_OPS: Dict[torch._ops.OpOverload, Callable[[Node], bool]] = {
    # one correctly rounded IEEE operation per element (no FMA contraction in the fused code)
    aten.add.Tensor: _unit_alpha, aten.sub.Tensor: _unit_alpha, aten.mul.Tensor: _always,
    aten.div.Tensor: _device_divisor, aten.neg.default: _always, aten.abs.default: _always,
    aten.where.self: _always,
    aten.eq.Tensor: _always, aten.ne.Tensor: _always, aten.lt.Tensor: _always,
    aten.le.Tensor: _always, aten.gt.Tensor: _always, aten.ge.Tensor: _always,
    aten.eq.Scalar: _always, aten.ne.Scalar: _always, aten.lt.Scalar: _always,
    aten.le.Scalar: _always, aten.gt.Scalar: _always, aten.ge.Scalar: _always,
    aten.logical_not.default: _always, aten.logical_and.default: _always,
    aten.logical_or.default: _always,
    aten._to_copy.default: _widening_cast,
    # the same formula through the same libdevice routine as ATen's kernel (checked on the device)
    aten.exp.default: _always, aten.tanh.default: _always, aten.sin.default: _always,
    aten.cos.default: _always, aten.sqrt.default: _always, aten.rsqrt.default: _always,
    aten.sigmoid.default: _always, aten.silu.default: _always,
}
# views, and ops that are views at inference: no kernel of their own (a reshape that must copy is
# a copy, exact either way); inside a region only
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.expand.default, aten.permute.default, aten.t.default,
         aten.transpose.int, aten.select.int, aten.slice.Tensor, aten.dropout.default}
_VIEW_RULES = {aten.dropout.default: lambda n: len(n.args) > 2 and n.args[2] is False}


def fusible(node: Node) -> bool:
    """Whether ``node`` may be part of a fused region."""
    if node.op != "call_function":
        return False
    rule = EXACT_OPS.get(node.target)
    if rule is None and node.target not in VIEWS:
        return False
    v = val(node)
    if v is None or v.dtype not in DTYPES:
        return False
    if any(val(a) is None or val(a).dtype not in DTYPES or val(a).device != v.device
           for a in node.all_input_nodes):
        return False
    if rule is None:
        return _VIEW_RULES.get(node.target, _always)(node)
    return rule(node)


def fuse_exact(gm: GraphModule, ctx: PassContext) -> PassResult:
    records = ctx.records.setdefault("fusion", {"regions": [], "skipped": None})
    device = _device(gm)
    if device not in fusion.DEVICES:
        records["skipped"] = (f"fusion is for device steps ({', '.join(fusion.DEVICES)}); this step "
                              f"runs on {device}")
        return PassResult(gm, False)
    runs: List[List[Node]] = [[]]
    for n in gm.graph.nodes:
        if fusible(n):
            runs[-1].append(n)
        elif runs[-1]:
            runs.append([])
    counters = getattr(ctx, "counters", None)
    made = 0
    for run in runs:
        while run and run[-1].target in VIEWS:    # a run ends on a kernel
            run.pop()
        kernels = [n for n in run if n.target not in VIEWS]
        if len(kernels) < MIN_KERNELS:
            continue
        name = f"fused_{made}"
        _replace(gm, run, name, counters)
        records["regions"].append({"name": name, "kernels": len(kernels),
                                   "ops": sorted({n.target.__name__ for n in kernels})})
        made += 1
    return PassResult(gm, made > 0)


def _device(gm: GraphModule) -> str:
    for n in gm.graph.nodes:
        v = val(n)
        if v is not None and v.device.type != "cpu":
            return v.device.type
    return "cpu"


def _replace(gm: GraphModule, run: List[Node], name: str, counters) -> None:
    members = set(run)
    inputs: List[Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    used_after = {n for n in run if any(u not in members for u in n.users)}
    # a view used after the region is made again outside it, from the kernel output it views
    outputs: List[Node] = []

    def output_of(n: Node) -> None:
        if n not in members:
            return
        if n.target in VIEWS:
            for a in n.all_input_nodes:
                output_of(a)
        elif n not in outputs:
            outputs.append(n)

    for n in run:
        if n in used_after:
            output_of(n)
    sub = Graph()
    env: Dict[Node, Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in run:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    stock = graph_module(torch.nn.Module(), sub, class_name=name)
    gm.add_submodule(name, FusedRegion(stock, name, [str(n.target) for n in run
                                                   if n.target not in VIEWS], counters))
    last = run[-1]
    outside: Dict[Node, Node] = {}
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(val(o) for o in outputs)
    cursor = call
    for k, o in enumerate(outputs):
        with gm.graph.inserting_after(cursor):
            cursor = outside[o] = gm.graph.call_function(operator.getitem, (call, k))
        cursor.meta = dict(o.meta)

    def remade(n: Node) -> Node:          # the value of ``n`` outside the region
        nonlocal cursor
        if n not in members:
            return n
        if n not in outside:
            args = torch.fx.node.map_arg(n.args, remade)
            kwargs = torch.fx.node.map_arg(n.kwargs, remade)
            with gm.graph.inserting_after(cursor):
                cursor = outside[n] = gm.graph.call_function(n.target, args, kwargs)
            cursor.meta = dict(n.meta)
        return outside[n]

    for n in run:
        if n in used_after:
            replacement = remade(n)
            for u in list(n.users):
                if u not in members:
                    u.replace_input_with(n, replacement)
    for n in reversed(run):
        gm.graph.erase_node(n)


def regions_of(gm: torch.nn.Module) -> List[FusedRegion]:
    return [m for m in gm.modules() if isinstance(m, FusedRegion)]


def kernels_fused(gm: torch.nn.Module) -> Optional[int]:
    return sum(len(r.ops) for r in regions_of(gm) if r.state == "fused")
