"""The replica's one seam to the sessions: ``PoolEngine`` runs a served model's chunks through
one ``SessionPool`` per compiled step, each with ``lanes`` lanes.

The replica calls only ``open``, ``chunk``, ``reset``, ``close``, ``live``, ``warm`` and
``counters``; ``chunk`` returns the outputs (CPU tensors) and a ``ChunkRecord`` (time, whether a
step ran stock), which is all the replica's metrics read.

Threads. Every method may be called from several threads at once (the replica runs each request
in a worker thread). Opening, resetting and closing sessions hold one engine lock (resetting and
closing their lane's lock first). A session lives on one lane of every pool (the lane with the
fewest sessions when it opens), and a lane runs one chunk at a time under its own lock: a chunk
waits for the previous chunk of its lane to be done before it is queued, so a chunk's tensors
are never reused by the next one while the device still reads them. Chunks of different lanes
are queued from their threads at once: the queuing of one (which can wait for room in the
driver's launch queue) holds no other lane. What runs the module itself (the start states, the
stock step run eagerly; a call that falls back to stock), a class compile and a capture hold the
process-wide ``cudagraphs.GLOBAL_STATE`` alone, and a drawing chunk holds it shared, so nothing
computes on the module while a class of it traces (which swaps fake tensors into the module) or
while another stock call writes its buffers; drawing chunks are queued one at a time (each lane
draws from a generator state of its own, ``sessions.py``). Replays need none of it. On CUDA
(``SessionPool(..., lanes=L)`` queues each lane's work on its own stream and returns), a chunk
then waits for its own completion (asleep, on a blocking event), so chunks of other lanes are queued and run meanwhile; a chunk spanning several pools (Token2Wav's flow,
then HiFT) runs under its first pool's lane stream, which every later pool's lane waits for. On
the CPU a step returns when it is done.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from cadence_fx.cudagraphs import GLOBAL_STATE
from cadence_fx.sessions import SessionPool

from .models import ServedModel, Tensors

__all__ = ["PoolEngine", "ChunkRecord", "WORK"]

# the compile counters a warm start is judged by, summed over the model's steps and their lanes
WORK = ("traces", "cache_loads", "compiled_loads", "calls", "compiled_calls", "fallbacks")


@dataclasses.dataclass
class ChunkRecord:
    ms: float          # wall time of the chunk on the replica (its lane's wait and device work)
    fallbacks: int     # step calls of this chunk that ran the stock step


class PoolEngine:
    """Sessions of one ``ServedModel`` over one ``SessionPool`` per compiled step."""

    def __init__(self, model: ServedModel, lanes: int = 1):
        self.model = model
        self.pools = {name: SessionPool(cs, lanes=lanes) for name, cs in model.compiled.items()}
        self.lanes = lanes
        self._first = next(iter(self.pools.values()))
        self._ids: Dict[int, Dict[str, int]] = {}    # session -> its id in each pool
        self._prompts: Dict[int, Tensors] = {}
        self._next = 0
        self._lock = threading.RLock()
        self._lane_locks = [threading.Lock() for _ in range(lanes)]

    def open(self, prompt: Optional[Tensors] = None, seed: Optional[int] = None,
             lane: Optional[int] = None) -> int:
        """A new session on ``lane`` (default: the lane with the fewest sessions)."""
        with self._lock:
            # the start state is the stock step run eagerly, which writes the module's own
            # buffers: alone in the process (no compile, capture, stock call or draw meanwhile);
            # the pools' open after it (a session's generator state waits for another's draw)
            with GLOBAL_STATE.exclusive():
                states = self.model.start(prompt or {})
            if lane is None:
                lane = min(self._first.lanes, key=lambda x: (x.sessions, x.index)).index
            sid, self._next = self._next, self._next + 1
            self._ids[sid] = {n: p.open(states[n], seed=seed, lane=lane)
                              for n, p in self.pools.items()}
            self._prompts[sid] = prompt or {}
        return sid

    def reset(self, sid: int) -> None:
        """Turn boundary: the session starts again from its prompt (after its lane's chunk in
        flight: a pool's lane bookkeeping is its chunks' too)."""
        with self._lane_locks[self.lane_of(sid)], self._lock, GLOBAL_STATE.exclusive():
            ids = self._get(sid)
            states = self.model.start(self._prompts[sid])
            for n, pid in ids.items():
                self.pools[n].reset(pid, states[n])

    def close(self, sid: int) -> None:
        with self._lane_locks[self.lane_of(sid)], self._lock:
            for n, pid in self._get(sid).items():
                self.pools[n].close(pid)
            del self._ids[sid], self._prompts[sid]

    def lane_of(self, sid: int) -> int:
        with self._lock:
            return self._first.lane_of(next(iter(self._get(sid).values())))

    def chunk(self, sid: int, inputs: Tensors, last: bool = False) -> Tuple[Tensors, ChunkRecord]:
        start = time.perf_counter()
        with self._lock:
            ids, lane = self._get(sid), self.lane_of(sid)
        with self._lane_locks[lane]:   # one chunk in flight per lane
            before = self._lane_fallbacks(lane)
            outputs, done = self._queue(ids, inputs, last)
            fallbacks = self._lane_fallbacks(lane) - before
            if done is not None:
                done.synchronize()   # this thread only; other lanes go on
        return outputs, ChunkRecord((time.perf_counter() - start) * 1e3, fallbacks)

    def _lane_fallbacks(self, lane: int) -> int:
        """Stock calls so far of lane ``lane``'s steps (only its chunks move them)."""
        return sum(p.lanes[lane].compiled.counters.fallbacks for p in self.pools.values())

    def _queue(self, ids: Dict[str, int], inputs: Tensors, last: bool):
        """Queue one chunk's steps and its outputs' copies to the host: ``(outputs, event)``,
        the outputs valid once the event is done (no event on the CPU: they are)."""
        streams = [p.lanes[p.lane_of(ids[n])].stream for n, p in self.pools.items()]

        def run(name, *args, **kwargs):
            return self.pools[name].step(ids[name], *args, **kwargs)

        on_lane = contextlib.nullcontext()
        if streams[0] is not None:   # after the default stream's work (sessions' start states)
            streams[0].wait_stream(torch.cuda.current_stream())
            on_lane = torch.cuda.stream(streams[0])
        with torch.inference_mode(), on_lane:
            outputs = self.model.chunk(run, inputs, last)
            if streams[0] is None:
                return {k: v.detach().to("cpu", copy=True) for k, v in outputs.items()}, None
            here = torch.cuda.current_stream()
            for s in streams[1:]:
                here.wait_stream(s)
            host = {}
            for k, v in outputs.items():
                host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda)
                host[k].copy_(v.detach(), non_blocking=True)
            # blocking: the thread waiting for it sleeps. A plain event's wait spins its thread
            # on a core (one CUDA context on a many-core host spins by default), so L lanes'
            # waits would hold L cores busy while the replica's network threads and its clients'
            # wait to be scheduled
            done = torch.cuda.Event(blocking=True)
            done.record(here)
        return host, done

    def warm(self) -> Dict[str, float]:
        """Run the model's warm-up stream through a session of its own on every lane before
        traffic: every class it visits is compiled on each lane (loaded from the compile cache
        when it holds them). Returns what that took: the compile counters it moved and the
        seconds."""
        before = self.counters()
        start = time.perf_counter()
        for lane in range(self.lanes):
            sid = self.open(seed=0, lane=lane)
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
        with self._lock:
            return {k: self._total(k) for k in WORK}

    def _steps(self) -> List[object]:
        """Every compiled step: each pool's lanes (lane 0 is the model's own)."""
        return [lane.compiled for p in self.pools.values() for lane in p.lanes]

    def _total(self, field: str) -> int:
        return sum(getattr(cs.counters, field) for cs in self._steps())

    def _get(self, sid: int) -> Dict[str, int]:
        if sid not in self._ids:
            raise KeyError(f"no session {sid} on this replica (open: {sorted(self._ids)}); "
                           "open a new one")
        return self._ids[sid]
