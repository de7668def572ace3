"""Liveness (carry) pass: retention and cache appends become in-place writes on the carry (§3.2).

Cases handled, per declared region (``C`` is the region's carry, ``d`` its frame dimension):

* region input: every use of the input placeholder reads ``C[:l]`` instead (the runtime guarantees
  the input *is* that view, copying a foreign tensor in once: turn resets, the first call).
* envelope: the state is a view of an over-sized buffer written by slice assignment, e.g. ::

      buf[step][..., :n] = new          ->   C[step][..., :n] = new
      return buf[..., :n]                    return C[..., :n]

  The buffer placeholder is replaced by ``C``, allocated at the declared extent. Every access must
  fit the carry; reads past it are allowed only on rows the step never writes and that hold zeros.
* retention (eq. 3): ``cat([X[:P], X[L-R:L]])`` becomes ``C[P:P+R] = X[L-R:L]`` (plus
  ``C[:P] = X[:P]`` when ``X`` is not already ``C``); overlapping moves are split into disjoint
  pieces copied low to high, so the values equal the stock concat.
* append: ``cat([C[:l], x])`` (append ordering, used once) becomes ``C[l:l+c] = x``.
* anything else that yields the new state (a prepend cat, a tail slice of a fresh tensor) is
  written into ``C[:n]`` once, after every read of the old state.

Needs ``meta["val"]`` on the traced nodes. Invariant: the graph's outputs equal the stock graph's
(``torch.equal``); the region outputs become views of ``C``, so their address never changes. With
``verify`` the stock value is kept and compared after each write (the shadow auditor, §3.6).
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.fx.passes.infra.pass_base import PassResult

from cadence_fx.audit import check_carry_write
from cadence_fx.context import PassContext, RegionBinding
from cadence_fx.fx_utils import (aten, dead_code_elimination, is_mutating, mutated_arg, slice_bounds,
                                 storage_key, val, view_chain)
from cadence_fx.tracing import InputSpec

__all__ = ["carry_retention"]


def carry_retention(gm: GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    outputs = _output_node(gm)
    for b in ctx.regions:
        b.carry_node = ctx.add_placeholder(gm, f"carry_{b.region.name}", InputSpec("carry", b.region.name))
        b.carry_node.meta["val"] = _fake_mode(gm).from_tensor(b.carry.tensor)
        b.storages = {storage_key(b.carry_node), storage_key(b.placeholder)} - {None}
        if b.placeholder is not None:
            _read_input_from_carry(gm, b)
        _replace_envelope(gm, ctx, b, outputs)
        if b.out_index is not None:
            modified |= _write_state(gm, ctx, b, outputs)
    dead_code_elimination(gm.graph)  # the stock concats whose results now come from the carry
    ctx.drop_unused_placeholders(gm)
    return PassResult(gm, True if ctx.regions else modified)


# -- helpers ----------------------------------------------------------------------------------

def _output_node(gm: GraphModule) -> Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _fake_mode(gm: GraphModule):
    for n in gm.graph.nodes:
        v = val(n)
        if v is not None and hasattr(v, "fake_mode"):
            return v.fake_mode
    raise ValueError("the traced graph carries no fake values; trace with tracing_mode='fake'")


def _out_values(out: Node) -> list:
    return list(out.args[0])


def _set_out_value(out: Node, i: int, node: Node) -> None:
    values = _out_values(out)
    values[i] = node
    out.args = (type(out.args[0])(values),) + tuple(out.args[1:])


def _slice(gm, src: Node, dim: int, start: int, stop: int) -> Node:
    return gm.graph.call_function(aten.slice.Tensor, (src, dim, start, stop))


def _read_input_from_carry(gm: GraphModule, b: RegionBinding) -> None:
    frames = val(b.placeholder).shape[b.region.dim]
    with gm.graph.inserting_after(b.carry_node):
        view = _slice(gm, b.carry_node, b.region.dim, 0, frames)
    view.meta["val"] = b.placeholder.meta.get("val")
    b.placeholder.replace_all_uses_with(view)


def _carry_offset(node: Node, b: RegionBinding, frames: int) -> Optional[bool]:
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


# -- envelope -------------------------------------------------------------------------------

def _replace_envelope(gm: GraphModule, ctx: PassContext, b: RegionBinding, out: Node) -> None:
    if b.out_index is None:
        return
    state = _out_values(out)[b.out_index]
    base, _ = view_chain(_retention_source(state) or state)
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
            _propagate_meta(gm, b.carry_node)
        except Exception as e:  # noqa: BLE001 - a shape the shrunken envelope cannot give
            for u in users:
                u.replace_input_with(b.carry_node, base)
            _propagate_meta(gm, base)
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


def _propagate_meta(gm: GraphModule, changed: Node) -> None:
    """Recompute the fake values downstream of ``changed`` (its storage shrank to the carry).

    Propagation stops at a node whose recomputed value is a fresh tensor (not a view of a changed
    storage) with the same shape, strides and dtype as before: nothing downstream of it can see
    the change. In a DiT step that is every compute op reading the cache, so only the view
    chains are recomputed, not the whole graph."""
    dirty = {changed}
    storages = set(_storages(val(changed)))
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
        aliased = set(_storages(new)) & storages
        if not aliased and _same_layout(old, new):
            continue
        dirty.add(node)
        storages.update(_storages(new))


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


def _storages(v) -> List[object]:
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


# -- the new state ----------------------------------------------------------------------------

def _retention_source(node: Node) -> Optional[Node]:
    """``X`` if ``node`` is ``cat([X[:P], X[L-R:L]], d)``, else None."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    parts = node.args[0]
    if len(parts) != 2 or any(p.op != "call_function" or p.target is not aten.slice.Tensor
                              for p in parts):
        return None
    x = parts[0].args[0]
    return x if parts[1].args[0] is x else None


