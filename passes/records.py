"""The records of one class's compile: what each pass did, for the report, explain, the counters
and the compile cache. One frozen dataclass per kind of record, and ``Records``, the container
the pass context holds, with one typed list per kind:

* ``Rewrite``: a graph rewrite of a region (or of the step, ``region=None``): its kind
  (``REWRITE_KINDS``) and what it did, in words (the carry pass, host checks, masked writes);
* ``NearMiss``: a rewrite that did not fire, and why;
* ``HoistedConstant``: a constant subgraph computed once (``hoist_constants``);
* ``Piece``: a piece of the partitioned graph (``shape_enumeration``), its inputs filled in by
  ``lower_guarded``;
* ``PassRun``: one pass the pipeline ran, its ``modified`` flag, node counts and seconds;
* ``LayoutRead``: an op reading a region's old state in a way whose bits depend on its layout
  (the carry pass);
* ``Fusion`` with its ``FusedRegionRecord``s: what exact fusion and its four preparing rewrites
  did (a field each, ``None`` where that rewrite did not run).

Besides the lists, ``Records`` holds the class's facts that are one value each: the unsplit graph,
the piece of each node, the catalog class, the probe's and the load's seconds and the predicted
staging bytes. ``Records.add`` refuses an object that is no kind of record, and ``Records`` has
no other attributes (slots): a pass that records something new adds its dataclass here.
``as_dict`` gives each record as the report prints it (the keys it always had).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

__all__ = ["REWRITE_KINDS", "Rewrite", "NearMiss", "HoistedConstant", "Piece", "PassRun",
           "LayoutRead", "FusedRegionRecord", "Fusion", "Records", "RECORD_KINDS"]

# the kinds of rewrite the passes record: carry writes (retention, append, materialize, in_place),
# the envelope of a region, a host check made once, a masked write
REWRITE_KINDS = ("retention", "append", "materialize", "in_place", "envelope", "host_check",
                 "mask_write")


class _Record:
    def as_dict(self) -> dict:
        """The record as the report prints it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class Rewrite(_Record):
    kind: str
    region: Optional[str]
    detail: str

    def __post_init__(self):
        if self.kind not in REWRITE_KINDS:
            raise ValueError(f"unknown rewrite kind {self.kind!r} (region {self.region}): a rewrite "
                             f"is one of {', '.join(REWRITE_KINDS)}; a new kind is added to "
                             "REWRITE_KINDS in passes/records.py")


@dataclasses.dataclass(frozen=True)
class NearMiss(_Record):
    region: Optional[str]
    detail: str

    @property
    def kind(self) -> str:
        return "near_miss"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "region": self.region, "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class HoistedConstant(_Record):
    name: str
    shape: Tuple[int, ...]
    dtype: str
    device: str
    host_to_device: bool
    source: str           # the node it replaced (``from`` in the report)

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype,
                "device": self.device, "host_to_device": self.host_to_device, "from": self.source}


@dataclasses.dataclass(frozen=True)
class Piece(_Record):
    name: str
    kind: str                        # "graph" | "eager"
    nodes: int
    reasons: Tuple[str, ...]         # why an eager piece is eager
    depends_on: Tuple[int, ...]
    inputs: Optional[int] = None     # from lower_guarded
    aliased_inputs: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class PassRun(_Record):
    name: str
    modified: bool
    nodes_before: int
    nodes_after: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class LayoutRead(_Record):
    region: str
    op: str


@dataclasses.dataclass(frozen=True)
class FusedRegionRecord(_Record):
    name: str
    kernels: int
    ops: Tuple[str, ...]
    writes: int


@dataclasses.dataclass(frozen=True)
class Fusion(_Record):
    """Exact fusion of one class; a field is ``None`` where its rewrite did not run."""
    skipped: Optional[str] = None                   # why fuse_exact made nothing
    regions: Tuple[FusedRegionRecord, ...] = ()
    writes_absorbed: Optional[int] = None
    inplace_made_functional: Optional[int] = None
    cats_in_place: Optional[int] = None
    cats_left: Optional[Dict[str, int]] = None      # copies of a cat left as they were, by reason
    conv_bias_split: Optional[int] = None
    norm_inputs_copied: Optional[int] = None


# the kinds kept in lists, and the list of ``Records`` each goes to
RECORD_KINDS = {Rewrite: "rewrites", NearMiss: "near_misses", HoistedConstant: "constants",
                Piece: "pieces", PassRun: "passes", LayoutRead: "reads"}
R = TypeVar("R")


@dataclasses.dataclass(slots=True)
class Records:
    rewrites: List[Rewrite] = dataclasses.field(default_factory=list)
    near_misses: List[NearMiss] = dataclasses.field(default_factory=list)
    constants: List[HoistedConstant] = dataclasses.field(default_factory=list)
    pieces: List[Piece] = dataclasses.field(default_factory=list)
    passes: List[PassRun] = dataclasses.field(default_factory=list)
    reads: List[LayoutRead] = dataclasses.field(default_factory=list)
    layouts_analysed: bool = False      # the carry pass looked for layout-dependent reads
    fusion: Optional[Fusion] = None
    graph: Any = None                   # the unsplit graph, for inspection (not stored)
    piece_of: Dict[str, int] = dataclasses.field(default_factory=dict)   # node -> piece
    catalog_class: Any = None
    probe_s: Optional[float] = None     # the probationary call
    load_s: Optional[float] = None      # a load from the compile cache
    staging_predicted: Optional[int] = None

    def add(self, record) -> None:
        """Append ``record`` to the list of its kind; anything else is refused."""
        name = RECORD_KINDS.get(type(record))
        if name is None:
            raise TypeError(f"{type(record).__name__} is not a kind of record: a record is one of "
                            f"{', '.join(k.__name__ for k in RECORD_KINDS)} (passes/records.py), "
                            "where a new kind gets its dataclass and its list")
        getattr(self, name).append(record)

    def of(self, kind: Type[R]) -> List[R]:
        """The records of ``kind``, in the order they were added."""
        if kind not in RECORD_KINDS:
            raise TypeError(f"{getattr(kind, '__name__', kind)} is not a kind of record: one of "
                            f"{', '.join(k.__name__ for k in RECORD_KINDS)}")
        return getattr(self, RECORD_KINDS[kind])

    @property
    def layout_reads(self) -> Optional[Dict[str, str]]:
        """Layout-dependent reads by region; None where the carry pass did not look."""
        return {r.region: r.op for r in self.reads} if self.layouts_analysed else None

    def update_fusion(self, **changes) -> Fusion:
        self.fusion = dataclasses.replace(self.fusion or Fusion(), **changes)
        return self.fusion

    def copy(self, **changes) -> "Records":
        """A copy with lists of its own (the records themselves are frozen), ``changes`` set."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update({k: list(v) for k, v in fields.items() if isinstance(v, list)})
        fields["piece_of"] = dict(self.piece_of)
        fields.update(changes)
        return Records(**fields)
