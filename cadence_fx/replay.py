"""Guarded pieces: the seam between a partitioned graph and a device-graph backend.

A piece either stays eager by construction, or is capturable. A capturable piece asks its backend
for a replay at its exact signature; the eager backend (CPU, or graphs switched off) has none, so
the piece runs its eager module -- the guarded eager path. Guards compare plain data recorded at
lowering time with the call: tensor signatures, and the addresses of fixed-address inputs.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .counters import Counters

__all__ = ["EagerBackend", "GuardedPiece"]

log = logging.getLogger(__name__)


class EagerBackend:
    """No device graphs: every capturable piece runs eagerly behind its guard."""
    name = "eager"

    def lower(self, piece: "GuardedPiece") -> Optional[Callable]:
        return None


class GuardedPiece(torch.nn.Module):
    def __init__(self, module: torch.fx.GraphModule, name: str, kind: str, reasons: Sequence[str],
                 fixed: Sequence[bool], backend, counters: Counters):
        super().__init__()
        self.module = module
        self.piece_name = name
        self.kind = kind                  # "graph" (capturable) or "eager"
        self.reasons = list(reasons)
        self.fixed = list(fixed)          # per input: contract-owned, fixed address (aliased)
        self.backend = backend
        self.counters = counters
        self.signature: Optional[Tuple] = None
        self.addresses: Optional[Tuple] = None
        self.replay: Optional[Callable] = None

    def forward(self, *args):
        if self.kind == "eager":
            self.counters.eager_pieces += 1
            return self.module(*args)
        if self.signature is None:
            self.signature = _signature(args)
            self.addresses = _addresses(args, self.fixed)
            self.replay = self.backend.lower(self)
        if self.replay is None:
            self.counters.guarded_eager += 1
            return self.module(*args)
        reason = self.guard(args)
        if reason is not None:
            self.counters.fallback(f"{self.piece_name}: {reason}")
            return self.module(*args)
        self.counters.replays += 1
        return self.replay(args)

    def guard(self, args) -> Optional[str]:
        """Why this call may not replay, or None. Plain comparisons against the recording."""
        sig = _signature(args)
        if sig != self.signature:
            return "signature differs from the captured one"
        if _addresses(args, self.fixed) != self.addresses:
            return "a fixed-address input moved"
        return None


def _signature(args) -> Tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else ("value", a) for a in args)


def _addresses(args, fixed) -> Tuple:
    return tuple(a.data_ptr() for a, f in zip(args, fixed) if f and isinstance(a, torch.Tensor))
