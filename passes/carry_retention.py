"""Liveness (carry) pass: retention and cache appends become in-place writes on the carry (§3.2).

Cases handled, per declared region (``C`` is the region's carry, ``d`` its frame dimension):

* region input: every use of the input placeholder reads ``C[:l]`` instead (the runtime guarantees
  the input *is* that view, copying a foreign tensor in once: turn resets, the first call).
* envelope (``_carry_envelope.py``): the state is a view of an over-sized buffer written by slice
  assignment; the buffer placeholder is replaced by ``C``, allocated at the declared extent.
* retention (eq. 3): ``cat([X[:P], X[L-R:L]])`` becomes ``C[P:P+R] = X[L-R:L]`` (plus
  ``C[:P] = X[:P]`` when ``X`` is not already ``C``); overlapping moves are split into disjoint
  pieces copied low to high, so the values equal the stock concat.
* prompt-retained join (``_carry_prompt.py``): ``X = cat([C[:l], x])`` cut to
  ``cat([X[:P], X[L-R:L]])`` (or prepended, cut to the newest frames and the prompt): the kept
  old frames move, ``x`` is written, the prompt stays where it is; a join read beyond its cut
  becomes the carry's room (append order), else stays a temporary with a near miss saying why.
* window (``_carry_window.py``): ``cat([C[:l], x])[..., -W:]`` (or ``narrow``, a ``split`` part,
  with the slice conditional or not; prepend order too) becomes ``C[l:l+c] = x``, its readers
  read carry views, and the kept frames move down last: no concatenation is left. Kind
  ``retention`` when frames are dropped, ``append`` while the window fills.
* stacked windows (``_carry_stacked.py``): a state joined (``stack``, or ``cat`` along another
  dim) from per-layer windows of slices of the old state -- per-layer K/V caches stacked into one
  tensor -- each written as a window on its carry slice, the kept frames moved once.
* materialize, the last resort, with its reason in the report: anything else that yields the new
  state (a tail of a fresh result, such as HiFT's source cache) is copied into ``C[:n]`` once,
  after every read of the old state (a ``clone`` of it is copied from its source instead).

      buf[step][..., :n] = new          ->   C[step][..., :n] = new        (envelope)
      full = cat([C[:l], x])[..., -W:]  ->   C[l:l+c] = x; ...; C[:W] = C[l+c-W:l+c]   (window)

Near miss that must not fire: a new state whose stride order is not the carry's (a transposed
result) is handed back as stock computes it, never as a carry view of another layout
(``_carry_layout.py``); ops reading the old state in a layout-dependent way are recorded.

Needs ``meta["val"]`` on the traced nodes. Invariant: the graph's outputs equal the stock graph's
(``torch.equal``); the region outputs become views of ``C``, so their address never changes. With
``verify`` the stock value is kept and compared after each write (the shadow auditor, §3.6).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Union

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from ._carry_envelope import replace_envelope
from ._carry_layout import layout_miss, layout_read
from ._carry_graph import (carry_offset, copy_, fake_mode, out_values, output_node, set_out_value,
                           slice_)
from ._carry_prompt import Join, cut_of, cut_source, find_join, prepare_join, write_join
from ._carry_stacked import Stacked, find_stacked, rewrite_stacked
from ._carry_window import Window, find_window, move, rewrite_window
from .context import InputSpec, PassContext, RegionBinding
from .fx_utils import (aten, dead_code_elimination, is_mutating, mutated_arg, storage_key, val,
                       view_chain)
from .records import LayoutRead
from .specs import check_carry_write

__all__ = ["carry_retention"]


def carry_retention(gm: GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    outputs = output_node(gm)
    for b in ctx.regions:
        b.carry_node = ctx.add_placeholder(gm, f"carry_{b.region.name}", InputSpec("carry", b.region.name))
        b.carry_node.meta["val"] = fake_mode(gm).from_tensor(b.carry.tensor)
        _record_layout(ctx, b)
        b.storages = {storage_key(b.carry_node), storage_key(b.placeholder)} - {None}
        if b.placeholder is not None:
            _read_input_from_carry(gm, b)
        if b.out_index is not None:
            state = out_values(outputs)[b.out_index]
            replace_envelope(gm, ctx, b, view_chain(cut_source(state) or state)[0])
        if b.out_index is not None:
            modified |= _write_state(gm, ctx, b, outputs)
    dead_code_elimination(gm.graph)  # the stock concats whose results now come from the carry
    ctx.drop_unused_placeholders(gm)
    return PassResult(gm, True if ctx.regions else modified)


# -- helpers ----------------------------------------------------------------------------------

def _record_layout(ctx: PassContext, b: RegionBinding) -> None:
    """The op reading the old state in a way whose bits depend on its layout, if any
    (``_carry_layout.py``): a state arriving in another layout than the carry's runs stock."""
    ctx.records.layouts_analysed = True
    read = layout_read(b.placeholder)
    if read is None:
        return
    reads = ctx.records.reads
    was = next((i for i, r in enumerate(reads) if r.region == b.region.name), None)
    if was is None:
        ctx.records.add(LayoutRead(b.region.name, read))
    else:   # the last read found for the region
        reads[was] = LayoutRead(b.region.name, read)


