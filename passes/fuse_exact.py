"""Exact fusion: runs of pointwise ops between the stock kernels become one fused region each,
admitted at run time only if it computes the same bits (``cadence_fx.fusion``). Case handled --
the DiT block's adaLN modulation and gated residual, Moshi's RoPE::

    before:  a = add(scale, 1); m = mul(x, a); y = add(m, shift); g = mul(gate, h); r = add(y, g)
             (five kernels between the norm and the next GEMM)
    after:   r = fused_3(scale, x, shift, gate, h)[0]      # one call; Inductor, eager numerics

GEMMs, convolutions, reductions (norms, softmax), copies into the carry and everything else stay
the stock kernels. A region holds only ops of ``EXACT_OPS``, whose fused form is the same
arithmetic as ATen's kernel: no rounding at all (int64 arithmetic, comparisons, selects, copies by
``cat``/``stack``/``clone``), one correctly rounded IEEE operation per element (add, sub, mul,
division, casts between fp32 and bf16), or the same formula through the same libdevice routine
(exp, tanh, sin, cos, sqrt, rsqrt, silu) -- with Inductor held to eager numerics
(``fusion.NUMERICS``: no FMA contraction, IEEE division, no flush-to-zero, every bf16 round trip
kept, no fast math) -- and views that launch no kernel, on fp32, bf16, int64 and bool values of
the step's device. Each op is checked against ATen's kernel on the device over edge inputs, per
dtype (tests/test_fuse_exact.py). What stays out, and why:

* ``add``/``sub`` with ``alpha`` != 1: ATen's kernel may contract ``a + alpha * b`` into an FMA;
* division by a host tensor: ATen multiplies by its reciprocal (a Python number is fine: Inductor
  is given that same product, ``fusion.inductor_form``);
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
region's output. Regions are made on device steps only (``cadence_fx.fusion.DEVICES``): on the
CPU, Inductor's C++ is not held to the stock numerics. Invariant: the graph computes what it
computed; each region decides at run time, on the class's real inputs, whether it runs fused
(the bits, dtype and strides of every output equal) or stock.
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from cadence_fx import fusion
from cadence_fx.context import PassContext
from cadence_fx.fusion import FusedRegion
from cadence_fx.passes.region_writes import absorbed_write, write_target
from cadence_fx.fx_utils import WRITES, aten, graph_module, is_mutating, step_device, subgraph, val

__all__ = ["fuse_exact", "EXACT_OPS", "VIEWS", "fusible", "is_kernel"]

# the dtypes the op test covers on the device (the models' own): fp16 and int32 are left out
FLOAT = (torch.float32, torch.bfloat16)
INT = (torch.int64,)
BOOL = (torch.bool,)
DTYPES = FLOAT + INT + BOOL
MIN_KERNELS = 2


def _unit_alpha(n: Node) -> bool:
    return n.kwargs.get("alpha", 1) == 1 and len(n.args) <= 2 and not _identity(n, 0)


def _identity(n: Node, *units) -> bool:
    """A literal operand Inductor or the device compiler folds: ``x + 0`` and ``x * 1`` are
    dropped, ``x * 0`` becomes zeros, ``x * -1`` a sign flip. ATen computes them: -0 + 0 is +0,
    NaN * 0 is NaN, and the device's multiply makes a NaN canonical where a sign flip keeps it."""
    return any(not isinstance(a, Node) and a in units for a in n.args)


def _no_unit(n: Node) -> bool:
    return not _identity(n, 0, 1, -1)


def _divisor(n: Node) -> bool:
    """Division by a device tensor (div_rn on both sides) or by a Python number, which ATen
    computes as a product with its reciprocal (``fusion.inductor_form`` gives Inductor the same
    product); not by a host tensor."""
    d = n.args[1] if len(n.args) > 1 else None
    if n.kwargs.get("rounding_mode"):
        return False
    if isinstance(d, Node):
        return val(d) is not None and val(d).device.type != "cpu"
    if not isinstance(d, (int, float)) or isinstance(d, bool):
        return False
    return fusion.reciprocal(d) not in (0.0, 1.0, -1.0)    # a product the compiler would fold


def _cast_to(n: Node) -> Optional[torch.dtype]:
    """The dtype a cast on the same device makes, or None for any other form of cast."""
    t = n.target
    if t is aten._to_copy.default and len(n.args) == 1 and set(n.kwargs) <= {"dtype"}:
        return n.kwargs.get("dtype")
    extra = {aten.to.dtype: 2, aten.to.device: 3}.get(t)
    if extra is not None and len(n.args) <= extra and not n.kwargs:
        return n.args[extra - 1]
    return None


