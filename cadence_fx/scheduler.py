"""A deadline scheduler: an asyncio serving loop over a ``SessionPool``'s lanes.

Chunks arrive for sessions at any time; each has a real-time deadline (its arrival plus the audio
it carries, ``period_ms``, unless given). The loop dispatches the chunk with the earliest deadline
to an idle lane (one chunk in flight per lane, a session's chunks in order), and never blocks on
the device: a dispatched chunk is only queued on its lane's CUDA stream, and completion is seen by
polling a CUDA event (``query()``), never by synchronizing. On the CPU a chunk is done when its
call returns. Per chunk it records the queueing (arrival to dispatch) and the latency (arrival to
completion seen), and whether the deadline was missed.

    sched = Scheduler(pool, period_ms=1000.0)
    sid = sched.open(prompt_state, seed=7)          # pool.open
    out = await sched.submit(sid, mu, spks, cond)   # the chunk's arguments, as pool.step takes
    sched.close(sid)
    sched.report()   # {"chunks", "latency_p50_ms", "latency_p99_ms", "deadline_misses", ...}

A server (a Ray Serve replica) owns one scheduler per pool and awaits ``submit`` from its request
handlers; ``run``/``done``/``lane`` replace the pool's step, completion event and lane for a
chunk that spans several pools (Token2Wav's flow and vocoder, on the same lane); chunks run
under ``modes()`` (default ``torch.inference_mode``: the modes are part of every class key);
``pools`` names every pool such a chunk runs through.

``Scheduler(pool, threads=True)`` queues each lane's chunks from a thread of that lane's own
instead of the loop's thread. Queuing a chunk of thousands of kernels can itself wait for the
device (the driver's launch queue is full: docs/sessions.md, Lanes); from the loop's thread that
wait holds the loop and every other lane, from a lane's thread only that lane (graph replays
release the GIL). Results are the same either way: a lane still runs one chunk at a time, a
session's chunks in order, and chunks of steps that draw device randomness are queued one at a
time (each lane draws from a generator state of its own on the device, ``SessionPool``).

What the loop cannot avoid it reports: a class met for the first time in traffic compiles inside
the dispatch, on the loop's thread, and every lane waits for it (with ``threads=True`` on the
lane's thread: the other lanes' replays go on, their stock calls and drawing chunks wait,
``cudagraphs.GLOBAL_STATE``); ``compiles`` and ``run_ms`` per chunk say so. Prepare such classes
before traffic with ``sessions.warm_lanes``. A lane whose step
compiles a priming class in the background takes no chunk until that is done (a chunk would wait
for the step's lock inside the loop). A result may be read on any stream right after ``await``
returns (before awaiting anything else): the lane's next chunk is dispatched after that.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import time
from typing import Callable, Deque, Dict, List, Optional

import torch

__all__ = ["Scheduler", "ChunkRecord"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ChunkRecord:
    sid: int
    lane: int
    arrival: float
    deadline: float
    dispatched: float = 0.0
    completed: float = 0.0
    run_ms: float = 0.0     # host time the dispatch took (the loop was blocked that long)
    compiles: int = 0       # classes met first by this chunk, compiled (or left stock) inline

    @property
    def latency_ms(self) -> float:
        return (self.completed - self.arrival) * 1e3

    @property
    def queued_ms(self) -> float:
        return (self.dispatched - self.arrival) * 1e3

    @property
    def missed(self) -> bool:
        return self.completed > self.deadline


@dataclasses.dataclass
class _Chunk:
    record: ChunkRecord
    args: tuple
    kwargs: dict
    future: asyncio.Future


@dataclasses.dataclass
class _InFlight:
    chunk: _Chunk
    queued: Optional[concurrent.futures.Future] = None   # the lane thread's dispatch (threads=True)
    event: Optional[object] = None                       # the lane's completion event (CUDA)
    out: object = None


class Scheduler:
    """Earliest-deadline-first dispatch of session chunks onto a pool's lanes (module docstring)."""

    def __init__(self, pool, *, period_ms: float = 1000.0, poll_ms: float = 0.2,
                 run: Optional[Callable] = None, done: Optional[Callable] = None,
                 lane: Optional[Callable[[int], int]] = None, clock=time.perf_counter,
                 modes: Callable = torch.inference_mode, pools: Optional[tuple] = None,
                 threads: bool = False):
        if period_ms <= 0 or poll_ms <= 0:
            raise ValueError(f"period_ms {period_ms} and poll_ms {poll_ms} must be positive: "
                             "a chunk's deadline is its arrival plus the audio it carries")
        self.pool = pool
        self.period_s, self.poll_s = period_ms / 1e3, poll_ms / 1e3
        self._run = run or pool.step
        self._done = done or pool.done
        self._lane = lane or pool.lane_of
        # the pools a chunk runs through (``run`` may span several): their compiles are counted
        # per chunk, and a lane whose step compiles in the background is not dispatched to
        self.pools = tuple(pools) if pools else (pool,)
        self.clock = clock
        # grad/inference/autocast modes are part of every class key: chunks run under ``modes()``
        # (the loop task does not inherit the submitter's)
        self.modes = modes
        self._queues: Dict[int, Deque[_Chunk]] = collections.defaultdict(collections.deque)
        self._in_flight: Dict[int, _InFlight] = {}
        # threads=True: one queuing thread per lane (module docstring), made on first use
        self.threads = threads
        self._lane_threads: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._order = itertools.count()
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.records: List[ChunkRecord] = []

    # -- the API -------------------------------------------------------------------------------
    def open(self, state=None, **kwargs) -> int:
        return self.pool.open(state, **kwargs)

    def close(self, sid: int) -> None:
        """Close a session; chunks of it still queued are cancelled. With lane threads the pool
        closes it on its lane's thread, after the chunk in flight there (a pool's lane
        bookkeeping is its chunks' too)."""
        for chunk in self._queues.pop(sid, ()):
            chunk.future.cancel()
        self.on_lane(sid, self.pool.close, sid)

    def reset(self, sid: int, state=None) -> None:
        """Turn boundary, ``pool.reset(sid, state)``: call it through the scheduler once the
        session's last chunk is awaited (with lane threads it runs on the session's lane thread,
        after the chunk in flight there and before the lane's next)."""
        self.on_lane(sid, self.pool.reset, sid, state)

    def on_lane(self, sid: int, fn: Callable, *args) -> None:
        """``fn(*args)`` where it cannot race the session's lane: with lane threads on that
        lane's thread, after the chunk in flight there and before the lane's next (not awaited;
        a failure is logged), else at once. For what changes a pool's sessions beside
        ``close``/``reset``, e.g. closing a session in every pool a chunk spans."""
        lane = self._lane(sid)   # an unknown session fails here, in the caller
        if lane not in self._lane_threads:
            fn(*args)
            return
        done = self._lane_threads[lane].submit(fn, *args)
        done.add_done_callback(lambda f: f.exception() and log.error(
            "%s of session %s failed on lane %s: %r", fn.__name__, sid, lane, f.exception()))

    def submit(self, sid: int, *args, deadline: Optional[float] = None, **kwargs) -> asyncio.Future:
        """Queue one chunk of session ``sid`` (the pool step's arguments); await the returned
        future for its output. ``deadline`` (on ``clock``) defaults to now + ``period_ms``."""
        loop = asyncio.get_running_loop()
        self._ensure_running(loop)
        now = self.clock()
        record = ChunkRecord(sid, self._lane(sid), now, now + self.period_s if deadline is None
                             else deadline)
        chunk = _Chunk(record, args, kwargs, loop.create_future())
        self._queues[sid].append(chunk)
        self._wake.set()
        return chunk.future

    async def drain(self) -> None:
        """Wait until every queued chunk is done."""
        while any(self._queues.values()) or self._in_flight:
            await asyncio.sleep(self.poll_s)

    async def stop(self) -> None:
        await self.drain()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for pool in self._lane_threads.values():
            pool.shutdown(wait=True)
        self._lane_threads.clear()

    def report(self) -> dict:
        """Per-chunk latency and queueing p50/p99 (ms), deadline misses, chunks per lane; the
        host time dispatches blocked the loop (``run_ms``) and the classes compiled during the
        run (``compiles``: each blocks every lane for its compile; prepare them before traffic,
        ``sessions.warm_lanes``), with the chunks that met them."""
        rs = self.records
        lat = sorted(r.latency_ms for r in rs)
        queued = sorted(r.queued_ms for r in rs)
        run = sorted(r.run_ms for r in rs)
        lanes = collections.Counter(r.lane for r in rs)
        return {"chunks": len(rs), "latency_p50_ms": _pct(lat, 0.5),
                "latency_p99_ms": _pct(lat, 0.99), "latency_max_ms": lat[-1] if lat else None,
                "queued_p50_ms": _pct(queued, 0.5), "queued_p99_ms": _pct(queued, 0.99),
                "run_ms_p50": _pct(run, 0.5), "run_ms_p99": _pct(run, 0.99),
                "run_ms_max": run[-1] if run else None,
                "deadline_misses": sum(r.missed for r in rs),
                "compiles": sum(r.compiles for r in rs),
                "compile_chunks": [{"sid": r.sid, "lane": r.lane, "compiles": r.compiles,
                                    "run_ms": round(r.run_ms, 1)} for r in rs if r.compiles],
                "chunks_per_lane": dict(sorted(lanes.items()))}

    # -- the loop ------------------------------------------------------------------------------
    def _ensure_running(self, loop) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            if self._complete():
                # the awaiting coroutines run first: what they queue on the current stream right
                # after ``await`` (reading a result) comes before the lanes' next chunks, which
                # wait for that stream (``Lane.running``) -- so a result may be read on any
                # stream, even a view of a carry the lane's next chunk writes
                await asyncio.sleep(0)
            self._dispatch()
            if self._in_flight:
                await asyncio.sleep(self.poll_s)   # poll the lanes' events
            elif not any(self._queues.values()):
                self._wake.clear()
                await self._wake.wait()
            else:   # queued chunks whose lanes compile in the background
                await asyncio.sleep(self.poll_s)

    def _complete(self) -> bool:
        """Resolve the chunks whose lane event has completed (``query``, never a sync);
        whether any was."""
        resolved = False
        for lane, flight in list(self._in_flight.items()):
            if flight.queued is not None:   # still being queued by its lane's thread
                if not flight.queued.done():
                    continue
                queued, flight.queued = flight.queued, None
                try:
                    flight.out, flight.event = queued.result()
                except Exception as e:  # noqa: BLE001 - the caller awaiting this chunk gets it
                    del self._in_flight[lane]
                    flight.chunk.record.completed = self.clock()
                    if not flight.chunk.future.done():   # (its caller may have given up)
                        flight.chunk.future.set_exception(e)
                    continue
            if flight.event is not None and not flight.event.query():
                continue
            del self._in_flight[lane]
            chunk = flight.chunk
            chunk.record.completed = self.clock()
            self.records.append(chunk.record)
            if not chunk.future.done():
                chunk.future.set_result(flight.out)
                resolved = True
        return resolved

    def _blocked(self) -> set:
        """Lanes that may not take a chunk now: one in flight, or a priming class compiling in
        the background on the lane's step (the chunk would block the loop on its lock)."""
        busy = set(self._in_flight)
        for p in self.pools:
            busy.update(i for i in range(len(p.lanes)) if p.compiling(i))
        return busy

    def _dispatch(self) -> None:
        """Earliest deadline first among each session's oldest chunk, one chunk per idle lane."""
        busy = self._blocked()
        heads = [(q[0].record.deadline, next(self._order), sid) for sid, q in self._queues.items()
                 if q and q[0].record.lane not in busy]
        heapq.heapify(heads)
        while heads:
            _, _, sid = heapq.heappop(heads)
            chunk = self._queues[sid][0]
            lane = chunk.record.lane
            if lane in busy:
                continue
            self._queues[sid].popleft()
            chunk.record.dispatched = self.clock()
            busy.add(lane)
            if self.threads:
                if lane not in self._lane_threads:
                    self._lane_threads[lane] = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix=f"cadence-lane{lane}")
                queued = self._lane_threads[lane].submit(self._queue, sid, chunk)
                self._in_flight[lane] = _InFlight(chunk, queued=queued)
                continue
            try:
                out, event = self._queue(sid, chunk)
            except Exception as e:  # noqa: BLE001 - the caller awaiting this chunk gets it
                chunk.record.completed = self.clock()
                if not chunk.future.done():   # (its caller may have given up)
                    chunk.future.set_exception(e)
                busy.discard(lane)
                continue
            self._in_flight[lane] = _InFlight(chunk, event=event, out=out)

    def _queue(self, sid: int, chunk: _Chunk) -> tuple:
        """Queue one chunk (on the loop's thread or its lane's): ``(output, completion event)``.
        Records the host time it took and the classes its lane met for the first time."""
        lane = chunk.record.lane
        met = self._compiles(lane)
        start = self.clock()
        try:
            with self.modes():
                out = self._run(sid, *chunk.args, **chunk.kwargs)
            return out, self._done(sid)
        finally:
            chunk.record.run_ms = (self.clock() - start) * 1e3
            chunk.record.compiles = self._compiles(lane) - met

    def _compiles(self, lane: int) -> int:
        """Classes met first in traffic on ``lane``, over every pool the chunks run through."""
        return sum(len(p.lanes[lane].compile_log) for p in self.pools if lane < len(p.lanes))


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
