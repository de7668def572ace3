"""What the passes of one signature class share: the adapter, what each input of the graph is, the
bindings of regions to graph nodes, the carries, the specs the passes emit for the runtime, and a
record of every rewrite for the report."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.fx import GraphModule, Node

from cadence_fx.contract import Adapter, Region

from .records import NearMiss, Records, Rewrite
from .specs import CarryAuditor, Specs

__all__ = ["InputSpec", "Carry", "RegionBinding", "PassContext"]


@dataclasses.dataclass(frozen=True)
class InputSpec:
    kind: str   # "param" | "buffer" | "arg" | "carry"
    name: str   # the parameter/buffer name, the argument path ("cache.estimator_att_cache"), the region


@dataclasses.dataclass
class Carry:
    """A contract-owned buffer holding one region at a fixed address for the stream's lifetime."""
    region: Region
    tensor: torch.Tensor
    # the state the last compiled call handed out (a view of the carry): a carry view passed in
    # that is not it is a stale state, overwritten since (a retry from an uncloned old state)
    handed_out: Optional[weakref.ref] = None

    def hand_out(self, state: torch.Tensor) -> torch.Tensor:
        """A fresh view object of ``state`` for the caller, remembered as the latest."""
        view = state.view(state.shape)
        self.handed_out = weakref.ref(view)
        return view

    def is_stale(self, t: torch.Tensor) -> bool:
        """``t`` is a view of the carry, but not the state the last call handed out."""
        latest = None if self.handed_out is None else self.handed_out()
        return self.handed_out is not None and t is not latest and self.holds(t)

    @property
    def dim(self) -> int:
        return self.region.dim

    @property
    def extent(self) -> int:
        return self.tensor.shape[self.region.dim]

    def view(self, frames: int) -> torch.Tensor:
        return self.tensor.narrow(self.region.dim, 0, frames)

    def holds(self, t: torch.Tensor) -> bool:
        """Is ``t`` exactly the carry's leading ``frames`` view (same address, layout, offset)?"""
        c = self.tensor
        return (t.data_ptr() == c.data_ptr() and t.dim() == c.dim()
                and all(t.shape[i] == c.shape[i] for i in range(c.dim()) if i != self.dim)
                and t.shape[self.dim] <= self.extent
                # the stride of a dim of size 1 is never used: views may set it either way
                and all(t.stride(i) == c.stride(i) for i in range(c.dim()) if t.shape[i] > 1))


@dataclasses.dataclass
class RegionBinding:
    region: Region
    placeholder: Optional[Node]      # the region's input in the traced graph
    out_index: Optional[int]         # position of the region's new state among the graph outputs
    carry: Carry
    carry_node: Optional[Node] = None  # placeholder through which the graph reaches the carry
    storages: set = dataclasses.field(default_factory=set)  # fake storages that are the carry


@dataclasses.dataclass
class PassContext:
    adapter: Adapter
    class_key: Any
    inputs: List[InputSpec]
    regions: List[RegionBinding]
    module_buffers: Dict[str, torch.Tensor]
    verify: bool = False
    auditor: Optional[CarryAuditor] = None   # the runtime's shadow auditor, with ``verify``
    # what the runtime builds the specs' objects with (``fusion.make_regions``,
    # ``replay.guard_pieces``); the passes do not read them
    backend: Any = None
    counters: Any = None
    strict: bool = False
    constant_ids: set = dataclasses.field(default_factory=set)  # declared constant attributes
    alias_state: bool = False   # ablation Rc: region inputs bound by address, without carries
    records: Records = dataclasses.field(default_factory=Records)   # for the report (``records.py``)
    specs: Specs = dataclasses.field(default_factory=Specs)   # for the runtime (``specs.py``)

    def placeholders(self, gm: GraphModule) -> List[Node]:
        return [n for n in gm.graph.nodes if n.op == "placeholder"]

    def add_placeholder(self, gm: GraphModule, name: str, spec: InputSpec) -> Node:
        last = self.placeholders(gm)[-1]
        with gm.graph.inserting_after(last):
            node = gm.graph.placeholder(name)
        self.inputs.append(spec)
        return node

    def drop_unused_placeholders(self, gm: GraphModule) -> int:
        dropped = 0
        for i, node in reversed(list(enumerate(self.placeholders(gm)))):
            if not node.users and self.inputs[i].kind in ("arg", "buffer", "param"):
                gm.graph.erase_node(node)
                del self.inputs[i]
                dropped += 1
        return dropped

    def note(self, kind: str, region: Optional[str], detail: str) -> None:
        """Record a rewrite of ``kind`` (``records.REWRITE_KINDS``), or a near miss."""
        self.records.add(NearMiss(region, detail) if kind == "near_miss"
                         else Rewrite(kind, region, detail))