def _read_input_from_carry(gm: GraphModule, b: RegionBinding) -> None:
    frames = val(b.placeholder).shape[b.region.dim]
    with gm.graph.inserting_after(b.carry_node):
        view = slice_(gm, b.carry_node, b.region.dim, 0, frames)
    view.meta["val"] = b.placeholder.meta.get("val")
    b.placeholder.replace_all_uses_with(view)


# -- the new state ----------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """How one region's new state is written: through a window, a prompt-retained join, or
    (neither) a retention of the carry or a copy, with the stock value the audit compares."""
    stock: Node
    window: Optional[Union[Window, Stacked]] = None
    join: Optional[Join] = None
    why: Optional[str] = None       # why it is no window (for a copy's detail)


def _write_state(gm: GraphModule, ctx: PassContext, b: RegionBinding, out: Node) -> bool:
    r, d = b.region, b.region.dim
    state = out_values(out)[b.out_index]
    frames = _frames_to_write(gm, ctx, b, state)
    if frames is None:
        return False
    plan = _plan(gm, ctx, b, state, frames)
    with gm.graph.inserting_before(out):
        _detach_other_results(gm, b, out)
        dst = slice_(gm, b.carry_node, d, 0, frames)
        if plan.join is not None:
            kind, detail = write_join(gm, b, plan.join, dst)
        elif plan.window is not None:
            kind, detail = _write_window(gm, b, plan.window, frames)
        else:
            kind = _try_retention(gm, b, state, dst) or _materialize(gm, b, state, dst)
            detail = f"new state ({frames} frames) written into C[:{frames}]"
            if kind == "materialize":
                detail += f": copied once, because {plan.why or 'it is not a window of the old state'}"
        if ctx.verify:
            _audit(gm, ctx, r.name, kind, plan.stock, dst)
    set_out_value(out, b.out_index, dst)
    ctx.note(kind, r.name, detail)
    return True


def _frames_to_write(gm: GraphModule, ctx: PassContext, b: RegionBinding,
                     state: Node) -> Optional[int]:
    """The new state's frames, or None (with a note) when the carry cannot or need not take it."""
    r, d = b.region, b.region.dim
    v = val(state)
    if v is None:
        ctx.note("near_miss", r.name, "the new state has no recorded shape")
        return None
    frames = v.shape[d]
    want = list(b.carry.tensor.shape)
    if list(v.shape[:d]) + list(v.shape[d + 1:]) != want[:d] + want[d + 1:] or v.dtype != b.carry.tensor.dtype:
        ctx.note("near_miss", r.name, f"new state {tuple(v.shape)} {v.dtype} does not match the "
                 f"declared carry {tuple(want)} {b.carry.tensor.dtype} outside the frame dim")
        return None
    if frames > b.carry.extent:
        ctx.note("near_miss", r.name, f"new state holds {frames} frames, beyond the declared "
                 f"extent {b.carry.extent}; check the retention clocks")
        return None
    if carry_offset(state, b, frames):
        ctx.note("in_place", r.name, f"state is already C[:{frames}]")
        return None
    late = _late_carry_write(state, b)
    if late is not None:
        ctx.note("near_miss", r.name, f"{late.name} writes the carry after the new state is formed")
        return None
    if layout_miss(gm, ctx, b, state, frames):
        return None
    return frames