def _write_state(gm: GraphModule, ctx: PassContext, b: RegionBinding, out: Node) -> bool:
    r, d = b.region, b.region.dim
    state = _out_values(out)[b.out_index]
    v = val(state)
    if v is None:
        ctx.note("near_miss", r.name, "the new state has no recorded shape")
        return False
    frames = v.shape[d]
    want = list(b.carry.tensor.shape)
    if list(v.shape[:d]) + list(v.shape[d + 1:]) != want[:d] + want[d + 1:] or v.dtype != b.carry.tensor.dtype:
        ctx.note("near_miss", r.name, f"new state {tuple(v.shape)} {v.dtype} does not match the "
                 f"declared carry {tuple(want)} {b.carry.tensor.dtype} outside the frame dim")
        return False
    if frames > b.carry.extent:
        ctx.note("near_miss", r.name, f"new state holds {frames} frames, beyond the declared "
                 f"extent {b.carry.extent}; check the retention clocks")
        return False
    at = _carry_offset(state, b, frames)
    if at:
        ctx.note("in_place", r.name, f"state is already C[:{frames}]")
        return False
    late = _late_carry_write(state, b)
    if late is not None:
        ctx.note("near_miss", r.name, f"{late.name} writes the carry after the new state is formed")
        return False
    with gm.graph.inserting_before(out):
        _detach_other_results(gm, b, out)
        dst = _slice(gm, b.carry_node, d, 0, frames)
        kind = (_try_retention(gm, b, state, dst) or _try_append(gm, b, state, dst)
                or _materialize(gm, b, state, dst))
        if ctx.verify:
            gm._cadence_auditor = ctx.auditor
            with warnings.catch_warnings():  # FX warns on get_attr of a non-tensor attribute
                warnings.simplefilter("ignore", UserWarning)
                auditor = gm.graph.get_attr("_cadence_auditor")
            audit = gm.graph.call_function(check_carry_write, (auditor, r.name, kind, state, dst))
            audit.meta["cadence_eager_reason"] = "shadow audit compares on the host"
    _set_out_value(out, b.out_index, dst)
    ctx.note(kind, r.name, f"new state ({frames} frames) written into C[:{frames}]")
    return True


def _detach_other_results(gm, b: RegionBinding, out: Node) -> None:
    """A result other than the new state that shares the carry's storage (the old state, a
    transposed view of it) would change under the caller at the next write: hand out a copy."""
    for i, o in enumerate(_out_values(out)):
        if i != b.out_index and isinstance(o, Node) and storage_key(o) in b.storages:
            copy = gm.graph.call_function(aten.clone.default, (o,))
            copy.meta["val"] = o.meta.get("val")
            _set_out_value(out, i, copy)


def _late_carry_write(state: Node, b: RegionBinding) -> Optional[Node]:
    node = state.next
    while node.op != "output":
        if is_mutating(node):
            target = mutated_arg(node)
            if target is not None and view_chain(target)[0] is b.carry_node:
                return node
        node = node.next
    return None


def _copy(gm, dst: Node, src: Node) -> Node:
    return gm.graph.call_function(aten.copy_.default, (dst, src))


def _try_retention(gm, b: RegionBinding, state: Node, dst: Node) -> Optional[str]:
    x = _retention_source(state)
    d = b.region.dim
    if x is None or val(x) is None:
        return None
    L = val(x).shape[d]
    bounds = [slice_bounds(p, L) for p in state.args[0]]
    if None in bounds:
        return None
    (d0, s0, e0), (d1, s1, e1) = bounds
    cat_dim = state.args[1] if len(state.args) > 1 else 0
    if not (d0 == d1 == (cat_dim % val(x).dim()) == d and s0 == 0 and e1 == L and e0 <= s1):
        return None
    P, R = e0, e1 - s1
    aliased = _carry_offset(x, b, L)
    if aliased is False:
        return None
    if not aliased:
        _copy(gm, _slice(gm, dst, d, 0, P), state.args[0][0])
        _copy(gm, _slice(gm, dst, d, P, P + R), state.args[0][1])
        return "retention"
    shift = s1 - P  # dst [P, P+R) <- src [s1, s1+R), moved down by `shift`
    for k in range(0, R, shift) if shift > 0 else ():
        n = min(shift, R - k)
        _copy(gm, _slice(gm, b.carry_node, d, P + k, P + k + n),
              _slice(gm, b.carry_node, d, s1 + k, s1 + k + n))
    return "retention"


def _try_append(gm, b: RegionBinding, state: Node, dst: Node) -> Optional[str]:
    if state.op != "call_function" or state.target is not aten.cat.default or len(state.users) != 1:
        return None
    parts, d = state.args[0], b.region.dim
    cat_dim = state.args[1] if len(state.args) > 1 else 0
    if len(parts) != 2 or val(state) is None or cat_dim % val(state).dim() != d:
        return None
    head, tail = parts
    held = val(head).shape[d] if val(head) is not None else None
    if held is None or not _carry_offset(head, b, held) or _carry_offset(tail, b, 0) is not None:
        return None
    _copy(gm, _slice(gm, dst, d, held, val(state).shape[d]), tail)
    return "append"


def _materialize(gm, b: RegionBinding, state: Node, dst: Node) -> str:
    src = state
    if _carry_offset(state, b, 0) is not None:  # reads C at an offset: copy through a temporary
        src = gm.graph.call_function(aten.clone.default, (state,))
    _copy(gm, dst, src)
    return "materialize"
