"""The window rewrite of the carry pass: a sliding window kept by concatenation becomes in-place
writes on the carry, with no concatenation left.

Append order (most KV caches and conv contexts), ``C`` the carry, ``x`` the call's ``c`` frames::

    full = cat([C[:l], x], d)                C[l:l+c] = x             (into the carry's room)
    state = full[..., s:s+n]       ->        full = C[:l+c]           (a view; readers read it)
    ...readers of full, state...             state = C[s:s+n]
    return state                             C[:n] = C[s:s+n]         (last, split low to high)

When nothing but the window reads the concatenation (attention over a K/V window), the kept old
frames move down first, at the concatenation's place, and ``x`` is written after them: the
window is ``C[:n]`` before anyone reads it, and nothing moves last (one copy fewer)::

    k = cat([C[:l], x], d)[..., -n:]   ->   C[:l-s] = C[s:l]; C[l-s:n] = x; k = C[:n]

Prepend order, ``cat([x, C[:l]], d)[..., :n]``: at the concatenation's place the old frames move
up by ``c`` (split high to low) and ``x`` is written at ``C[:c]``; every other read of the old
state must come before it. The window may be taken with ``slice`` (``[..., -W:]``), ``narrow``, or
one part of ``split``/``chunk``, through ``clone``/``detach``; an unconditional slice that keeps
everything while the window fills leaves the state at ``C[:l+c]`` and nothing moves. The carry
needs ``l + c`` frames: the catalog gives sliding windows one call of room.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional, Union

from torch.fx import GraphModule, Node

from cadence_fx.contract import APPEND, PREPEND
from .context import RegionBinding
from .fx_utils import (CATS, aten, is_mutating, mutated_arg, slice_bounds, storage_key,
                                 val)

from ._carry_graph import carry_offset, copy_, propagate_meta

__all__ = ["Window", "find_window", "window_of", "rewrite_window", "move", "frame_range",
           "split_sizes", "SPLITS", "LAYOUT_READS"]

# Ops whose result depends on their input's strides and storage offset, not only its values: on
# a carry view (the carry's strides) they would read other elements than on the concatenation.
LAYOUT_READS = {getattr(aten, name).default
                for name in ("as_strided", "as_strided_", "as_strided_scatter", "_reshape_alias")
                if hasattr(aten, name)}

PIECES_BEFORE_TEMPORARY = 2   # a longer overlapping move goes through one temporary (two copies)
_THROUGH = {aten.clone.default, aten.detach.default, aten.alias.default}
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default}


@dataclasses.dataclass
class Window:
    cat: Node
    new: Node       # the call's frames x
    held: int       # l: frames of the old state
    added: int      # c: frames the call adds
    start: int      # the window [start, stop) in the concatenation's frames
    stop: int
    order: str      # APPEND: cat([C[:l], x]); PREPEND: cat([x, C[:l]])
    taken: tuple = ()   # the window as the stock code takes it, for the report


def find_window(b: RegionBinding, state: Node) -> Union[Window, str]:
    """The window ``state`` takes of a concatenation of the old state and new frames, or why it
    is not one (for the report)."""
    found = frame_range(state, b.region.dim)
    if found is None:
        return "the new state is not a window of a concatenation along the frame dim"
    return window_of(b, *found)


def window_of(b: RegionBinding, cat: Node, start: int, stop: int,
              is_old: Optional[Callable[[Node, int], bool]] = None) -> Union[Window, str]:
    """Frames ``[start, stop)`` of ``cat`` as a window of the old state and new frames, or why
    not. ``is_old(part, frames)`` tells the old state ``C[:frames]`` (by default a leading view
    of ``b``'s carry)."""
    d = b.region.dim
    parts = cat.args[0]
    if len(parts) != 2 or any(val(p) is None for p in parts):
        return f"{cat.name} joins {len(parts)} tensors, not the old state and the new frames"
    if is_old is None:
        is_old = lambda p, frames: carry_offset(p, b, frames) is True  # noqa: E731
    old = [is_old(p, val(p).shape[d]) for p in parts]
    if old == [True, False]:
        order, held, new = APPEND, parts[0], parts[1]
    elif old == [False, True]:
        order, held, new = PREPEND, parts[1], parts[0]
    else:
        return f"{cat.name} does not join the old state C[:l] with new frames"
    if storage_key(new) in b.storages:
        return f"{cat.name}'s new frames {new.name} are a view of the carry"
    if order != b.region.ordering:
        return (f"{cat.name} {order}s the new frames, but the region declares ordering="
                f"{b.region.ordering!r}")
    l, c = val(held).shape[d], val(new).shape[d]
    if order == PREPEND and start != 0:
        return f"the prepend window starts at frame {start}, not 0"
    return Window(cat, new, l, c, start, stop, order, (start, stop))


def _cat_read_as_itself(gm: GraphModule, w: Window) -> Optional[str]:
    """Why the concatenation cannot become a view of the carry: a node writes it in place, or
    reads it at its own strides; None when nothing does."""
    cat_storage = storage_key(w.cat)
    if cat_storage is None:
        return None
    for n in gm.graph.nodes:
        written = storage_key(mutated_arg(n)) if is_mutating(n) else None
        if written is not None and written == cat_storage:
            return f"{n.name} writes the concatenation in place"
        if (n.op == "call_function" and n.target in LAYOUT_READS
                and storage_key(n.args[0]) == cat_storage):
            return (f"{n.name} reads the concatenation through {n.target.overloadpacket.__name__} at its own "
                    "strides, which a view of the carry does not have")
    return None


def _old_state_read_after(gm: GraphModule, b: RegionBinding, w: Window) -> Optional[Node]:
    """The first node after the concatenation that reads the old state (the output too: a result
    that is the old state would be copied after the move). The old frames move at the
    concatenation's place, so nothing may read them after it."""
    after = False
    for n in gm.graph.nodes:
        if n is w.cat:
            after = True
        elif after and any(_key_in(storage_key(a), b.storages) for a in n.all_input_nodes):
            return n
    return None


def rewrite_window(gm: GraphModule, b: RegionBinding, w: Window, keep_stock: bool):
    """Rewrite ``w`` in place. Returns ``(state, stock)``: the new state as a carry view
    ``C[start:stop]`` (placed before the output), and the stock value for the audit when
    ``keep_stock`` (else None); or a string, the reason it cannot be done (the graph unchanged)."""
    d, E = b.region.dim, b.carry.extent
    l, c = w.held, w.added
    why = _cat_read_as_itself(gm, w)
    if why is not None:
        return why
    window_node = _window_node(w, d) if w.order == APPEND else None
    move_first = (window_node is not None and w.stop == l + c and w.start <= l)
    if w.order == PREPEND or move_first:
        late = _old_state_read_after(gm, b, w)
        if late is not None and w.order == PREPEND:
            return f"{late.name} reads the old state after {w.cat.name} prepends to it"
        move_first = move_first and late is None
    if l + c > E and not move_first:
        return (f"{w.cat.name} holds {l + c} frames before the window drops any, but the carry "
                f"holds {E}; give the region `room` for a call's frames ({l + c - E} more)")
    saved = {n: n.meta.get("val") for n in gm.graph.nodes}
    added = []
    with gm.graph.inserting_before(w.cat.next):
        if move_first:      # only the window is read: keep it at C[:n] before anyone reads it
            move(gm, b, w.start, 0, l - w.start, added)
            added.append(copy_(gm, _view(gm, b, l - w.start, w.stop - w.start, added), w.new))
            full = _view(gm, b, 0, w.stop - w.start, added)
        elif w.order == APPEND:
            added.append(copy_(gm, _view(gm, b, l, l + c, added), w.new))
            full = _view(gm, b, 0, l + c, added)
        else:
            move(gm, b, 0, c, l, added)
            added.append(copy_(gm, _view(gm, b, 0, c, added), w.new))
            full = _view(gm, b, 0, l + c, added)
    replaced = window_node if move_first else w.cat
    users = list(replaced.users)
    replaced.replace_all_uses_with(full)
    try:
        propagate_meta(gm, full)
    except Exception as e:  # noqa: BLE001 - a reader that needs the concatenation's own layout
        for u in users:
            u.replace_input_with(full, replaced)
        for n in reversed(added):
            gm.graph.erase_node(n)
        for n, v in saved.items():
            n.meta["val"] = v
        return f"a reader cannot take a view of the carry ({type(e).__name__}: {e})"
    stock = None
    if keep_stock:
        with gm.graph.inserting_before(full.next):
            stock = _slice_of(gm, w.cat, d, w.start, w.stop)
    if move_first:
        w.start, w.stop = 0, w.stop - w.start   # the window now sits at C[:n]: nothing moves last
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    with gm.graph.inserting_before(out):
        state = _view(gm, b, w.start, w.stop, [])
    return state, stock


def move(gm: GraphModule, b: RegionBinding, src: int, dst: int, n: int, added=None) -> None:
    """``C[dst:dst+n] = C[src:src+n]`` along the frame dim, exact where the ranges overlap: split
    into pieces no longer than the distance, copied low to high (down) or high to low (up); when
    that takes more than two pieces, through one temporary instead (two copies)."""
    dist = abs(src - dst)
    if dist == 0 or n == 0:
        return
    step = min(dist, n)
    starts = list(range(0, n, step))
    if len(starts) > PIECES_BEFORE_TEMPORARY:
        source = _view(gm, b, src, src + n, added)
        tmp = gm.graph.call_function(aten.clone.default, (source,))
        if val(source) is not None:
            with val(source).fake_mode:
                tmp.meta["val"] = aten.clone.default(val(source))
        node = copy_(gm, _view(gm, b, dst, dst + n, added), tmp)
        if added is not None:
            added += [tmp, node]
        return
    for k in (starts if dst < src else reversed(starts)):
        m = min(step, n - k)
        node = copy_(gm, _view(gm, b, dst + k, dst + k + m, added),
                     _view(gm, b, src + k, src + k + m, added))
        if added is not None:
            added.append(node)


def _window_node(w: Window, d: int) -> Optional[Node]:
    """The one node that takes the window out of the concatenation, when nothing else reads the
    concatenation: a slice or narrow along ``d``, or the read part of a split."""
    if len(w.cat.users) != 1:
        return None
    (u,) = w.cat.users
    if u.target in (aten.slice.Tensor, aten.narrow.default):
        return u if frame_range(u, d) == (w.cat, w.start, w.stop) else None
    if u.target in SPLITS:
        read = [g for g in u.users if g.users]
        if len(read) == 1 and frame_range(read[0], d) == (w.cat, w.start, w.stop):
            return read[0]
    return None


def _key_in(key, keys) -> bool:
    return key is not None and key in keys


def _view(gm: GraphModule, b: RegionBinding, start: int, stop: int, added) -> Node:
    node = _slice_of(gm, b.carry_node, b.region.dim, start, stop)
    if added is not None:
        added.append(node)
    return node


def _slice_of(gm: GraphModule, src: Node, dim: int, start: int, stop: int) -> Node:
    node = gm.graph.call_function(aten.slice.Tensor, (src, dim, start, stop))
    v = val(src)
    if v is not None:
        with v.fake_mode:
            node.meta["val"] = aten.slice.Tensor(v, dim, start, stop)
    return node


def frame_range(node: Node, d: int) -> Optional[tuple]:
    """``(cat, start, stop)`` if ``node`` is frames ``[start, stop)`` of a concatenation along
    ``d``, reached through slices, narrows, split parts, clones and detaches."""
    v = val(node)
    if node.op != "call_function" or (v is None and node.target is not operator.getitem):
        return None
    t = node.target
    if t in CATS:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return (node, 0, v.shape[d]) if dim % v.dim() == d else None
    if t in _THROUGH:
        return frame_range(node.args[0], d)
    if t is aten.slice.Tensor or t is aten.narrow.default:
        src = node.args[0]
        sv = val(src)
        if sv is None:
            return None
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % sv.dim()
        if t is aten.slice.Tensor:
            bounds = slice_bounds(node, sv.shape[dim])
            if bounds is None:
                return None
            start, stop = bounds[1], bounds[2]
        else:
            start = node.args[2] % sv.shape[dim] if node.args[2] < 0 else node.args[2]
            stop = start + node.args[3]
        if dim != d:  # a slice along another dim must keep all of it
            return frame_range(src, d) if (start, stop) == (0, sv.shape[dim]) else None
        inner = frame_range(src, d)
        return None if inner is None else (inner[0], inner[1] + start, inner[1] + stop)
    if t is operator.getitem and isinstance(node.args[0], Node) and node.args[0].target in SPLITS:
        split, index = node.args[0], node.args[1]
        src = split.args[0]
        sv = val(src)
        if sv is None:
            return None
        dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % sv.dim()
        sizes = split_sizes(split, sv.shape[dim])
        if dim != d or sizes is None or not 0 <= index < len(sizes):
            return None
        inner = frame_range(src, d)
        start = sum(sizes[:index])
        return None if inner is None else (inner[0], inner[1] + start, inner[1] + start + sizes[index])
    return None


def split_sizes(split: Node, size: int) -> Optional[list]:
    arg = split.args[1]
    if split.target is aten.split_with_sizes.default:
        return list(arg)
    if split.target is aten.split.Tensor:
        return [min(arg, size - k) for k in range(0, size, arg)] if arg > 0 else None
    each = -(-size // arg) if arg > 0 else 0          # chunk: ceil(size / chunks) each
    return [min(each, size - k) for k in range(0, size, each)] if each else None
