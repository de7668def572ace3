"""Graph helpers shared by the carry pass and its rewrites (``passes/carry_retention.py``):
output values, carry views and copies, and recomputing fake values after a storage changes."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from .context import RegionBinding
from .fx_utils import aten, slice_bounds, val, view_chain

__all__ = ["output_node", "fake_mode", "out_values", "set_out_value", "slice_", "carry_offset",
           "copy_", "propagate_meta"]


def output_node(gm: GraphModule) -> Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def fake_mode(gm: GraphModule):
    for n in gm.graph.nodes:
        v = val(n)
        if v is not None and hasattr(v, "fake_mode"):
            return v.fake_mode
    raise ValueError("the traced graph carries no fake values; trace with tracing_mode='fake'")


def out_values(out: Node) -> list:
    return list(out.args[0])


def set_out_value(out: Node, i: int, node: Node) -> None:
    values = out_values(out)
    values[i] = node
    out.args = (type(out.args[0])(values),) + tuple(out.args[1:])


def slice_(gm, src: Node, dim: int, start: int, stop: int) -> Node:
    return gm.graph.call_function(aten.slice.Tensor, (src, dim, start, stop))


def carry_offset(node: Node, b: RegionBinding, frames: int) -> Optional[bool]:
    """True if ``node`` is ``C[:frames]`` (leading, full on other dims), False if it touches C some
    other way, None if it does not read C at all."""
    base, chain = view_chain(node)
    if base is not b.carry_node:
        return None
    shape = list(b.carry.tensor.shape)
    for v in chain:
        if v.target is not aten.slice.Tensor:
            return False
        bounds = slice_bounds(v, shape[v.args[1]])
        if bounds is None or bounds[1] != 0:
            return False
        dim, start, stop = bounds
        shape[dim] = stop
    want = list(b.carry.tensor.shape)
    want[b.region.dim] = frames
    return shape == want


def copy_(gm, dst: Node, src: Node) -> Node:
    node = gm.graph.call_function(aten.copy_.default, (dst, src))
    if "val" in dst.meta:
        node.meta["val"] = dst.meta["val"]   # copy_ returns its destination
    return node


def propagate_meta(gm: GraphModule, changed: Node) -> None:
    """Recompute the fake values downstream of ``changed``, whose storage changed (an envelope
    shrank to the carry, a concatenation became a view of it).

    Propagation stops at a node whose recomputed value is a fresh tensor (not a view of a changed
    storage) with the same shape, strides and dtype as before: nothing downstream of it can see
    the change. In a DiT step that is every compute op reading the cache, so only the view
    chains are recomputed, not the whole graph."""
    dirty = {changed}
    storages = set(_storage_keys(val(changed)))
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(a in dirty for a in node.all_input_nodes):
            continue
        old = node.meta.get("val")
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        mode = val(changed).fake_mode
        if node.target in _ON_META:
            new = _on_meta(node.target, args, kwargs, mode)
        else:
            with mode:
                new = node.target(*args, **kwargs)
        node.meta["val"] = new
        aliased = set(_storage_keys(new)) & storages
        if not aliased and _same_layout(old, new):
            continue
        dirty.add(node)
        storages.update(_storage_keys(new))


# Ops recomputed straight on the meta tensors under the fakes, then wrapped as fakes: the meta
# kernels fake mode would run, without its dispatch and cache (about a millisecond an op on this
# path; the two CFM cache envelopes reach some 2,000 such views, cats and splits).
_ON_META = {aten.cat.default, aten.select.int, aten.slice.Tensor, aten.chunk.default,
            aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default,
            aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default,
            aten.transpose.int, aten.expand.default, aten.alias.default, aten.t.default}


def _on_meta(op, args, kwargs, mode):
    device = next(t.fake_device for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, FakeTensor))
    with in_kernel_invocation_manager(mode), torch._C.DisableTorchFunction():
        out = op(*args, **kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda t: FakeTensor(mode, t, device), out)


def _storage_keys(v) -> List[object]:
    return [StorageWeakRef(t.untyped_storage()) for t in pytree.tree_leaves(v)
            if isinstance(t, torch.Tensor)]


def _same_layout(old, new) -> bool:
    """Same pytree of tensors with the same shape, strides, offset and dtype (values equal)."""
    a, sa = pytree.tree_flatten(old)
    b, sb = pytree.tree_flatten(new)
    if sa != sb:
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if (x.shape != y.shape or x.stride() != y.stride() or x.dtype != y.dtype
                    or x.storage_offset() != y.storage_offset()):
                return False
        elif x != y:
            return False
    return True
