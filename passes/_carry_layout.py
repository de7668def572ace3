"""Layouts in the carry pass (``carry_retention.py``; the rule is ``cadence_fx/layouts.py``).

* ``layout_read``: the first op that reads a region's old state in a way whose bits depend on
  its layout (``hist.mean(2)``), following views; joins and copies read values only. Recorded per
  class (``records.layout_reads``), so that a state arriving in another layout than its carry
  runs stock only where that matters.
* ``layout_miss``: the near miss of a new state whose stride order differs from the carry's
  (a priming pass returning ``h.transpose(1, 2)``, a chunk returning the result of a ``cat``
  into a transposed carry). The state is handed back as stock computes it, not written into the
  carry: a carry view would hand the next call another layout than stock hands it.

Where a new state has the carry's layout, the window and join rewrites keep it: their readers
read carry views of the order the stock join (of which the state is a slice or a cut) has.
"""
from __future__ import annotations

import operator
from typing import Optional

from torch.fx import GraphModule, Node

from ._carry_graph import fake_mode, set_out_value
from .context import PassContext, RegionBinding
from .fx_utils import CATS, aten, describe, storage_key, stride_order, val
from .specs import check_carry_write

__all__ = ["layout_read", "layout_miss"]

# their result holds the values of the input whatever its layout: followed to their users
_FOLLOWED = frozenset({
    aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.alias.default,
    aten.detach.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.clone.default,
    aten._to_copy.default, operator.getitem})
# they read values only: a join, a copy, stacking
_VALUES_ONLY = CATS | {aten.stack.default, aten.copy.default, check_carry_write}


def layout_read(node: Optional[Node]) -> Optional[str]:
    """The op reading ``node`` (through views) whose bits may depend on its layout, or None."""
    todo, seen = [] if node is None else [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if user.target in _FOLLOWED or (user.target is aten.copy_.default
                                             and user.args[0] is n):
                todo.append(user)     # (copy_ into the state: its later readers are followed)
            elif user.target is aten.copy_.default or user.target in _VALUES_ONLY:
                continue
            else:
                return str(user.target)
    return None


def layout_miss(gm: GraphModule, ctx: PassContext, b: RegionBinding, state: Node,
                frames: int) -> bool:
    """Note the near miss and keep the stock state when its stride order is not the carry's."""
    v = val(state)
    carry = b.carry.tensor.narrow(b.region.dim, 0, frames)
    if stride_order(v) == stride_order(carry):
        return False
    ctx.note("near_miss", b.region.name,
             f"the stock step returns the new state with {describe(v)}, but the carry holds it "
             f"with {describe(carry)}: handed back as stock computes it, not written into the "
             f"carry; return {b.region.name!r} in one layout from every call (e.g. "
             "`.contiguous()` on it) to keep it in place")
    if storage_key(state) in b.storages:   # a view of the carry: the next write would change it
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        with gm.graph.inserting_before(out):
            copy = gm.graph.call_function(aten.clone.default, (state,))
        with fake_mode(gm):
            copy.meta["val"] = aten.clone.default(v)
        set_out_value(out, b.out_index, copy)
    return True
