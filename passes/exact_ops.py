"""The ops a fused region may hold and the devices it is made on: ``EXACT_OPS`` (each op with the
input dtypes and the rule under which its fused form is ATen's arithmetic), ``VIEWS`` (no kernel
of their own), ``fusible`` and ``is_kernel`` (a node's verdict), and ``DEVICES``. Why each op is
in or out is said where regions are made, in ``passes/fuse_exact.py``; each op is checked against
ATen's kernel on the device over edge inputs, per dtype (tests/test_fuse_exact.py).
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from .fx_utils import aten, step_device, val

__all__ = ["DEVICES", "fusion_device", "EXACT_OPS", "VIEWS", "MULTI_VIEWS", "FLOAT", "INT", "BOOL",
           "DTYPES", "fusible", "is_kernel", "reciprocal"]

# where ``fuse_exact`` makes regions, and the rewrites of ``fusion_prep.py`` prepare them: on the
# CPU, Inductor's C++ is not held to the stock numerics (tests open it to the CPU: ``fuse_on_cpu``)
DEVICES = ("cuda",)


def fusion_device(gm: GraphModule) -> Optional[str]:
    """The step's device type where fusion runs on it (``DEVICES``), else None."""
    device = step_device(gm).type
    return device if device in DEVICES else None


# the dtypes the op test covers on the device (the models' own): fp16 and int32 are left out
FLOAT = (torch.float32, torch.bfloat16)
INT = (torch.int64,)
BOOL = (torch.bool,)
DTYPES = FLOAT + INT + BOOL


def _unit_alpha(n: Node) -> bool:
    return n.kwargs.get("alpha", 1) == 1 and len(n.args) <= 2 and not _identity(n, 0)


def _identity(n: Node, *units) -> bool:
    """A literal operand Inductor or the device compiler folds: ``x + 0`` and ``x * 1`` are
    dropped, ``x * 0`` becomes zeros, ``x * -1`` a sign flip. ATen computes them: -0 + 0 is +0,
    NaN * 0 is NaN, and the device's multiply makes a NaN canonical where a sign flip keeps it."""
    return any(not isinstance(a, Node) and a in units for a in n.args)


def _no_unit(n: Node) -> bool:
    return not _identity(n, 0, 1, -1)


def reciprocal(b) -> float:
    """``1 / b`` as ATen's CUDA division kernel makes it for a Python number: in fp32, the opmath
    type of fp32, bf16 and fp16 tensors."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(b), dtype=torch.float32))


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
    return reciprocal(d) not in (0.0, 1.0, -1.0)    # a product the compiler would fold


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
