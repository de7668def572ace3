"""A device-graph backend on the CPU, so that the replay guard runs where there is no device:
the CPU tests, and ``bench/stale_check.py`` measuring the replay path's host cost on the CPU.

``StandInBackend.lower`` "captures" a piece the way ``cudagraphs.CudaGraphBackend`` does, minus
the device: staged inputs get static buffers at the layout seen at capture, and fixed-address
inputs (carries, parameters, buffers) are bound to the storage they had at capture. A replay
copies the staged inputs in and runs the piece on the static buffers and the bound storage. So a
replay the guard should have refused reads what a real graph would read: a weight's old storage
after the caller re-allocated it, a staged input at the captured layout whatever the call's.
Every capture is recorded; ``fail`` makes captures fail with that exception's reason (or, when it
is a callable, with the exception it returns at that capture, none for a capture that succeeds).
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

__all__ = ["StandInBackend", "Capture"]


@dataclasses.dataclass(frozen=True)
class Capture:
    piece: str
    staged: Tuple[tuple, ...]        # (shape, stride, dtype) of each staged tensor input
    fixed: Tuple[Tuple[str, int], ...]  # (name, data_ptr) of each fixed-address input


class StandInBackend:
    name = "stand-in"

    def __init__(self, fail=None):
        self.fail = fail
        self.captures: List[Capture] = []
        self.failures: List[str] = []

    @property
    def captured(self) -> int:
        return len(self.captures)

    def lower(self, piece, args):
        fail = self.fail() if callable(self.fail) else self.fail
        if fail is not None:
            reason = f"capture failed: {type(fail).__name__}: {fail}"
            self.failures.append(f"{piece.piece_name}: {reason}")
            return None, reason
        static, bound = {}, {}
        for i, (a, fixed) in enumerate(zip(args, piece.fixed)):
            if not isinstance(a, torch.Tensor):
                continue
            if fixed:
                bound[i] = a.detach()   # this storage, wherever the caller's tensor goes later
            else:
                static[i] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        self.captures.append(Capture(
            piece.piece_name,
            tuple((tuple(s.shape), s.stride(), s.dtype) for s in static.values()),
            tuple((piece.fixed_names[i], t.data_ptr()) for i, t in bound.items())))
        written = [i for i in static if piece.mutated[i]]

        def replay(call_args):
            for i, s in static.items():
                s.copy_(call_args[i])
            run = [static[i] if i in static else bound.get(i, a) for i, a in enumerate(call_args)]
            with torch.no_grad():
                outs = piece.module(*run)
            for i in written:   # a staged input written in place: copied back, as on the device
                call_args[i].copy_(static[i])
            return outs

        return replay, None
