"""The prompt-retained join of the carry pass: a cache grown by concatenation, then cut to its
first and last frames (eq. 3), written in place on the carry with the frames that stay where
they are (the prompt) never copied.

Append order, ``C`` the carry, ``x`` the call's ``c`` frames, ``L = l + c > P + R``::

    X = cat([C[:l], x], d)                          C[P:P+R-c] = C[L-R:l]   (down, at the end)
    state = cat([X[:P], X[L-R:L]], d)       ->      C[P+R-c:P+R] = x
    return state                                    state = C[:P+R]

when nothing but the cut reads ``X`` (no room needed). When something else reads ``X``
(attention over the prompt, the history and the new frames), the window rewrite makes ``X``
the carry view ``C[:L]`` (``x`` goes into the carry's room) and the cut moves the last ``R``
frames down to ``C[P:P+R]``. Either way ``C[:P]`` is never written.

Prepend order, ``X = cat([x, C[:l]])`` cut to ``cat([X[:R], X[L-P:L]])`` (the newest frames,
then the prompt at the end), when nothing but the cut reads ``X``::

    C[R:R+P] = C[l-P:l]     (nothing when l = R + P: the prompt stays where it is)
    C[c:R] = C[:R-c]        (up, split high to low)
    C[:c] = x

Read by anything else, ``X`` stays a temporary (a view of the carry would move every old frame
by ``c``, the prompt with them) and the kept frames are copied from it, except those already in
place; a near miss says why. So it is in append order when the carry has no room for ``x``
(the near miss names the room it needs).

Needs ``meta["val"]``. Invariant: the carry ends with the stock cut's bits; every write comes
after every read of the old state, unless the window rewrite placed it (it checks that).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

from torch.fx import GraphModule, Node

from cadence_fx.contract import APPEND
from .context import RegionBinding
from .fx_utils import CATS, aten, is_mutating, mutated_arg, slice_bounds, storage_key, val

from ._carry_graph import copy_, slice_
from ._carry_window import Window, move, rewrite_window, window_of

__all__ = ["Join", "cut_of", "cut_source", "find_join", "prepare_join", "write_join"]


@dataclasses.dataclass
class Join:
    window: Window   # X as the window [0, L) of the old state and the new frames
    cut: Node        # cat([X[:head], X[L-tail:L]])
    head: int
    tail: int
    how: str = ""    # "moved" (only the cut reads X), "view" (X is C[:L]) or "temporary"
    why: str = ""    # why X stays a temporary


def cut_source(node: Node) -> Optional[Node]:
    """``X`` if ``node`` concatenates two slices of one ``X`` (``cat([X[..], X[..]])``), else
    None: the shape of a retention's cut, its bounds unchecked (``cut_of`` checks them)."""
    if node.op != "call_function" or node.target not in CATS:
        return None
    parts = node.args[0]
    if len(parts) != 2 or any(p.op != "call_function" or p.target is not aten.slice.Tensor
                              for p in parts):
        return None
    x = parts[0].args[0]
    return x if parts[1].args[0] is x else None


def cut_of(state: Node, d: int) -> Optional[Tuple[Node, int, int, int]]:
    """``(X, head, tail_start, L)`` if ``state`` is ``cat([X[:head], X[tail_start:L]], d)``."""
    x = cut_source(state)
    if x is None or val(x) is None:
        return None
    parts = state.args[0]
    L = val(x).shape[d]
    bounds = [slice_bounds(p, L) for p in parts]
    if None in bounds:
        return None
    (d0, s0, e0), (d1, s1, e1) = bounds
    cat_dim = state.args[1] if len(state.args) > 1 else state.kwargs.get("dim", 0)
    if not (d0 == d1 == cat_dim % val(x).dim() == d and s0 == 0 and e1 == L and e0 <= s1):
        return None
    return x, e0, s1, L


def find_join(b: RegionBinding, state: Node) -> Union[Join, str, None]:
    """The join ``state`` cuts, or why the concatenation it cuts is no join of the old state and
    new frames; None when it cuts no concatenation along the frame dim."""
    found = cut_of(state, b.region.dim)
    if found is None or found[0].target not in CATS:
        return None
    x, head, tail_start, L = found
    w = window_of(b, x, 0, L)
    if isinstance(w, str):
        if not any(storage_key(p) in b.storages for p in x.args[0] if isinstance(p, Node)):
            return None   # it joins values the carry does not hold: a cut copied, no join missed
        return w
    written = _written_after(x, {storage_key(x), storage_key(w.new)} | set(b.storages))
    if written is not None:
        return f"{written.name} writes the join {x.name}, its new frames or the carry after it"
    return Join(w, state, head, L - tail_start)