def _cast(n: Node) -> bool:
    """A cast on the device between fp32 and bf16: one correctly rounded conversion per element
    on both sides (the op test covers both directions; other casts stay stock until it covers
    them -- floating to integer is undefined for NaN and out-of-range values anyway)."""
    x, to = val(n.args[0]), _cast_to(n)
    if to is None or val(n).device != x.device or to == x.dtype:   # same dtype: ``to`` returns its input (a view, below)
        return False
    return to in FLOAT and x.dtype in FLOAT


def _same_dtype_to(n: Node) -> bool:
    return _cast_to(n) == val(n.args[0]).dtype and val(n).device == val(n.args[0]).device


def _square(n: Node) -> bool:
    return len(n.args) == 2 and n.args[1] == 2      # ATen and Inductor both compute x * x


def _always(n: Node) -> bool:
    return True


def _integral(x) -> bool:
    return isinstance(x, (bool, int)) or (isinstance(x, Node) and val(x) is not None
                                          and val(x).dtype in INT + BOOL)


def _integer_bounds(n: Node) -> bool:
    """``clamp`` of an integer tensor by integer bounds: a min and a max, nothing rounded."""
    bounds = list(n.args[1:]) + [n.kwargs.get(k) for k in ("min", "max")]
    return all(b is None or (not isinstance(b, Node) and _integral(b)) for b in bounds)


def _integer_fill(n: Node) -> bool:
    """An integer or boolean fill whose every reader that may share its region -- and theirs,
    through any op that may fuse -- takes only integer or boolean tensors and makes one. Inductor
    carries a uniform value through the pointwise ops it feeds (``clamp(full(0), 0, 5)`` is still
    zeros) and then drops ``x + zeros`` and ``x * ones``: exact on integers, not on floats
    (``-0.0 + 0`` is ``+0.0``, NaN * 1 may lose its payload)."""
    like = val(n.args[0]) if n.args and isinstance(n.args[0], Node) else None
    if like is None or len(n.args) != 2 or not _integral(n.args[1]):
        return False
    same = {"dtype": (None, like.dtype), "device": (None, like.device), "pin_memory": (None, False),
            "layout": (None, torch.strided), "memory_format": (None, torch.preserve_format)}
    if any(k not in same or v not in same[k] for k, v in n.kwargs.items()):
        return False

    seen, todo = set(), [n]
    while todo:
        for u in todo.pop().users:
            if u in seen or u.op != "call_function" or \
                    (u.target not in EXACT_OPS and u.target not in VIEWS):
                continue     # a stock op (or the output): the value reaches it materialized
            if not all(_integral(a) for a in u.all_input_nodes) or any(
                    not isinstance(v, torch.Tensor) or v.dtype not in INT + BOOL for v in _values(u)):
                return False
            seen.add(u)
            todo.append(u)
    return True


# op -> (the input dtypes it may fuse on, when it may fuse). Why each fused form is the stock
# arithmetic: integers, comparisons, selects and copies have no rounding; add, sub, mul and div_rn
# are one correctly rounded IEEE operation per element (and the fused code contracts nothing into
# an FMA); the transcendental ones compute the same formula through the same libdevice routine as
# ATen's kernel (each is checked against ATen on the device over edge inputs, per dtype).
_ARITH, _ANY = FLOAT + INT, DTYPES
EXACT_OPS: Dict[torch._ops.OpOverload, Tuple[tuple, Callable[[Node], bool]]] = {
    aten.add.Tensor: (_ARITH, _unit_alpha), aten.sub.Tensor: (_ARITH, _unit_alpha),
    aten.mul.Tensor: (_ARITH, _no_unit), aten.div.Tensor: (FLOAT, _divisor),
    aten.cat.default: (_ANY, _always), aten.stack.default: (_ANY, _always),   # copies
    aten.clone.default: (_ANY, lambda n: n.kwargs in ({}, {"memory_format": torch.contiguous_format})),
    aten.remainder.Scalar: (INT, lambda n: n.args[1] != 0),   # Python's modulo on both sides
    aten.pow.Tensor_Scalar: (FLOAT, _square),
    aten.clamp.default: (INT, _integer_bounds),        # -0 against +0 in floats: those stay stock
    aten.full_like.default: (INT + BOOL, _integer_fill),
    aten.where.self: (_ANY, _always),
    **{getattr(getattr(aten, c), k): (_ANY, _always)
       for c in ("eq", "ne", "lt", "le", "gt", "ge") for k in ("Tensor", "Scalar")},
    aten.logical_not.default: (_ANY, _always), aten.logical_and.default: (_ANY, _always),
    aten.logical_or.default: (_ANY, _always),
    aten.__and__.Tensor: (INT + BOOL, _always), aten.__or__.Tensor: (INT + BOOL, _always),
    aten.bitwise_and.Tensor: (INT + BOOL, _always), aten.bitwise_or.Tensor: (INT + BOOL, _always),
    aten._to_copy.default: (_ANY, _cast), aten.to.dtype: (_ANY, _cast),
    aten.to.device: (_ANY, _cast),
    aten.exp.default: (FLOAT, _always), aten.tanh.default: (FLOAT, _always),
    aten.sin.default: (FLOAT, _always), aten.cos.default: (FLOAT, _always),
    aten.sqrt.default: (FLOAT, _always), aten.rsqrt.default: (FLOAT, _always),
    aten.silu.default: (FLOAT, _always),
}
# views, and ops that are views at inference: no kernel of their own (a reshape that must copy is
# a copy, exact either way); inside a region only. Ops with several outputs (unbind, chunk,
# split) are views read through ``getitem``.
MULTI_VIEWS = {aten.unbind.int, aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.expand.default, aten.permute.default, aten.t.default,
         aten.transpose.int, aten.select.int, aten.slice.Tensor, aten.alias.default,
         aten.dropout.default, aten.to.dtype, aten.to.device, operator.getitem, *MULTI_VIEWS}
