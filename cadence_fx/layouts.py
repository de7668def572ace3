"""Carry layouts: the order in memory a region's state has, and what the compiled step does
when stock's is not the carry's.

Stock code reads its state in the layout the previous call handed it: ``hist.mean(2)`` on a
transposed ``hist`` reduces in another order, and so gives other bits, than on a contiguous one.
The compiled step reads the carry, which is contiguous in the region's declared dim order (the
layout a ``cat`` of contiguous frames gives, the one a streaming cache has once it is joined).
Where stock's state has another layout:

* a class whose stock state has another layout than its carry hands the stock value back (the
  carry pass's near miss, ``passes/_carry_layout.py``) instead of a carry view of another layout;
* a state that arrives in another layout than its carry, read by an op whose bits depend on the
  layout (the class's ``records.layout_reads``), runs the stock step with the reason
  (``arrival_reason``); read only by joins and copies, it is copied into the carry as always;
* the shadow auditor compares layouts as well as bits;

A layout is compared as a *stride order*: the dims of size > 1, outermost first. Strides
themselves may differ (a carry with room has longer rows than stock's state).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

# what a layout is, as the carry pass sees it too (``passes/_carry_layout.py``)
from .passes.fx_utils import describe, stride_order
from .passes.records import Records

__all__ = ["stride_order", "describe", "arrival_reason", "known_reads"]


def arrival_reason(name: str, t: torch.Tensor, carry_view: torch.Tensor,
                   reads: Dict[str, str]) -> Optional[str]:
    """Why the compiled class cannot take region ``name``'s state ``t`` (not a carry view), or
    None. ``reads``: the class's regions whose reads depend on the layout, with the op that reads
    each; a state read only by layout-free ops (cat, copy) may arrive in any layout."""
    if stride_order(t) == stride_order(carry_view) or name not in reads:
        return None
    return (f"region {name!r} arrives with {describe(t)}, but the compiled step reads it from "
            f"its carry with {describe(carry_view)} (contiguous), and the step reads it with "
            f"{reads[name]}, whose bits depend on the layout: the stock step runs. To compile "
            f"the call, return {name!r} contiguous from every call of the step (`.contiguous()` "
            "on it), or pass the state contiguous")


def known_reads(records: Iterable[Records]) -> Dict[str, str]:
    """The layout-dependent reads the compiled classes recorded, by region (the first found)."""
    reads: Dict[str, str] = {}
    for r in records:
        for name, op in (r.layout_reads or {}).items():
            reads.setdefault(name, op)
    return reads
