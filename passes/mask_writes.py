"""Masked writes without a host sync: ``x[mask] = v`` with a boolean mask and one value becomes a
select on the device. Case handled -- Moshi's ``LMGen._step`` blanks the batch rows that are not
generating yet::

    out[mask, :, :] = ungenerated_token_id                              # stock code
    index_put_(out, [mask], v)             # before: nonzero(mask) on the host, then a scatter
    copy_(out, where(reshape(mask, [B, 1, 1]), v, out))                  # after: two kernels

Indexing with a boolean mask turns the mask into indices with ``nonzero``, which waits for the
device and has a data-dependent size: the shape-enumeration pass must leave it eager, splitting
the graph around it. The select writes the same bits to the same elements: every element under the
mask gets ``v`` (same dtype, nothing computed), every other element keeps its own. So it is exact
for every dtype, NaN payloads included.

Rewritten: ``index_put_`` / ``index_put`` without ``accumulate``, whose indices are one boolean mask
(after any number of leading ``None``, i.e. full slices) covering exactly the dims it stands for,
and whose value holds one element of the target's dtype, on the target's device or a constant
(``x[mask] = 5`` on the device writes a host literal: it is copied to the device once, at compile
time). Everything else is left as it is.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .fx_utils import aten, attr_value, val

__all__ = ["mask_writes", "mask_of"]

_PUT = {aten.index_put_.default: True, aten.index_put.default: False}


def mask_of(node: Node) -> Optional[List[int]]:
    """The shape the mask is reshaped to so that it broadcasts over the target, when ``node`` is a
    masked write this pass rewrites; None otherwise."""
    if node.op != "call_function" or node.target not in _PUT:
        return None
    x, indices, value = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or not isinstance(indices, (list, tuple)):
        return None
    lead = 0
    while lead < len(indices) and indices[lead] is None:
        lead += 1
    if lead != len(indices) - 1 or not isinstance(indices[lead], Node):
        return None
    xv, mv, vv = val(x), val(indices[lead]), val(value) if isinstance(value, Node) else None
    if xv is None or mv is None or vv is None or mv.dtype != torch.bool:
        return None
    if vv.numel() != 1 or vv.dtype != xv.dtype:
        return None
    if vv.device != xv.device and not (vv.dim() == 0 and _constant(value)):
        return None   # a host value that may change between calls: a replay would keep the first
    if tuple(xv.shape[lead:lead + mv.dim()]) != tuple(mv.shape):
        return None
    return [1] * lead + list(mv.shape) + [1] * (xv.dim() - lead - mv.dim())


def _constant(node: Node) -> bool:
    """A constant ``hoist_constants`` made (from a literal of the step's code or a tensor the
    adapter declares constant): the same value on every call. Any other tensor attribute the
    trace captured is module state, which may change between calls."""
    return node.op == "get_attr" and node.target.startswith("_cadence_const_")


def mask_writes(gm: GraphModule, ctx: PassContext) -> PassResult:
    rewritten = 0
    for n in list(gm.graph.nodes):
        shape = mask_of(n)
        if shape is None:
            continue
        x, indices, value = n.args[:3]
        mask = indices[-1]
        if val(value).device != val(x).device:
            # ``x[mask] = 5`` on the device: the literal is a host tensor; a copy of it on the
            # device, made once (the select reads it there, so a replay needs no host value)
            name = f"_cadence_mask_value_{rewritten}_{n.name}"
            gm.register_buffer(name, attr_value(gm, value.target).to(val(x).device), persistent=False)
            with gm.graph.inserting_before(n):
                moved = gm.graph.get_attr(name)
            moved.meta["val"] = val(value).to(val(x).device)
            value = moved
        with gm.graph.inserting_before(n):
            m = gm.graph.call_function(aten.reshape.default, (mask, shape))
            v = value
            if val(value).dim() != 0:
                v = gm.graph.call_function(aten.reshape.default, (value, []))
                v.meta["val"] = val(value).reshape(())
            w = gm.graph.call_function(aten.where.self, (m, v, x))
            out = gm.graph.call_function(aten.copy_.default, (x, w)) if _PUT[n.target] else w
        m.meta["val"] = val(mask).reshape(shape)
        w.meta["val"] = val(x).clone() if _PUT[n.target] else val(n)
        out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        ctx.note("mask_write", mask.name,
                 f"{n.name}: {x.name}[{'..., ' * (len(indices) - 1)}{mask.name}] = {value.name} "
                 f"as a select (no nonzero, no host sync)")
        rewritten += 1
    return PassResult(gm, rewritten > 0)
