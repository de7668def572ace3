"""What the passes hand the runtime: plain specs of the runtime objects a compiled class needs,
and the one call a rewritten graph makes into the runtime.

The passes rewrite graphs and never build runtime objects. Where a rewritten graph needs one,
a pass leaves a runnable stand-in in the graph and emits a spec (``PassContext.specs``); the
runtime, after the pipeline, turns each spec into its object:

* ``RegionSpec`` (``fuse_exact``): a run of pointwise ops, in the graph as ``call_module`` of its
  stock graph; ``cadence_fx.fusion.make_regions`` puts a ``FusedRegion`` in its place, wherever
  the partition moved it.
* ``PieceSpec`` (``lower_guarded``): a piece of the partition, in the graph as its graph module;
  ``cadence_fx.replay.guard_pieces`` puts a ``GuardedPiece`` in its place.
* an audited carry write (``carry_retention`` with ``verify``): the graph calls
  ``check_carry_write`` on the runtime's shadow auditor (``PassContext.auditor``, anything with
  ``check(region, kind, stock, carry)``: ``cadence_fx.audit.Auditor``).

A stand-in computes what the runtime object computes on the stock path, so a graph whose specs
were not realized still runs (eagerly, unguarded, unfused).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Protocol, Tuple

import torch
from torch.fx import GraphModule

from .fx_utils import SIDE_EFFECTS

__all__ = ["RegionSpec", "PieceSpec", "Specs", "CarryAuditor", "check_carry_write"]


@dataclasses.dataclass
class RegionSpec:
    """A fused region: ``stock`` its graph (the stock kernels; placeholders carry the traced
    values, so its inputs' layout), ``ops`` the kernels it takes over, ``writes`` the positions of
    the inputs it writes in place (its last op a copy into one)."""
    name: str
    stock: GraphModule
    ops: List[str]
    writes: Tuple[int, ...] = ()


@dataclasses.dataclass
class PieceSpec:
    """A piece of the partition: ``kind`` "graph" (capturable) or "eager" with its ``reasons``;
    per input the contract-owned storage it is (``fixed``, None when staged) and whether the
    piece writes it (``mutated``); per output whether it leaves the step (``escaping``)."""
    name: str
    kind: str
    reasons: List[str]
    fixed: List[Optional[str]]
    mutated: List[bool]
    escaping: List[bool]


@dataclasses.dataclass
class Specs:
    regions: List[RegionSpec] = dataclasses.field(default_factory=list)
    pieces: List[PieceSpec] = dataclasses.field(default_factory=list)


class CarryAuditor(Protocol):
    def check(self, region: str, kind: str, stock: torch.Tensor, carry: torch.Tensor) -> None:
        ...


def check_carry_write(auditor: CarryAuditor, region: str, kind: str, stock, carry) -> None:
    """The audited write's call in the graph: the stock value against the carry's (§3.6)."""
    auditor.check(region, kind, stock, carry)


SIDE_EFFECTS.add(check_carry_write)
