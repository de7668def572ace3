"""Stacked windows: a new state assembled, along dims other than the frame dim, from windows of
slices of the old state -- per-layer K/V caches kept each by concatenation and stacked::

    k_i = cat([C[i, 0][:l], k_new_i], d)             C[i, 0][l:l+c] = k_new_i   (each layer)
    v_i = cat([C[i, 1][:l], v_new_i], d)     ->      C[i, 1][l:l+c] = v_new_i
    ...readers of k_i, v_i...                         ...they read C[i, j][:l+c]...
    state = stack([stack([k_i, v_i])             C[:n] = C[s:s+n]              (once, all layers)
                   for i])[..., s:s+n]

The parts may be joined with ``stack`` or with ``cat`` along another dim (``[1, ...]`` per-layer
slices catted on dim 0), nested, and the frame window taken inside or outside the join. Every part
must be the same window ``[s, s+n)`` of ``cat(C[path][:l], x)``, ``C[path]`` the carry slice the
part's position names (``select`` for a stack, a ``slice`` for a cat), read in place; each part is
then written with the window rewrite on its carry slice, and the kept frames move once for the
whole carry.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import List, Optional, Tuple, Union

from torch.fx import GraphModule, Node

from .context import RegionBinding
from .fx_utils import CATS, VIEW_OPS, aten, slice_bounds, val

from ._carry_window import (SPLITS, Window, frame_range, move, rewrite_window, split_sizes,
                            window_of)

__all__ = ["find_stacked", "rewrite_stacked", "Stacked"]

Path = Tuple[tuple, ...]   # ("select", dim, index) | ("slice", dim, start, stop), in order


@dataclasses.dataclass
class Stacked:
    parts: List[Tuple[Path, Window]]
    start: int
    stop: int
    held: int
    added: int
    order: str


def find_stacked(b: RegionBinding, state: Node) -> Union[Stacked, str, None]:
    """The windows ``state`` is assembled from, why it is not so assembled, or None when it is
    no join at all."""
    top = state
    while (top.op == "call_function" and isinstance(top.args[0], Node)
           and top.target in (aten.slice.Tensor, aten.clone.default, aten.detach.default,
                              aten.alias.default)):
        top = top.args[0]
    if not _joins(top, b.region.dim):
        return None
    leaves: List[tuple] = []
    why = _collect(state, b.region.dim, None, (), leaves)
    if why is not None:
        return why
    if len(leaves) < 2:
        return "the new state is not assembled from several windows"
    parts = []
    for path, d, cat, start, stop in leaves:
        sub = _sub_binding(b, path, d)
        if sub is None:
            return f"part {_show(path)} is not a slice of the carry along its frame dim"
        w = window_of(sub, cat, start, stop, is_old=lambda p, frames, path=path:
                      carry_path(p, b) == (path, 0, frames))
        if isinstance(w, str):
            return f"part {_show(path)}: {w}"
        parts.append((path, w))
    first = parts[0][1]
    shape = (first.start, first.stop, first.held, first.added, first.order)
    for path, w in parts[1:]:
        if (w.start, w.stop, w.held, w.added, w.order) != shape:
            return (f"part {_show(path)} keeps frames [{w.start}, {w.stop}) of {w.held} + "
                    f"{w.added}, part {_show(parts[0][0])} [{first.start}, {first.stop}) of "
                    f"{first.held} + {first.added}: not one window of the carry")
    return Stacked(parts, *shape)


def rewrite_stacked(gm: GraphModule, b: RegionBinding, s: Stacked) -> Union[int, str]:
    """Write every part on its carry slice. Returns where the window now starts in every slice
    (the caller moves the whole carry once), or why a part could not be written (the parts before
    it stay rewritten, each exact on its own: the caller then copies the state)."""
    starts = []
    for path, w in s.parts:
        sub = _sub_binding(b, path, _frame_dim(b, path), node=_sub_node(gm, b, path))
        done = rewrite_window(gm, sub, w, keep_stock=False)
        if isinstance(done, str):
            return f"part {_show(path)}: {done}"
        gm.graph.erase_node(done[0])   # the part's own state view: unused
        starts.append((sub, w.start))  # 0 where the part's window moved down at its concat
    if len({start for _, start in starts}) == 1:
        return starts[0][1]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    with gm.graph.inserting_before(out):
        for sub, start in starts:   # windows at different places: each slice moves its own
            move(gm, sub, start, 0, s.stop - s.start)
    return 0


def _frame_dim(b: RegionBinding, path: Path) -> int:
    """The frame dim of the carry slice ``C[path]``."""
    d = b.region.dim
    for op in path:
        if op[0] == "select" and op[1] < d:
            d -= 1
    return d


def carry_path(node: Node, b: RegionBinding) -> Optional[Tuple[Path, int, int]]:
    """``(path, start, stop)`` if ``node`` is ``C[path][start:stop]`` (frames along the region's
    dim; ``select``, ``slice`` and ``split`` parts along other dims make the path, slices that keep
    everything left out), else None."""
    chain = []
    while node is not b.carry_node:
        if not isinstance(node, Node) or node.op != "call_function":
            return None
        if node.target in VIEW_OPS:
            chain.append(node)
            node = node.args[0]
        elif node.target is operator.getitem and getattr(node.args[0], "target", None) in SPLITS:
            chain.append(node)
            node = node.args[0].args[0]
        else:
            return None
    shape = list(b.carry.tensor.shape)
    d, lo, hi, path = b.region.dim, 0, shape[b.region.dim], []
    for v in reversed(chain):
        if v.target is aten.slice.Tensor or v.target is operator.getitem:
            if v.target is aten.slice.Tensor:
                bounds = slice_bounds(v, shape[v.args[1] % len(shape)])
            else:
                split = v.args[0]
                dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0))
                sizes = split_sizes(split, shape[dim % len(shape)])
                bounds = None if sizes is None else \
                    (dim, sum(sizes[:v.args[1]]), sum(sizes[:v.args[1] + 1]))
            if bounds is None:
                return None
            dim, start, stop = bounds
            dim %= len(shape)
            if dim == d:
                lo, hi = lo + start, lo + stop
            elif (start, stop) != (0, shape[dim]):
                path.append(("slice", dim, start, stop))
                shape[dim] = stop - start
        elif v.target is aten.select.int:
            dim = v.args[1] % len(shape)
            if dim == d:
                return None
            path.append(("select", dim, v.args[2] % shape[dim]))
            del shape[dim]
            d -= dim < d
    return tuple(path), lo, hi


def _collect(node: Node, d: int, rng, path: Path, out: list) -> Optional[str]:
    """Walk the joins above the windows: record ``(path, d, cat, start, stop)`` per part."""
    v = val(node)
    if node.op != "call_function" or v is None:
        return f"{node} is not computed in the graph"
    t = node.target
    if (t is aten.stack.default or t in CATS) and len(node.args[0]) > 1:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim %= v.dim()
        if dim != d:
            offset = 0
            for i, p in enumerate(node.args[0]):
                if t is aten.stack.default:
                    why = _collect(p, d - (dim < d), rng, path + (("select", dim, i),), out)
                else:
                    size = val(p).shape[dim]
                    why = _collect(p, d, rng, path + (("slice", dim, offset, offset + size),), out)
                    offset += size
                if why is not None:
                    return why
            return None
    if t is aten.slice.Tensor and isinstance(node.args[0], Node) and val(node.args[0]) is not None:
        src = node.args[0]
        bounds = slice_bounds(node, val(src).shape[node.args[1] % v.dim()])
        if bounds is not None and bounds[0] % v.dim() == d and _joins(src, d):
            start, stop = bounds[1], bounds[2]
            if rng is not None:
                start, stop = start + rng[0], start + rng[1]
            return _collect(src, d, (start, stop), path, out)
    found = frame_range(node, d)
    if found is None:
        return f"{node.name} is neither a join of windows nor a window of a concatenation"
    cat, start, stop = found
    if rng is not None:
        start, stop = start + rng[0], start + rng[1]
    out.append((path, d, cat, start, stop))
    return None


def _joins(node: Node, d: int) -> bool:
    """Whether ``node`` joins parts along a dim other than the frame dim ``d``."""
    if node.op != "call_function" or not (node.target is aten.stack.default
                                          or node.target in CATS) or val(node) is None:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim % val(node).dim() != d


def _sub_binding(b: RegionBinding, path: Path, d: int, node: Optional[Node] = None):
    """The binding of the carry slice ``C[path]`` (frame dim ``d``): what the window rewrite reads."""
    tensor = b.carry.tensor
    for op in path:
        tensor = (tensor.select(op[1], op[2]) if op[0] == "select"
                  else tensor.narrow(op[1], op[2], op[3] - op[2]))
    if tensor.dim() <= d:
        return None
    return RegionBinding(dataclasses.replace(b.region, dim=d), None, None,
                         _SubCarry(tensor, b.carry.extent),
                         node if node is not None else b.carry_node, b.storages)


@dataclasses.dataclass
class _SubCarry:
    tensor: object
    extent: int


def _sub_node(gm: GraphModule, b: RegionBinding, path: Path) -> Node:
    """``C[path]`` as a node right after the carry's placeholder."""
    node, value = b.carry_node, val(b.carry_node)
    at = b.carry_node
    for op in path:
        with gm.graph.inserting_after(at):
            if op[0] == "select":
                node = gm.graph.call_function(aten.select.int, (node, op[1], op[2]))
                value = value.select(op[1], op[2]) if value is not None else None
            else:
                node = gm.graph.call_function(aten.slice.Tensor, (node, op[1], op[2], op[3]))
                value = value[(slice(None),) * op[1] + (slice(op[2], op[3]),)] \
                    if value is not None else None
        if value is not None:
            node.meta["val"] = value
        at = node
    return node


def _show(path: Path) -> str:
    return "[" + ", ".join(f"{op[2]}" if op[0] == "select" else f"{op[2]}:{op[3]}"
                           for op in path) + "]"