_VIEW_RULES = {aten.dropout.default: lambda n: len(n.args) > 2 and n.args[2] is False,
               aten.to.dtype: _same_dtype_to, aten.to.device: _same_dtype_to,
               operator.getitem: lambda n: isinstance(n.args[0], Node) and n.args[0].target in MULTI_VIEWS}


def _values(node: Node) -> list:
    """The tensors a node makes (several for ``unbind``, ``chunk``, ``split``)."""
    v = node.meta.get("val")
    return list(v) if node.target in MULTI_VIEWS and isinstance(v, (list, tuple)) else [val(node)]


def fusible(node: Node, device: Optional[str] = None) -> bool:
    """Whether ``node`` may be part of a fused region: a kernel of ``EXACT_OPS`` or a view, all
    its values on one device (of type ``device``, the step's, when given: host-side work in a
    device step stays stock, and eager)."""
    if node.op != "call_function" or (node.target not in EXACT_OPS and node.target not in VIEWS):
        return False
    outs = _values(node)
    if not outs or any(not isinstance(v, torch.Tensor) or v.dtype not in DTYPES for v in outs):
        return False
    if device is not None and outs[0].device.type != device:
        return False
    ins = [v for a in node.all_input_nodes for v in _values(a)]
    if any(not isinstance(v, torch.Tensor) or v.dtype not in DTYPES or v.device != outs[0].device
           for v in ins):
        return False
    return is_kernel(node) or (node.target in VIEWS and _VIEW_RULES.get(node.target, _always)(node))


def is_kernel(node: Node) -> bool:
    """A fusible op of ``EXACT_OPS`` on dtypes it is exact for (a fusible node that is not one is
    a view)."""
    entry = EXACT_OPS.get(node.target)
    if entry is None:
        return False
    kinds, rule = entry
    operands = node.all_input_nodes[1:] if node.target is aten.where.self else node.all_input_nodes
    return all(val(a).dtype in kinds for a in operands) and rule(node)


def fuse_exact(gm: GraphModule, ctx: PassContext) -> PassResult:
    records = ctx.records.setdefault("fusion", {"regions": [], "skipped": None})
    device = step_device(gm).type
    if device not in fusion.DEVICES:
        records["skipped"] = (f"fusion is for device steps ({', '.join(fusion.DEVICES)}); this step "
                              f"runs on {device}")
        return PassResult(gm, False)
    runs = regions_in_order(gm.graph, device)
    counters = getattr(ctx, "counters", None)
    made = 0
    records["writes_absorbed"] = 0
    for run in runs:
        while run and not _launches(run[-1]):    # a run ends on a kernel (or its write)
            run.pop()
        kernels = [n for n in run if _launches(n)]
        if len(kernels) < MIN_KERNELS:
            continue
        name = f"fused_{made}"
        writes = _replace(gm, run, name, counters)
        records["regions"].append({"name": name, "kernels": len(kernels),
                                   "ops": sorted({n.target.__name__ for n in kernels}),
                                   "writes": writes})
        records["writes_absorbed"] += writes
        made += 1
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


def _replace(gm: GraphModule, run: List[Node], name: str, counters) -> int:
    """The run as one call of a ``FusedRegion``; returns how many writes it took over (0 or 1)."""
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
    values = [val(a) for a in inputs]
    layout = fusion.input_layout(values) if all(isinstance(v, torch.Tensor) for v in values) else None
    gm.add_submodule(name, FusedRegion(stock, name, [str(n.target) for n in run if _launches(n)],
                                       counters, writes=writes, layout=layout))
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

