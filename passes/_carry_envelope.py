"""The envelope rewrite of the carry pass: an over-sized stock buffer becomes the carry.

    buf[step][..., :n] = new          ->   C[step][..., :n] = new
    return buf[..., :n]                    return C[..., :n]

The buffer placeholder is replaced by ``C``, allocated at the declared extent. Every access must fit
the carry; reads past it are allowed only on rows the step never writes and that hold zeros.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.fx import GraphModule, Node

from .context import PassContext, RegionBinding
from .fx_utils import aten, is_mutating, mutated_arg, slice_bounds, storage_key, val

from ._carry_graph import propagate_meta

__all__ = ["replace_envelope"]


def replace_envelope(gm: GraphModule, ctx: PassContext, b: RegionBinding, state_base: Node) -> None:
    """Substitute the carry for the over-sized stock buffer ``state_base`` when the new state is a
    view of it and every access fits the carry; otherwise record a near miss with the reason."""
    base = state_base
    placeholders = ctx.placeholders(gm)
    if base.op != "placeholder" or base not in placeholders:
        return
    spec = ctx.inputs[placeholders.index(base)]
    if spec.kind != "buffer":
        return
    reason = _envelope_fits(base, b, ctx.module_buffers.get(spec.name))
    if reason:
        ctx.note("near_miss", b.region.name, f"envelope {spec.name}: {reason}")
        return
    users = list(base.users)
    b.storages.add(storage_key(base))
    base.replace_all_uses_with(b.carry_node)
    env = tuple(val(base).shape)
    if env != tuple(b.carry.tensor.shape):
        try:
            propagate_meta(gm, b.carry_node)
        except Exception as e:  # noqa: BLE001 - a shape the shrunken envelope cannot give
            for u in users:
                u.replace_input_with(b.carry_node, base)
            propagate_meta(gm, base)
            ctx.note("near_miss", b.region.name, f"envelope {spec.name}: the step's shapes do not "
                     f"follow the declared extent ({type(e).__name__}: {e})")
            return
    ctx.note("envelope", b.region.name,
             f"{spec.name} {tuple(env)} -> carry {tuple(b.carry.tensor.shape)}")


def _envelope_fits(buf: Node, b: RegionBinding, real: Optional[torch.Tensor]) -> Optional[str]:
    """Check every access to the envelope fits the carry; returns the reason it does not."""
    carry = tuple(b.carry.tensor.shape)
    env = tuple(val(buf).shape)
    if len(env) != len(carry):
        return f"rank {len(env)} differs from the declared rank {len(carry)}"
    boxes: List[Tuple[str, list]] = []
    stack = [(buf, [(0, s) for s in env], list(range(len(env))))]
    while stack:
        node, box, dims = stack.pop()
        for u in node.users:
            if u.op == "call_function" and u.target is aten.slice.Tensor and u.args[0] is node:
                bounds = slice_bounds(u, box[dims[u.args[1]]][1] - box[dims[u.args[1]]][0])
                if bounds is None:
                    return f"{u.name} takes a strided slice of it"
                dim, start, stop = bounds
                nb = list(box)
                lo = box[dims[dim]][0]
                nb[dims[dim]] = (lo + start, lo + stop)
                stack.append((u, nb, dims))
            elif u.op == "call_function" and u.target is aten.select.int and u.args[0] is node:
                dim, idx = u.args[1], u.args[2]
                lo, hi = box[dims[dim]]
                idx = idx + (hi - lo) if idx < 0 else idx
                nb = list(box)
                nb[dims[dim]] = (lo + idx, lo + idx + 1)
                stack.append((u, nb, dims[:dim] + dims[dim + 1:]))
            elif is_mutating(u) and mutated_arg(u) is node:
                boxes.append(("write", box))
            elif is_mutating(u):
                boxes.append(("read", box))
            else:
                boxes.append(("read", box))
    for kind, box in boxes:
        for i, (lo, hi) in enumerate(box):
            if hi <= carry[i]:
                continue
            if kind == "write" or i == b.region.dim:
                return (f"the step {kind}s [{lo}, {hi}) of dim {i}, beyond the declared "
                        f"{carry[i]}; declare a larger extent or fix the clocks")
            if real is None or real.narrow(i, carry[i], env[i] - carry[i]).count_nonzero().item():
                return (f"the step reads rows [{carry[i]}, {hi}) of dim {i} that are not declared "
                        "and not known to be zero")
    return None
