"""Writes around the fused regions (``fuse_exact`` calls the first; the second is the pass
``functional_temporaries`` of ``fusion_prep.py``, run before it).

**A copy into a buffer, taken over by the region before it** (``absorbed_write``,
``write_target``): ``x = f(...); dst.copy_(x)``, with ``f`` a region, becomes the region writing
``dst`` itself, one kernel less (Moshi's ``end_offset.copy_(where(...))``, Mimi's conv states).

**In-place arithmetic on a temporary made functional** (``functional_temporaries``, run before
the regions are made). Case handled -- the per-step offsets of Moshi's depformer::

    before:  t = zeros([1]); a = add_(t, 1); f(a); b = add_(a, 1); g(b)     (each add_ a write:
             a region closes at it, and each is a kernel of its own)
    after:   t = zeros([1]); a = add(t, 1); f(a); b = add(a, 1); g(b)      (values the fused
             regions may take in)

``x.add_(y)`` computes ``add(x, y)`` with the same kernel and writes it over ``x``; when nothing
but the ops that follow can see ``x`` -- a tensor the graph made, no view or in-place result of
it made before the write and read after it, no other value in its storage -- the write is not
observable, and every reader after it reads the new value instead. Exact by construction: the
same ATen op computes the same values; only where they are stored changes. Needs
``meta["val"]`` (the traced storages); the views made from the new value get fake values in its
storage, so the passes after see them alias it. Left alone: a write into an input, module state
or a view; a temporary something else aliases; an op whose functional form would give another
dtype (``bf16.add_(fp32)`` rounds to bf16, ``add`` would not).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Dict, Optional

import torch
from torch.fx import GraphModule, Node

from .fx_utils import aten, is_mutating, returns_self, storage_key, val

__all__ = ["absorbed_write", "functional_temporaries", "write_target", "FUNCTIONAL"]

FUNCTIONAL = {
    aten.add_.Tensor: aten.add.Tensor, aten.add_.Scalar: aten.add.Scalar,
    aten.sub_.Tensor: aten.sub.Tensor, aten.sub_.Scalar: aten.sub.Scalar,
    aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar,
}


def functional_temporaries(gm: GraphModule) -> int:
    """Rewrites, in graph order, every in-place op of ``FUNCTIONAL`` on a temporary; returns how many."""
    order: Dict[Node, float] = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    sharing = defaultdict(set)         # storage -> the traced nodes whose value lives in it
    for n in gm.graph.nodes:
        key = storage_key(n)
        if key is not None:
            sharing[key].add(n)
    made = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in FUNCTIONAL or not n.args:
            continue
        t = n.args[0]
        fresh = _fresh_value(n)
        if fresh is None or not _temporary(t, n, order, sharing) or not _same_result(n, t):
            continue
        with gm.graph.inserting_before(n):
            z = gm.graph.call_function(FUNCTIONAL[n.target], n.args, dict(n.kwargs))
        z.meta = dict(n.meta)
        z.meta["val"] = fresh           # a storage of its own, and its aliases' (below)
        order[z] = order[n] - 0.5
        for u in list(t.users):         # readers after the write read the new value
            if u is not n and order[u] > order[n]:
                u.replace_input_with(t, z)
        n.replace_all_uses_with(z)
        gm.graph.erase_node(n)
        _retrace_aliases(z, order)
        made += 1
    return made


def _retrace_aliases(z: Node, order) -> None:
    """The fake values of the views and in-place results now made from ``z``, made again from
    ``z``'s: they share its storage, as the later passes' aliasing checks must see."""
    mode = val(z).fake_mode
    for a in sorted(_aliases(z), key=order.__getitem__):
        if a.target is operator.getitem:
            a.meta["val"] = a.args[0].meta["val"][a.args[1]]
        elif is_mutating(a):              # an in-place result is its first argument
            a.meta["val"] = a.args[0].meta["val"]
        else:
            args, kwargs = torch.fx.node.map_arg((a.args, a.kwargs), lambda m: m.meta["val"])
            with mode:
                a.meta["val"] = a.target(*args, **kwargs)


def _temporary(t, n: Node, order, sharing) -> bool:
    """``t`` is a tensor the graph made with an op that returns a new tensor (not a view, not an
    input, not an in-place result), and nothing made before ``n`` that aliases it (a view of it,
    an in-place result on it) is read after ``n``: such a reader would see the write. Views and
    in-place ops after ``n`` read ``t`` or ``n`` and are given the new value."""
    if not isinstance(t, Node) or t.op != "call_function" or not _makes_new(t):
        return False
    aliases = _aliases(t)
    if any(a is not n and order[a] < order[n] and any(order[u] > order[n] for u in a.users)
           for a in aliases):
        return False
    # a traced node: every value the trace put in its storage is one of those aliases
    key = storage_key(t)
    return key is None or t not in sharing[key] or sharing[key] <= {t, *aliases}


def _makes_new(t: Node) -> bool:
    target = t.target
    if not isinstance(target, torch._ops.OpOverload) or is_mutating(t) or target in ALIASING:
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is None


# ops that return an alias of an input without saying so in their schema
ALIASING = {aten._unsafe_view.default}


def _aliases(t: Node) -> list:
    """The nodes whose value is ``t``'s storage, found through views and in-place results."""
    found, todo = [], [t]
    while todo:
        a = todo.pop()
        for u in a.users:
            if u in found or u.op != "call_function" or not u.args or u.args[0] is not a:
                continue
            view = u.target is operator.getitem or u.target in ALIASING or (
                isinstance(u.target, torch._ops.OpOverload) and not is_mutating(u)
                and any(r.alias_info is not None for r in u.target._schema.returns))
            if view or (is_mutating(u) and returns_self(u)):
                found.append(u)
                todo.append(u)
    return found


