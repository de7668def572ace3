"""The replica's one seam to the sessions: ``PoolEngine`` runs a served model's chunks through
one ``SessionPool`` per compiled step, in the order they arrive.

The replica calls only ``open``, ``chunk``, ``reset``, ``close``, ``live``, ``warm`` and
``counters``; a scheduler with lanes and deadlines replaces this class behind the same methods,
and nothing else in the replica changes. ``chunk`` returns the outputs and a ``ChunkRecord``
(time, whether a step ran stock), which is all the replica's metrics read.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Tuple

import torch

from cadence_fx.sessions import SessionPool

from .models import ServedModel, Tensors

__all__ = ["PoolEngine", "ChunkRecord", "WORK"]

# the compile counters a warm start is judged by, summed over the model's steps
WORK = ("traces", "cache_loads", "compiled_loads", "calls", "compiled_calls", "fallbacks")


@dataclasses.dataclass
class ChunkRecord:
    ms: float          # wall time of the chunk on the replica (device work included)
    fallbacks: int     # step calls of this chunk that ran the stock step


class PoolEngine:
    """Sessions of one ``ServedModel`` over one ``SessionPool`` per compiled step."""

    def __init__(self, model: ServedModel):
        self.model = model
        self.pools = {name: SessionPool(cs) for name, cs in model.compiled.items()}
        self._ids: Dict[int, Dict[str, int]] = {}    # session -> its id in each pool
        self._prompts: Dict[int, Tensors] = {}
        self._next = 0

    def open(self, prompt: Optional[Tensors] = None, seed: Optional[int] = None) -> int:
        states = self.model.start(prompt or {})
        sid, self._next = self._next, self._next + 1
        self._ids[sid] = {n: p.open(states[n], seed=seed) for n, p in self.pools.items()}
        self._prompts[sid] = prompt or {}
        return sid

    def reset(self, sid: int) -> None:
        """Turn boundary: the session starts again from its prompt."""
        states = self.model.start(self._prompts[sid])
        for n, pid in self._get(sid).items():
            self.pools[n].reset(pid, states[n])

    def close(self, sid: int) -> None:
        for n, pid in self._get(sid).items():
            self.pools[n].close(pid)
        del self._ids[sid], self._prompts[sid]

    def chunk(self, sid: int, inputs: Tensors, last: bool = False) -> Tuple[Tensors, ChunkRecord]:
        ids = self._get(sid)
        before = self._total("fallbacks")
        start = time.perf_counter()

        def run(name, *args, **kwargs):
            return self.pools[name].step(ids[name], *args, **kwargs)

        with torch.inference_mode():
            outputs = self.model.chunk(run, inputs, last)
            outputs = {k: v.detach().to("cpu", copy=True) for k, v in outputs.items()}
        return outputs, ChunkRecord((time.perf_counter() - start) * 1e3,
                                    self._total("fallbacks") - before)

    def warm(self) -> Dict[str, float]:
        """Run the model's warm-up stream through a session of its own before traffic: every
        class it visits is compiled (loaded from the compile cache when it holds them). Returns
        what that took: the compile counters it moved and the seconds."""
        before = self.counters()
        start = time.perf_counter()
        sid = self.open(seed=0)
        try:
            for i, inputs in enumerate(self.model.warm_stream()):
                self.chunk(sid, inputs, last=i == self.model.warm_chunks - 1)
        finally:
            self.close(sid)
        after = self.counters()
        return dict({k: after[k] - before[k] for k in WORK},
                    seconds=round(time.perf_counter() - start, 3))

    @property
    def live(self) -> int:
        return len(self._ids)

    def holds(self, sid: int) -> bool:
        return sid in self._ids

    def counters(self) -> Dict[str, int]:
        return {k: self._total(k) for k in WORK}

    def _total(self, field: str) -> int:
        return sum(getattr(cs.counters, field) for cs in self.model.compiled.values())

    def _get(self, sid: int) -> Dict[str, int]:
        if sid not in self._ids:
            raise KeyError(f"no session {sid} on this replica (open: {sorted(self._ids)})")
        return self._ids[sid]
