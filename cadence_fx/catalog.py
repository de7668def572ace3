"""The catalog: every signature class a stream can reach, derived from the adapter alone (§3.3-3.5).

Each region's attended extent follows its retention policy call by call; simulating the declared
clocks until every region reaches its fixed point yields the finite set of extents per region
(``K_r`` of Criterion 3.5) and the joint classes the step will see. Memory is priced from the same
numbers: the stock envelope against the declared extent (over-reservation ratio rho, eq. 2) and the
staging a replay engine needs with and without a contract-owned carry (eq. 6).
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

from .errors import ContractError
from .contract import Adapter, PromptRetained, Region, Ring, SlidingWindow

__all__ = ["RegionCatalog", "Catalog", "build_catalog", "region_room", "calls_in_region_units",
           "format_bytes"]


@dataclasses.dataclass(frozen=True)
class RegionCatalog:
    name: str
    extents: Tuple[int, ...]      # attended extents entering a call, in order of first appearance
    lower: int                    # A-: extent once the policy has fired (or the first extent)
    bound: int                    # A: the retention bound
    stride: int                   # s: frames the extent advances per call
    K: int                        # catalog width, eq. (7)
    admissible: bool              # Criterion 3.5: K <= the adapter's width limit
    declared_extent: int          # A-dagger: frames the carry must hold (room included)
    room: int                     # frames beyond the retention bound: the most one call appends
                                  # before the window drops old ones (``region_room``)
    stock_bytes: Optional[int]    # bytes of the stock envelope, if declared
    declared_bytes: Optional[int]  # bytes at the declared extent
    staging_bytes_aliased: Optional[int]    # eq. (6) with the carry aliased: envelope only
    staging_bytes_unaliased: Optional[int]  # eq. (6) without a carry: a stock envelope + a clone per class

    @property
    def rho(self) -> Optional[float]:
        """Over-reservation ratio (eq. 2): stock envelope bytes over declared bytes."""
        if self.stock_bytes is None or not self.declared_bytes:
            return None
        return self.stock_bytes / self.declared_bytes

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["extents"] = list(self.extents)
        d["rho"] = self.rho
        return d


@dataclasses.dataclass(frozen=True)
class Catalog:
    adapter: str
    regions: Tuple[RegionCatalog, ...]
    call_widths: Tuple[int, ...]
    classes: Tuple[Tuple[Tuple[int, ...], int], ...]  # ((extent per region...), call width)
    admissible: bool

    @property
    def size(self) -> int:
        return len(self.classes)

    def region(self, name: str) -> RegionCatalog:
        for r in self.regions:
            if r.name == name:
                return r
        raise ContractError(f"catalog of {self.adapter!r} has no region {name!r}; use one "
                            f"of its regions: {', '.join(r.name for r in self.regions)}")

    def as_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "catalog_size": self.size,
            "admissible": self.admissible,
            "call_widths": list(self.call_widths),
            "regions": [r.as_dict() for r in self.regions],
            "classes": [{"extents": list(e), "width": w} for e, w in self.classes],
        }


def _step(adapter: Adapter, r: Region, extent: Optional[int]) -> int:
    """The attended extent of the next call, given this call's (None: the first call)."""
    pol, s = r.retention, adapter.clocks[r.advance]
    if isinstance(pol, Ring):
        return adapter.clocks[pol.window]
    if isinstance(pol, PromptRetained):
        p, keep = adapter.clocks[pol.prompt], adapter.clocks[pol.retained]
        return p if extent is None else min(extent + s, p + keep)
    start = 0 if pol.start is None else adapter.clocks[pol.start]
    return start if extent is None else min(extent + s, adapter.clocks[pol.window])


def _walk(adapter: Adapter) -> List[Tuple[int, ...]]:
    """Extents of every region, call by call, until all regions stop changing."""
    state = tuple(_step(adapter, r, None) for r in adapter.regions)
    seen = [state]
    while True:
        nxt = tuple(_step(adapter, r, e) for r, e in zip(adapter.regions, state))
        if nxt == state:
            return seen
        seen.append(nxt)
        state = nxt