def _same_result(n: Node, t: Node) -> bool:
    """The functional op gives the in-place op's value: same dtype (no promotion the in-place
    form would round away), shape and device."""
    x, out = val(t), val(n)
    if x is None or out is None or (x.shape, x.dtype, x.device) != (out.shape, out.dtype, out.device):
        return False
    other = n.args[1] if len(n.args) > 1 else None
    if isinstance(other, Node):
        o = val(other)
        if o is None:
            return False
        return torch.result_type(x, o) == x.dtype and torch.broadcast_shapes(x.shape, o.shape) == x.shape
    return isinstance(other, (bool, int, float)) and torch.result_type(x, other) == x.dtype


def _fresh_value(n: Node) -> Optional[torch.Tensor]:
    """A fake tensor like ``n``'s value in a storage of its own, or None without a fake mode."""
    v = val(n)
    mode = getattr(v, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)


def write_target(n: Node, views) -> bool:
    """A view made only to be written into (``dst[:, :6].copy_(v)``): it stays outside the
    regions, so a region ending on that write is given the destination as an input."""
    return n.op == "call_function" and n.target in views and bool(n.users) and all(
        u.op == "call_function" and u.target is aten.copy_.default and u.args[0] is n
        for u in n.users)


def absorbed_write(n: Node, members: set, device: Optional[str], dtypes) -> bool:
    """``copy_(dst, v)`` of a value ``v`` of the open region into a tensor ``dst`` outside it, at
    the same shape, dtype and device: the region may end on it and write ``dst`` itself (the
    values are the same bits, copied). Nothing else the region reads may share ``dst``'s storage:
    the fused kernel would read what it is writing (``dst`` itself is fine: each element is read
    before it is written, and Inductor orders the two). Broadcasting and casting copies stay stock."""
    if n.op != "call_function" or n.target is not aten.copy_.default or len(n.args) != 2 \
            or set(n.kwargs) - {"non_blocking"}:
        return False
    dst, src = n.args
    if not isinstance(src, Node) or src not in members or not isinstance(dst, Node) or dst in members:
        return False
    d, v = val(dst), val(src)
    if d is None or v is None or d.dtype not in dtypes or (d.dtype, tuple(d.shape), d.device) != \
            (v.dtype, tuple(v.shape), v.device) or (device is not None and d.device.type != device):
        return False
    key = storage_key(dst)
    return key is not None and not any(
        a is not dst and a not in members and storage_key(a) == key
        for m in members for a in m.all_input_nodes)
