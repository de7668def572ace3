"""Counters every layer bumps, which tests assert on exactly and the report shows."""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Dict, Set

__all__ = ["Counters"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Counters:
    calls: int = 0            # calls of the compiled step
    compiled_calls: int = 0   # calls that ran the rewritten graph of a catalog class
    replays: int = 0          # graph pieces replayed from a captured device graph
    guarded_eager: int = 0    # capturable pieces run eagerly (no device graphs on this backend)
    eager_pieces: int = 0     # pieces that stay eager by construction (host syncs, audits, ...)
    fallbacks: int = 0        # calls or pieces sent to eager by a guard
    invalidations: int = 0    # classes dropped because a fixed address drifted
    absorptions: int = 0      # foreign state copied into a carry (first call, turn resets)
    adoptions: int = 0        # donated states that became their region's carry (donate_state)
    retentions: int = 0       # retention writes applied to a carry
    materializations: int = 0  # carry writes that copy the whole new state (no in-place form)
    applications: int = 0     # carry writes of any kind (retention, append, materialize)
    traces: int = 0           # signatures traced
    cache_loads: int = 0      # signatures loaded from the persistent compile cache, not traced
    compiled_loads: int = 0   # of which loaded compiled: no passes, no probationary call either
    lane_loads: int = 0       # classes thawed from another lane's compiled class (``lanes.py``)
    trace_copies: int = 0     # traces copied from a shared trace cache (another lane's) to compile
    copied_calls: int = 0     # repeated calls copied into a trace instead of traced again
    released_bytes: int = 0   # stock envelope storage freed now (``release_envelopes``)
    restored_bytes: int = 0   # envelope storage given back for good because the stock step ran
    primes_lent: int = 0      # declared priming calls that borrowed the released envelopes
    fused_regions: int = 0    # pointwise regions verified bit-exact and run fused (fuse_exact)
    fusions_refused: int = 0  # regions kept stock: fused bits differed, or compile or run failed
    fusions_loaded: int = 0   # of those, regions whose verdict (and code) came from the compile cache
    background_compiles: int = 0  # priming classes compiled in a background thread
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    addresses: Dict[str, Set[int]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(set))

    def fallback(self, reason: str) -> None:
        if reason not in self.reasons:
            log.info("eager fallback: %s", reason)
        self.fallbacks += 1
        self.reasons[reason] += 1

    @property
    def carry_addresses(self) -> int:
        """Distinct carry addresses handed out, worst region (1 when the state rule holds)."""
        return max((len(a) for a in self.addresses.values()), default=0)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("reasons", "addresses")}
        d["carry_addresses"] = self.carry_addresses
        d["reasons"] = dict(self.reasons)
        return d
