"""Guarded pieces: the seam between a partitioned graph and a device-graph backend.

A piece either stays eager by construction, or is capturable. A capturable piece asks its backend
for a replay at its exact signature; the eager backend (CPU, or graphs switched off) has none, so
the piece runs its eager module -- the guarded eager path. Guards compare plain data recorded at
lowering time with the call: tensor signatures, and the addresses of fixed-address inputs.
``passes/lower_guarded.py`` says what each piece is (a ``PieceSpec``); ``guard_pieces`` builds the
``GuardedPiece``s from that.
"""
from __future__ import annotations

import contextlib

import logging
from typing import Callable, Optional, Sequence, Tuple

import torch

from .counters import Counters
from .errors import GuardError

__all__ = ["EagerBackend", "GuardedPiece", "guard_pieces"]

log = logging.getLogger(__name__)


# a captured graph reads its parameters, buffers and carries at the addresses of its capture
_MOVED_FIX = ("keep the parameters, buffers and state where they are between calls (no .to(), no "
              "reassigned tensors), or declare recapture_on_drift=True in the adapter to capture "
              "the class again at the new addresses")

class EagerBackend:
    """No device graphs: every capturable piece runs eagerly behind its guard."""
    name = "eager"

    def lower(self, piece: "GuardedPiece", args) -> Tuple[Optional[Callable], Optional[str]]:
        return None, None

    def side_stream(self):
        return contextlib.nullcontext()


class GuardedPiece(torch.nn.Module):
    """One piece of a class's graph: replayed when the backend captured it and the guard holds,
    eager otherwise -- by construction, on a guard miss, or after a failed capture."""

    def __init__(self, module: torch.fx.GraphModule, name: str, kind: str, reasons: Sequence[str],
                 fixed: Sequence[Optional[str]], mutated: Sequence[bool], escaping: Sequence[bool],
                 backend, counters: Counters, strict: bool = False, recapture: bool = True):
        super().__init__()
        self.module = module
        self.piece_name = name
        self.kind = kind                  # "graph" (capturable) or "eager"
        self.reasons = list(reasons)
        self.fixed_names = list(fixed)    # per input: the contract-owned storage it is, or None
        self.fixed = [f is not None for f in fixed]
        # the replay guard touches only these: staged inputs by signature, fixed ones by address
        self._staged = tuple(i for i, f in enumerate(self.fixed) if not f)
        self._aliased = tuple(i for i, f in enumerate(self.fixed) if f)
        self.mutated = list(mutated)      # per input: the piece writes it
        self.escaping = list(escaping)    # per output: it leaves the step
        self.backend = backend
        self.counters = counters
        self.strict = strict
        self.recapture = recapture
        self.signature: Optional[Tuple] = None
        self.addresses: Optional[Tuple] = None
        self.replay: Optional[Callable] = None
        self.eager_reason: Optional[str] = None
        self.staging_bytes = 0

    def forward(self, *args):
        if self.kind == "eager":
            self.counters.eager_pieces += 1
            return self.module(*args)
        if self.signature is None:
            self.signature = self._staged_signature(args)
            self.addresses = self._addresses(args)
            self.replay, self.eager_reason = self.backend.lower(self, args)
            if self.eager_reason:
                log.warning("%s stays eager: %s", self.piece_name, self.eager_reason)
        if self.replay is None:
            if self.eager_reason:
                return self._fallback(self.eager_reason, args)
            self.counters.guarded_eager += 1
            return self.module(*args)
        reason = self.guard(args)
        if reason is not None:
            return self._fallback(reason, args)
        self.counters.replays += 1
        return self.replay(args)

    def guard(self, args) -> Optional[str]:
        """Why this call may not replay, or None. Plain comparisons against the recording:
        the staged inputs' signatures, and the fixed-address inputs' ``data_ptr``."""
        if len(args) != len(self.fixed) or self._staged_signature(args) != self.signature:
            return "signature differs from the captured one"
        now = self._addresses(args)
        if now != self.addresses:
            moved = [n for n, a, b in zip([n for n in self.fixed_names if n], now, self.addresses)
                     if a != b]
            self.counters.invalidations += 1
            log.warning("%s invalidated: fixed-address input(s) %s moved", self.piece_name, moved)
            if hasattr(self.replay, "capture_stream"):   # which keeps it (capture_streams.py)
                self.replay.capture_stream.give_up(self.replay.graph)
            self.replay = None
            if self.recapture:  # capture again at the next call, at the new addresses
                self.signature = None
            else:
                self.eager_reason = f"fixed-address input(s) {moved} moved; re-capture is off"
            return f"fixed-address input(s) {moved} moved (invalidated)"
        return None

    def _fallback(self, reason: str, args):
        if self.strict:
            raise GuardError(f"strict mode: {self.piece_name}: {reason}; " + (
                _MOVED_FIX if "moved" in reason else
                "compile with graphs=False to run the piece on the guarded eager path, or "
                "without strict=True to let it run eagerly, counted in counters.reasons"))
        self.counters.fallback(f"{self.piece_name}: {reason}")
        return self.module(*args)


    def _staged_signature(self, args) -> Tuple:
        sig = []
        for i in self._staged:
            a = args[i]
            sig.append((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                       else ("value", a))
        return tuple(sig)

    def _addresses(self, args) -> Tuple:
        return tuple(args[i].data_ptr() for i in self._aliased if isinstance(args[i], torch.Tensor))


def guard_pieces(gm: torch.nn.Module, ctx) -> int:
    """Each piece of ``gm`` that ``lower_guarded`` specified (``ctx.specs.pieces``) behind its
    guard, on the class's backend (the eager one when it has none)."""
    backend = ctx.backend or EagerBackend()
    for spec in ctx.specs.pieces:
        setattr(gm, spec.name, GuardedPiece(
            getattr(gm, spec.name), spec.name, spec.kind, spec.reasons, spec.fixed, spec.mutated,
            spec.escaping, backend, ctx.counters, strict=ctx.strict,
            recapture=ctx.adapter.recapture_on_drift))
    return len(ctx.specs.pieces)