def prepare_join(gm: GraphModule, b: RegionBinding, j: Join, keep_stock: bool) -> Optional[Node]:
    """Choose how ``j`` is written (``j.how``) and, when the join becomes a carry view, rewrite
    it; returns the stock cut for the audit when ``keep_stock`` and the cut reads the carry now."""
    w, d = j.window, b.region.dim
    if _only_the_cut_reads(j) and _moves(j) is not None:
        j.how = "moved"
        return None
    if w.order != APPEND:
        j.how, j.why = "temporary", (f"{w.cat.name} is read beyond its cut, and a view of the "
                                     f"carry with the new frames in front would move every old "
                                     f"frame by {w.added}, the prompt with them")
        return None
    done = rewrite_window(gm, b, w, keep_stock=keep_stock)
    if isinstance(done, str):
        j.how, j.why = "temporary", done
        return None
    j.how = "view"
    if not keep_stock:
        return None
    stock_x, L = done[1], w.held + w.added   # the stock join, kept for the audit: cut again
    with gm.graph.inserting_before(stock_x.next):
        first = slice_(gm, stock_x, d, 0, j.head)
        second = slice_(gm, stock_x, d, L - j.tail, L)
        return gm.graph.call_function(aten.cat.default, ([first, second], d))


def write_join(gm: GraphModule, b: RegionBinding, j: Join, dst: Node) -> Tuple[str, str]:
    """Write the cut into ``dst`` = ``C[:head+tail]``; returns ``(kind, detail)``."""
    w, h, t = j.window, j.head, j.tail
    L = w.held + w.added
    joined = f"{w.cat.name} ({w.order}, {w.held} + {w.added} frames)"
    if j.how == "view":
        move(gm, b, L - t, h, t)
        return "retention", (f"{joined} became an in-place write into the carry's room and its "
                             f"cut a move: C[:{h}] stays, frames [{L - t}, {L}) move to "
                             f"C[{h}:{h + t}]")
    if j.how == "moved":
        for src, at, n in _moves(j):
            move(gm, b, src, at, n)
        into = h + t - w.added if w.order == APPEND else 0
        copy_(gm, slice_(gm, b.carry_node, b.region.dim, into, into + w.added), w.new)
        still = (0, h) if w.order == APPEND else (h, h + t)
        stays = w.order == APPEND or w.held - t == h
        return "retention", (f"{joined} and its cut {j.cut.name} became in-place writes: the new "
                             f"frames go to C[{into}:{into + w.added}], C[{still[0]}:{still[1]}] "
                             f"{'stays where it is' if stays else 'moves once'}; no "
                             f"concatenation is left")
    skipped = _copy_from_temporary(gm, b, j, dst)
    return "materialize", (f"new state ({h + t} frames) written into C[:{h + t}]: copied once "
                           f"from the join {w.cat.name}, a temporary, {skipped} frames already "
                           f"in place not copied, because {j.why}")


# -- helpers ----------------------------------------------------------------------------------

def _only_the_cut_reads(j: Join) -> bool:
    parts = j.cut.args[0]
    return (set(j.window.cat.users) <= set(parts)
            and all(set(p.users) == {j.cut} for p in parts)
            and all(u.op == "output" for u in j.cut.users))


def _moves(j: Join) -> Optional[List[Tuple[int, int, int]]]:
    """The carry moves ``(src, dst, frames)`` that leave the cut's old frames in place, in an
    order where none overwrites what a later one reads; the new frames are written after them.
    None when the cut drops new frames (nothing handles that here)."""
    w, h, t = j.window, j.head, j.tail
    l, c = w.held, w.added
    if w.order == APPEND:
        if h > l or t < c:
            return None
        return [(l + c - t, h, t - c)]           # C[:h] stays
    if h < c or t > l:
        return None
    return [(l - t, h, t), (0, c, h - c)]        # the tail first: the head moves over its source


def _copy_from_temporary(gm: GraphModule, b: RegionBinding, j: Join, dst: Node) -> int:
    """``C[:h] = X[:h]``, ``C[h:h+t] = X[L-t:L]``, each skipped where it is old frames already at
    that place; returns the frames skipped."""
    w, h, t, d = j.window, j.head, j.tail, b.region.dim
    L = w.held + w.added
    skipped = 0
    for at, (lo, hi) in ((0, (0, h)), (h, (L - t, L))):
        old = (lo, hi) if w.order == APPEND else (lo - w.added, hi - w.added)
        if 0 <= old[0] and old[1] <= w.held and old[0] == at:
            skipped += hi - lo              # old frames at their own place: nothing to copy
            continue
        copy_(gm, slice_(gm, dst, d, at, at + hi - lo), slice_(gm, w.cat, d, lo, hi))
    return skipped


def _written_after(node: Node, storages: set) -> Optional[Node]:
    storages = storages - {None}
    n = node.next
    while n.op != "output":
        if is_mutating(n) and storage_key(mutated_arg(n)) in storages:
            return n
        n = n.next
    return None