def _bytes(adapter: Adapter, r: Region, shape, frames: int) -> Optional[int]:
    if not shape:
        return None
    sizes = [frames if i == r.dim else adapter.dim_size(d, r) for i, d in enumerate(shape)]
    return math.prod(sizes) * r.element_bytes


def calls_in_region_units(adapter: Adapter, r: Region) -> bool:
    """Do the adapter's call widths count the region's frames? They do when the region advances
    by a call clock (or the admission clock), or by the gcd of the call widths (the advance the
    docs prescribe for a stream of several widths). Otherwise the call is read in other units
    (Token2Wav's tokens, HiFT's mel frames against its sample caches) and says nothing here."""
    widths = adapter.call_widths()
    if not widths:
        return False
    if r.advance in adapter.call_frames or r.advance == adapter.admission:
        return True
    return adapter.clocks[r.advance] == math.gcd(*widths)


def region_room(adapter: Adapter, r: Region) -> Tuple[int, str]:
    """Frames of room the carry holds beyond the retention bound, and where the number comes
    from: ``"room"`` (the declared clock), ``"calls"`` (the widest call the adapter admits),
    ``"advance"`` or ``"none"``.

    A sliding window appends a call's frames before it drops old ones, and stock code that
    writes the pre-retention state into an envelope does the same: they get room by default,
    the most frames one call adds. A declared ``room`` is honoured on a prompt-retained region
    too (a cache that grows by concatenation before its cut); a ring has none (``validate``
    refuses one)."""
    if isinstance(r.retention, Ring):
        return 0, "none"
    if r.room is not None:
        return adapter.clocks[r.room], "room"
    if not (r.envelope or isinstance(r.retention, SlidingWindow)):
        return 0, "none"
    if calls_in_region_units(adapter, r):
        admitted = [adapter.clocks[adapter.admission]] if adapter.admission else []
        return max([*adapter.call_widths(), *admitted]), "calls"
    return adapter.clocks[r.advance], "advance"


def build_catalog(adapter: Adapter) -> Catalog:
    """Derive extents, K, verdicts, prices and the joint classes from the declarations alone."""
    adapter.validate()
    walk = _walk(adapter)
    widths = adapter.call_widths() or (adapter.clocks[adapter.regions[0].advance],)
    regions = []
    for i, r in enumerate(adapter.regions):
        extents = tuple(dict.fromkeys(step[i] for step in walk))
        s = adapter.clocks[r.advance]
        lower, bound = min(extents), max(extents)
        K = len(extents)
        room, _ = region_room(adapter, r)
        declared = bound + room
        stock = None
        if r.stock_shape is not None:
            stock = math.prod(adapter.dim_size(d, r) for d in r.stock_shape) * r.element_bytes
        declared_b = _bytes(adapter, r, r.shape, declared)
        unaliased = None
        if declared_b is not None:
            per_class = sum(_bytes(adapter, r, r.shape, e) for e in extents)
            unaliased = (stock if stock is not None else declared_b) + per_class
        regions.append(RegionCatalog(
            name=r.name, extents=extents, lower=lower, bound=bound, stride=s, K=K,
            admissible=K <= adapter.width_limit, declared_extent=declared, room=room,
            stock_bytes=stock, declared_bytes=declared_b,
            staging_bytes_aliased=declared_b, staging_bytes_unaliased=unaliased))
    joint = list(dict.fromkeys(walk))
    classes = tuple((e, w) for e in joint for w in widths)
    return Catalog(adapter=adapter.name, regions=tuple(regions), call_widths=tuple(widths),
                   classes=classes, admissible=all(r.admissible for r in regions))


def format_bytes(n: Optional[int]) -> str:
    """A price for people: ``-`` when unknown, else bytes in the largest unit that fits."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