def _plan(gm: GraphModule, ctx: PassContext, b: RegionBinding, state: Node, frames: int) -> _Plan:
    """Find the form the new state takes and rewrite what must change before the output: a
    window or a join made a view of the carry, per-layer windows written on their slices."""
    plan = _Plan(stock=state)
    if cut_source(state) is not None:
        join = find_join(b, state)
        if isinstance(join, Join):
            plan.join, stock = join, prepare_join(gm, b, join, keep_stock=ctx.verify)
            plan.stock = stock if stock is not None else state
            if join.how == "temporary":
                ctx.note("near_miss", b.region.name, join.why)
        elif isinstance(join, str):
            ctx.note("near_miss", b.region.name, f"the cut's concatenation is copied: {join}")
        return plan
    window = find_window(b, state)
    stacked = find_stacked(b, state) if isinstance(window, str) else None
    if isinstance(stacked, Stacked):
        done = rewrite_stacked(gm, b, stacked)
        if isinstance(done, str):
            ctx.note("near_miss", b.region.name, done)
            plan.why = done
        else:
            plan.window = dataclasses.replace(stacked, start=done, stop=done + frames)
    elif isinstance(window, str):   # (with the reason it is no join of windows, if a join)
        plan.why = window if stacked is None else f"{window}; {stacked}"
    else:
        done = rewrite_window(gm, b, window, keep_stock=ctx.verify)
        if isinstance(done, str):
            ctx.note("near_miss", b.region.name, done)
            plan.why = done
        else:
            plan.window = window
            plan.stock = done[1] if ctx.verify else state
    return plan


def _write_window(gm, b: RegionBinding, window, frames: int):
    move(gm, b, window.start, 0, frames)   # nothing when the window starts at 0
    kind = "retention" if frames < window.held + window.added else "append"
    if isinstance(window, Stacked):
        lo, hi = window.parts[0][1].taken
        return kind, (f"{len(window.parts)} windows ({window.order}, {window.held} + "
                      f"{window.added} frames: {', '.join(w.cat.name for _, w in window.parts)})"
                      f" stacked along other dims became in-place writes on their carry "
                      f"slices; the window [{lo}, {hi}) is C[:{frames}]")
    lo, hi = window.taken
    return kind, (f"{window.cat.name} ({window.order}, {window.held} + {window.added} "
                  f"frames) became in-place writes; its window [{lo}, {hi}) is C[:{frames}]")


def _audit(gm, ctx: PassContext, region: str, kind: str, stock: Node, dst: Node) -> None:
    gm._cadence_auditor = ctx.auditor
    with warnings.catch_warnings():  # FX warns on get_attr of a non-tensor attribute
        warnings.simplefilter("ignore", UserWarning)
        auditor = gm.graph.get_attr("_cadence_auditor")
    audit = gm.graph.call_function(check_carry_write, (auditor, region, kind, stock, dst))
    audit.meta["cadence_eager_reason"] = "shadow audit compares on the host"


def _detach_other_results(gm, b: RegionBinding, out: Node) -> None:
    """A result other than the new state that shares the carry's storage (the old state, a
    transposed view of it) would change under the caller at the next write: hand out a copy."""
    for i, o in enumerate(out_values(out)):
        if i != b.out_index and isinstance(o, Node) and storage_key(o) in b.storages:
            copy = gm.graph.call_function(aten.clone.default, (o,))
            copy.meta["val"] = o.meta.get("val")
            set_out_value(out, i, copy)


def _late_carry_write(state: Node, b: RegionBinding) -> Optional[Node]:
    node = state.next
    while node.op != "output":
        if is_mutating(node):
            target = mutated_arg(node)
            if target is not None and view_chain(target)[0] is b.carry_node:
                return node
        node = node.next
    return None


def _try_retention(gm, b: RegionBinding, state: Node, dst: Node) -> Optional[str]:
    found = cut_of(state, b.region.dim)
    if found is None:
        return None
    x, P, s1, L = found
    R, d = L - s1, b.region.dim
    aliased = carry_offset(x, b, L)
    if aliased is False:
        return None
    if not aliased:
        copy_(gm, slice_(gm, dst, d, 0, P), state.args[0][0])
        copy_(gm, slice_(gm, dst, d, P, P + R), state.args[0][1])
        return "retention"
    move(gm, b, s1, P, R)  # dst [P, P+R) <- src [s1, s1+R), split where they overlap
    return "retention"


def _materialize(gm, b: RegionBinding, state: Node, dst: Node) -> str:
    src = state
    if (state.op == "call_function" and state.target is aten.clone.default and len(state.users) == 1
            and not state.kwargs and storage_key(state.args[0]) not in b.storages):
        src = state.args[0]   # the state is a copy already: copy its source, once, as stock does
    elif carry_offset(state, b, 0) is not None or storage_key(state) in b.storages:
        # it reads C (at an offset, transposed, ...): copied through a temporary, or the copy
        # would overwrite what it has yet to read
        src = gm.graph.call_function(aten.clone.default, (state,))
    copy_(gm, dst, src)
    return "materialize"
