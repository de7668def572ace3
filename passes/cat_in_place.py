"""Concatenations written in place: a ``cat`` whose whole value is copied into a buffer is computed
in the buffer instead, its parts copied straight to their places. Case handled -- the Token2Wav
DiT's attention, per block and Euler step::

    before:  k = cat([k_new, k_cache], 2); v = cat([v_new, v_cache], 2); kv = cat([k, v], 3)
             o = sdpa(q, k, v); ...; buf[b][:, :, :L].copy_(kv)     # three cats and a copy of L frames
    after:   d = buf[b][:, :, :L]
             d[..., :t, :64].copy_(k_new); d[..., t:, :64].copy_(k_cache)
             d[..., :t, 64:].copy_(v_new); d[..., t:, 64:].copy_(v_cache)
             o = sdpa(q, d[..., :64], d[..., 64:])                     # reads the buffer

A copy is exact, so the buffer ends with the same bits either way. What changes is where the
cat's other readers find its value: in the buffer, with the buffer's strides. Only readers that
compute the same bits on those strides are moved: attention, whose kernel reads its operands
through their strides (the backend ``torch._fused_sdp_choice`` picks must stay the same, and the
operands stay aligned, so it is the same kernel on the same values). A cat read by anything else
is kept and copied in whole.

The writes move up, from the copy to the outermost cat: nothing between them may read or write
the buffer or the parts' storage (by the traced storages, as the carry pass sees aliasing), and
the buffer's view must be made from values that exist there. Invariant: the graph writes the same
bits into the buffer and computes the same values everywhere else.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from .fx_utils import CATS, aten, is_mutating, mutated_arg, storage_key, val

__all__ = ["write_cats_in_place", "LAYOUT_FREE_READERS"]

SDPA = aten.scaled_dot_product_attention.default
SPLITS = (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default)
LAYOUT_FREE_READERS = (SDPA,)
# the attention backends (``torch._fused_sdp_choice``) whose kernel reads K and V through their
# strides: flash and memory-efficient attention on the device (math runs matmuls, whose GEMM
# sees another leading dimension; cuDNN builds its plan from the strides). On the CPU (fusion
# switched on there for tests) the traced choice is the math one whatever the real kernel is;
# the tests compare bits.
READS_THROUGH_STRIDES = {"cuda": (1, 2), "cpu": (0, 1)}
_ALIGN_BYTES = 16


def _cat_dim(node: Node) -> int:
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return d % val(node).dim()


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and all(
        (s * t.element_size()) % _ALIGN_BYTES == 0 for s in t.stride()[:-1]) and \
        (t.storage_offset() * t.element_size()) % _ALIGN_BYTES == 0


def _real(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor on ``t``'s device with its shape, strides and storage offset modulo
    256 bytes: what the attention backend choice reads. The traced values are fake, and on a fake
    tensor ``torch._fused_sdp_choice`` answers for the meta device (always the math backend)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    offset = t.storage_offset() % max(1, 256 // t.element_size())
    with torch.no_grad(), unset_fake_temporarily():
        return torch.empty(offset + span, dtype=t.dtype, device=t.device).as_strided(
            t.shape, t.stride(), offset)


def _sdpa_changes(reader: Node, swaps: Dict[Node, torch.Tensor]) -> Optional[str]:
    """Why attention would not be the same kernel on the same values with ``swaps`` (node -> its
    value in the buffer) in place of the cat outputs it reads; None when it would: the backend is
    the one it was, one that reads through strides, and the operands stay aligned."""
    from torch.fx.operator_schemas import normalize_function
    found = normalize_function(reader.target, reader.args, reader.kwargs,
                               normalize_to_only_use_kwargs=True)
    if found is None:
        return "attention's arguments do not normalize"
    if isinstance(found.kwargs.get("attn_mask"), Node):
        return "attention with a mask"
    kw = dict(found.kwargs)
    qkv = [kw.pop(k) for k in ("query", "key", "value")]
    if any(not isinstance(a, Node) or val(a) is None for a in qkv) or \
            any(isinstance(v, Node) for v in kw.values()):
        return "attention's operands are not traced values"
    before = [val(a) for a in qkv]
    after = [swaps.get(a, val(a)) for a in qkv]
    try:
        chosen = int(torch._fused_sdp_choice(*[_real(t) for t in before], **kw))
        moved = int(torch._fused_sdp_choice(*[_real(t) for t in after], **kw))
    except (RuntimeError, TypeError) as e:
        return f"torch._fused_sdp_choice raised {type(e).__name__}"
    device = before[0].device.type
    if chosen != moved:
        return f"attention backend {chosen} would become {moved}"
    if chosen not in READS_THROUGH_STRIDES.get(device, ()):
        return f"attention backend {chosen} on {device} does not read through strides"
    if not all(_aligned(t) for t in after):
        return "the buffer's views are not 16-byte aligned"
    return None


def _same_storage(node: Node, key) -> bool:
    other = storage_key(node)
    return other is not None and other == key


def _view(d: torch.Tensor, box) -> torch.Tensor:
    """``d`` narrowed to ``box`` (a (start, stop) per dim), as one ``as_strided``: on the trace's
    fake values a chain of ``narrow``s is a decomposition and a cache key per dim (most of this
    pass's time on the DiT), while the view itself is only arithmetic on sizes and offsets."""
    offset = d.storage_offset() + sum(a * s for (a, _), s in zip(box, d.stride()))
    return d.as_strided([b - a for a, b in box], d.stride(), offset)


def _merge_splits(leaves: List[tuple]) -> List[tuple]:
    """Parts that are all the pieces of one ``chunk``/``split`` of a tensor, landing side by side
    in its order along the split dim (and in the same place along every other), become one copy
    of that tensor: the K and V halves of a cache are one copy of the cache."""
    pieces: Dict[Node, List[tuple]] = {}
    for part, box in leaves:
        if part.target is operator.getitem and part.args[0].target in SPLITS:
            pieces.setdefault(part.args[0], []).append((part.args[1], box))
    merged: Dict[Node, tuple] = {}
    for split, found in pieces.items():
        source = split.args[0]
        dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % val(source).dim()
        outs = split.meta.get("val")
        # every piece exactly once (a piece placed twice is two copies, left as they are)
        if not isinstance(outs, (list, tuple)) or sorted(i for i, _ in found) != list(range(len(outs))):
            continue
        boxes = [box for _, box in sorted(found, key=lambda f: f[0])]
        side_by_side = all(
            all(b[k] == boxes[0][k] for k in range(len(b)) if k != dim) for b in boxes) and all(
            boxes[i][dim][1] == boxes[i + 1][dim][0] for i in range(len(boxes) - 1))
        if side_by_side and boxes[-1][dim][1] - boxes[0][dim][0] == val(source).shape[dim] \
                and val(source).dtype == outs[0].dtype:
            box = list(boxes[0])
            box[dim] = (boxes[0][dim][0], boxes[-1][dim][1])
            merged[split] = tuple(box)
    out, done = [], set()
    for part, box in leaves:
        split = part.args[0] if part.target is operator.getitem else None
        if split in merged:
            if split not in done:
                out.append((split.args[0], merged[split]))
                done.add(split)
        else:
            out.append((part, box))
    return out


class _Tree:
    """The cats to place, outermost first, and the parts copied into the buffer."""

    def __init__(self):
        self.cats: List[Node] = []      # every cat placed, outermost first
        self.parts: List[Node] = []     # what is copied into the buffer
        self.seen: set = set()

    def collect(self, cat: Node, readers_ok) -> bool:
        """Place ``cat`` and, inside it, every part that is a cat read only by its parent and
        layout-free readers. False when the tree is not one this pass rewrites: a node met twice
        (each place is written once, from one node), a part of another dtype or rank (a legacy
        empty 1-D part), a part without a traced value."""
        if cat in self.seen:
            return False
        self.seen.add(cat)
        self.cats.append(cat)
        rank, dtype = val(cat).dim(), val(cat).dtype
        for part in cat.args[0]:
            if not isinstance(part, Node) or val(part) is None or part in self.seen \
                    or val(part).dim() != rank or val(part).dtype != dtype:
                return False
            inner = (part.op == "call_function" and part.target in CATS
                     and all(u is cat or readers_ok(u) for u in part.users))
            if inner:
                if not self.collect(part, readers_ok):
                    return False
            else:
                self.seen.add(part)
                self.parts.append(part)
        return True


def write_cats_in_place(gm: GraphModule, device: str, left: Optional[Dict[str, int]] = None) -> int:
    """Rewrite every ``copy_(buffer, cat(...))`` on ``device`` this way; returns how many cats
    are no longer computed. ``left`` (if given) counts the copies of a cat left as they were,
    by reason."""
    removed = 0
    for write in [n for n in gm.graph.nodes if n.op == "call_function"
                  and n.target is aten.copy_.default]:
        done = _rewrite(gm, write, device)
        if isinstance(done, str):
            if left is not None:
                left[done] = left.get(done, 0) + 1
        else:
            removed += done
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _rewrite(gm: GraphModule, write: Node, device: str) -> Union[int, str]:
    """The cats removed, 0 for a copy that is not of a cat, or why a cat's copy was left."""
    dst, top = write.args[0], write.args[1] if len(write.args) > 1 else None
    if (write.users or write.kwargs or not isinstance(top, Node) or top.op != "call_function"
            or top.target not in CATS or list(top.users) != [write]):
        return 0
    d, t = val(dst), val(top)
    if d is None or t is None:
        return "no traced value"
    if d.device.type != device:
        return 0
    if d.dtype != t.dtype or tuple(d.shape) != tuple(t.shape) or d.device != t.device:
        return "buffer and cat differ (device, dtype or shape)"
    tree = _Tree()
    if not tree.collect(top, lambda u: u.op == "call_function" and u.target in LAYOUT_FREE_READERS):
        return "a node placed twice, or a part of another rank or dtype"
    # the readers moved onto the buffer: those of the cats placed (not of one tried and left)
    readers = list({u: None for c in tree.cats[1:] for u in c.users
                    if u not in tree.cats and u is not write})
    # graph order: nodes compare by their place in the graph
    if any(not top < r < write for r in readers):
        return "a reader before the outermost cat or after the copy"
    chain = _buffer_view(dst, top)
    if isinstance(chain, str):
        return chain
    why = _interference(tree, readers, set(chain) | {write}, write, dst)
    if why is not None:
        return why
    boxes, leaves = _boxes(tree, top, d)
    for r in readers:
        why = _sdpa_changes(r, {c: _view(d, boxes[c]) for c in tree.cats})
        if why is not None:
            return why
    _write_parts(gm.graph, write, top, d, tree, chain, readers, boxes, leaves)
    return len(tree.cats)


def _buffer_view(dst: Node, top: Node) -> Union[List[Node], str]:
    """The nodes after the outermost cat that make the buffer's view (remade where the writes
    go, from nodes that exist there), or why they cannot be."""
    chain, node = [], dst
    while isinstance(node, Node) and node.op == "call_function" and node > top:
        if node.target not in (aten.slice.Tensor, aten.select.int, aten.narrow.default,
                               aten.view.default, aten.alias.default):
            return f"the buffer's view is made by {node.target}"
        chain.append(node)
        node = node.args[0]
    if any(isinstance(a, Node) and a > top for c in chain for a in c.all_input_nodes
           if a not in chain):
        return "the buffer's view needs values made after the outermost cat"
    return chain


def _interference(tree: "_Tree", readers: List[Node], moved: set, write: Node,
                  dst: Node) -> Optional[str]:
    """Why the parts cannot be written into the buffer early: nothing between the first cat and
    the copy may read or write the buffer, nor write a part."""
    buffer = storage_key(dst)
    keys = [storage_key(p) for p in tree.parts]
    if buffer is None or any(k is None for k in keys):
        return "a storage the trace does not know"
    parts = set(keys)
    if buffer in parts:
        return "a part is a view of the buffer"
    placed = set(tree.cats)
    n = min(tree.cats).prev
    while (n := n.next) is not write:
        if n in placed or n in moved:
            continue
        if n in readers:     # its operands other than the cats it reads must not be the buffer
            if any(_same_storage(a, buffer) for a in n.all_input_nodes if a not in placed):
                return "an attention operand reads the buffer"
            continue
        if is_mutating(n):
            target = mutated_arg(n)
            key = storage_key(target) if target is not None else None
            if key is None or key == buffer or key in parts:
                return f"{n.target} writes the buffer or a part in between"
        if any(_same_storage(a, buffer) for a in n.all_input_nodes):
            return f"{n.target} reads the buffer in between"
    return None


def _boxes(tree: "_Tree", top: Node, d: torch.Tensor) -> Tuple[Dict[Node, tuple], List[tuple]]:
    """The box (start, stop per dim) of the buffer each cat lands in, and each part with its."""
    boxes: Dict[Node, tuple] = {top: tuple((0, size) for size in d.shape)}
    leaves: List[tuple] = []
    for cat in tree.cats:
        dim, offset = _cat_dim(cat), boxes[cat][_cat_dim(cat)][0]
        for part in cat.args[0]:
            n = val(part).shape[dim]
            box = list(boxes[cat])
            box[dim] = (offset, offset + n)
            offset += n
            if part in tree.cats:
                boxes[part] = tuple(box)
            else:
                leaves.append((part, tuple(box)))
    return boxes, leaves


def _write_parts(graph, write: Node, top: Node, d: torch.Tensor, tree: "_Tree", chain: List[Node],
                 readers: List[Node], boxes: Dict[Node, tuple], leaves: List[tuple]) -> None:
    """The rewrite: the buffer's view after the outermost cat, every part copied to its place,
    the readers moved onto the buffer's views, the cats and the copy gone."""
    cursor = top

    def emit(target, args, value) -> Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = graph.call_function(target, args)
        cursor.meta["val"] = value
        return cursor

    base = write.args[0]
    if chain:            # the buffer's view, remade after the outermost cat
        env: Dict[Node, Node] = {}
        for c in reversed(chain):
            with graph.inserting_after(cursor):
                cursor = env[c] = graph.node_copy(c, lambda a: env.get(a, a))
        base = env[chain[0]]

    def view_of(box) -> Node:
        node = base
        whole = [(0, size) for size in d.shape]
        for dim, ((a, b), size) in enumerate(zip(box, d.shape)):
            if (a, b) != (0, size):
                whole[dim] = (a, b)
                node = emit(aten.slice.Tensor, (node, dim, a, b), _view(d, whole))
        return node

    made = {c: view_of(boxes[c]) for c in tree.cats if any(u in readers for u in c.users)}
    for part, box in _merge_splits(leaves):
        emit(aten.copy_.default, (view_of(box), part), _view(d, box))
    for cat in tree.cats:
        for u in list(cat.users):
            if u not in tree.cats and u is not write:
                u.replace_input_with(cat, made[cat])
    graph.erase_node(write)
    for c in chain:      # the copy's own view of the buffer, unless read elsewhere
        if not c.users:
            graph.erase_node(c)
    for cat in tree.cats:    # outermost first: each one's users are gone by then
        graph.erase_node(cat)
