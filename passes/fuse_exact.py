"""Exact fusion: runs of pointwise ops between the stock kernels become one fused region each,
admitted at run time only if it computes the same bits (``cadence_fx.fusion``). Case handled --
the DiT block's adaLN modulation and gated residual, Moshi's RoPE::

    before:  a = add(scale, 1); m = mul(x, a); y = add(m, shift); g = mul(gate, h); r = add(y, g)
             (five kernels between the norm and the next GEMM)
    after:   r = fused_3(scale, x, shift, gate, h)[0]      # one call; Inductor, eager numerics
             # fused_3: the stock graph of the five, and its RegionSpec; the runtime makes it a
             # FusedRegion (``cadence_fx.fusion.make_regions``)

GEMMs, convolutions, reductions (norms, softmax), copies into the carry and everything else stay
the stock kernels. A region holds only ops of ``EXACT_OPS`` (``passes/exact_ops.py``), whose fused
form is the same arithmetic as ATen's kernel: no rounding at all (int64 arithmetic, comparisons,
selects, copies by ``cat``/``stack``/``clone``), one correctly rounded IEEE operation per element
(add, sub, mul, division, casts between fp32 and bf16), or the same formula through the same
libdevice routine (exp, tanh, sin, cos, sqrt, rsqrt, silu) -- with Inductor held to eager numerics
(``fusion.NUMERICS``: no FMA contraction, IEEE division, no flush-to-zero, every bf16 round trip
kept, no fast math) -- and views that launch no kernel, on fp32, bf16, int64 and bool values of the
step's device. Each op is checked against ATen's kernel on the device over edge inputs, per dtype
(tests/test_fuse_exact.py). What stays out, and why:

* ``add``/``sub`` with ``alpha`` != 1: ATen's kernel may contract ``a + alpha * b`` into an FMA;
* division by a host tensor: ATen multiplies by its reciprocal (a Python number is fine: Inductor
  is given that same product, ``exact_ops.reciprocal``, in ``fusion.inductor_form``);
* ``neg``, ``abs`` (a NaN's sign and payload), a floating ``clamp`` (-0 against +0; an integer
  one by integer bounds fuses), ``sigmoid`` (another formula): not ATen's bits on the H200;
  erf-GELU, softmax, LayerNorm, RMSNorm: never bit-exact when fused; casts other than fp32 <->
  bf16, fp16 and int32: not covered by the op test;
* a literal the compilers fold: ``x + 0``, ``x * 1`` (dropped), ``x * 0`` (zeros), ``x * -1`` (a
  sign flip), a division whose fp32 reciprocal is 0 or ±1; ATen computes them (-0 + 0 is +0, NaN
  * 0 is NaN, the device's multiply makes a NaN canonical); a floating ``full_like``, a fill
  Inductor folds into its users, which then meet the same fate (an integer or boolean fill read
  only by integer and boolean ops fuses: folding is exact there);
* host-side work in a device step: it stays stock, and eager;
* anything in place: its order against the carry's writes is the graph's -- but for one write a
  region may end on: a ``copy_`` of one of its values into a tensor outside it, at the same shape
  and dtype (Moshi's state updates, ``offset.copy_(where(...))``). The region then writes that
  tensor where the copy was, and the copy's kernel is gone; nothing else the region reads may
  share the written storage (``region_writes.absorbed_write``).

A region is a set of such nodes that can run as one at the place of its last node
(``regions_in_order``: nothing outside reads its values before that, nothing is written in
between, so no path leaves it and comes back), with at least two kernels (one gains nothing).
Its outputs are the values used after it; a view used after it is made again outside from the
region's output. Regions are made on device steps only (``DEVICES``): on the
CPU, Inductor's C++ is not held to the stock numerics. Invariant: the graph computes what it
computed; each region decides at run time, on the class's real inputs, whether it runs fused
(the bits, dtype and strides of every output equal) or stock.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .exact_ops import DEVICES, DTYPES, VIEWS, fusion_device, fusible, is_kernel
from .fx_utils import WRITES, aten, graph_module, is_mutating, step_device, subgraph, val
from .records import FusedRegionRecord
from .region_writes import absorbed_write, write_target
from .specs import RegionSpec

__all__ = ["fuse_exact", "regions_in_order"]

MIN_KERNELS = 2


def fuse_exact(gm: GraphModule, ctx: PassContext) -> PassResult:
    ctx.records.update_fusion()
    device = fusion_device(gm)
    if device is None:
        ctx.records.update_fusion(skipped=f"fusion is for device steps ({', '.join(DEVICES)}); "
                                          f"this step runs on {step_device(gm).type}")
        return PassResult(gm, False)
    runs = regions_in_order(gm.graph, device)
    made = 0
    fused: List[FusedRegionRecord] = []
    for run in runs:
        while run and not _launches(run[-1]):    # a run ends on a kernel (or its write)
            run.pop()
        kernels = [n for n in run if _launches(n)]
        if len(kernels) < MIN_KERNELS:
            continue
        name = f"fused_{made}"
        writes = _replace(gm, ctx, run, name)
        fused.append(FusedRegionRecord(name, len(kernels),
                                       tuple(sorted({n.target.__name__ for n in kernels})), writes))
        made += 1
    ctx.records.update_fusion(regions=ctx.records.fusion.regions + tuple(fused),
                              writes_absorbed=sum(r.writes for r in fused))
    return PassResult(gm, made > 0)


def _launches(n: Node) -> bool:
    """A kernel of the stock graph a region takes over: a fusible op, or the write it ends on."""
    return is_kernel(n) or n.target is aten.copy_.default


def regions_in_order(graph, device: Optional[str] = None) -> List[List[Node]]:
    """The fusible nodes grouped into regions, each in graph order. One region is open at a time:
    a fusible node joins it (or opens one); it closes when a stock node reads one of its values,
    or at a write, a side effect or a mode switch. So the region can run where its last node is:
    every value it reads exists by then, none of them has been written in between, and nothing
    before that point needs its values."""
    regions: List[List[Node]] = []
    members: set = set()
    current: Optional[List[Node]] = None
    for n in graph.nodes:
        # an output of an op with several (a view) joins only the region that holds the op: a
        # region's inputs are tensors
        outside_view = n.target is operator.getitem and n.args[0] not in members
        if fusible(n, device) and not outside_view and not write_target(n, VIEWS):
            if current is None:
                current = []
                regions.append(current)
            current.append(n)
            members.add(n)
            continue
        if n.op in ("placeholder", "get_attr"):
            continue
        if current is not None and absorbed_write(n, members, device, DTYPES):
            current.append(n)     # the region writes its value where the copy was, and closes
            current, members = None, set()
            continue
        pure = n.op == "call_function" and not is_mutating(n) and (
            isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem)
        if not pure or (current is not None and any(a in members for a in n.all_input_nodes)):
            current = None   # read by a stock node, or a write, a side effect, a mode switch
            members = set()  # (autocast, grad), the output: the region closes
    return regions


def _kernel_outputs(run: List[Node], members: set, used_after: set) -> List[Node]:
    """The region's outputs: the kernel values used after it (a view used after it is made again
    outside it, from the kernel output it views)."""
    outputs: List[Node] = []

    def output_of(n: Node) -> None:
        if n not in members:
            return
        if not is_kernel(n):
            for a in n.all_input_nodes:
                output_of(a)
        elif n not in outputs:
            outputs.append(n)

    for n in run:
        if n in used_after:
            output_of(n)
    return outputs


def _replace(gm: GraphModule, ctx: PassContext, run: List[Node], name: str) -> int:
    """The run as one call of its stock graph, with its spec (the runtime's ``FusedRegion``);
    returns how many writes it took over (0 or 1)."""
    members = set(run)
    write = run[-1] if run[-1].target is aten.copy_.default else None
    if write is not None:          # copy_ returns its destination: its readers read that
        write.replace_all_uses_with(write.args[0])
    inputs: List[Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    used_after = {n for n in run if any(u not in members for u in n.users)}
    outputs = _kernel_outputs(run, members, used_after)
    stock = graph_module(torch.nn.Module(), subgraph(run, inputs, outputs), class_name=name)
    writes = (inputs.index(write.args[0]),) if write is not None else ()
    gm.add_submodule(name, stock)
    ctx.specs.regions.append(RegionSpec(name, stock, [str(n.target) for n in run if _launches(n)],
                                        writes))
    last = run[-1]
    outside: Dict[Node, Node] = {}
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(val(o) for o in outputs)
    if writes:
        call.meta[WRITES] = writes
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
    return len(writes)

