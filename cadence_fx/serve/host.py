"""What a serving process does for itself, besides its sessions: how its threads share the
interpreter lock, when its garbage collector runs, and how late its event loop wakes.

A replica is one Python process whose threads share one interpreter lock (the GIL): its lanes'
threads queue chunks, its worker threads decode and encode messages, and its event loop receives
and sends them. Whatever holds the lock delays all the others, so a replica measures the two
things that hold it longest without doing a request's work:

- The collector. A compiled model is millions of Python objects (graphs, nodes, guards, captured
  graphs' holders), all made at start-up and alive for the process's life; every full collection
  walks them, holding the lock throughout. ``freeze_start_up`` moves them into the collector's
  permanent generation after the warm-up (``gc.freeze``, the practice of Python servers that
  keep a large heap: Instagram's Django), so later collections walk only what traffic made.
  ``GcPauses`` records every collection's pause.
- The event loop. ``LoopLag`` wakes every ``period_ms`` and records how late it woke: what the
  loop could not run meanwhile (a message to receive, a reply to send) waited as long.

What is frozen is counted once, when frozen: ``gc.get_freeze_count()`` walks the permanent
generation's list holding the GIL, ~235 ms for a Token2Wav replica's 2.3 million objects on the
H200's host, which every stats request paid (and the event loop with it) until 2026-12-03.

Nothing here imports Ray: ``bench/serve.py`` runs the same on its in-process path.
"""
from __future__ import annotations

import asyncio
import collections
import gc
import sys
import time
from typing import Deque, Optional, Tuple

import torch

from ..scheduler import _pct

__all__ = ["process_settings", "freeze_start_up", "GcPauses", "LoopLag", "percentiles"]


def process_settings(threads: Optional[int], switch_interval_ms: Optional[float]) -> None:
    """What a replica sets for its whole process: torch's CPU threads, and how long a thread
    holding the GIL keeps it while another asks (``sys.setswitchinterval``; Python's default is
    5 ms). The replica's worker threads run each chunk's Python, and its event loop needs the
    GIL for every message it receives or sends: a shorter interval hands it over sooner, at the
    price of more switching (docs/serving.md says what is measured)."""
    if switch_interval_ms is not None:
        if not switch_interval_ms > 0:
            raise ValueError(f"switch_interval_ms={switch_interval_ms!r}: give a positive number "
                             "of milliseconds (Python's default is 5), or None to leave it")
        sys.setswitchinterval(switch_interval_ms / 1e3)
    if threads:
        torch.set_num_threads(threads)


def freeze_start_up() -> int:
    """Collect what start-up left behind, then freeze every object alive (``gc.freeze``): later
    collections skip them. Returns how many objects are frozen. Call it once the model is built
    and warm: an object frozen is never collected, even once unreachable (a cycle made at
    start-up and dropped later stays in memory)."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()   # once: it walks every frozen object (the module says)
    return _frozen


_frozen = 0   # objects frozen by the last freeze_start_up (gc.unfreeze is not tracked)


def percentiles(xs, qs=(0.5, 0.99)) -> Tuple[Optional[float], ...]:
    """The ``qs`` quantiles of ``xs``, unsorted (nearest rank, as the scheduler's report; None
    when empty)."""
    xs = sorted(xs)
    return tuple(_pct(xs, q) for q in qs)


class GcPauses:
    """The collector's pauses (``gc.callbacks``): each held the thread that triggered it, and
    every other waiting for the GIL. Installed with ``with`` (a block) or ``install()`` (the
    process's life); keeps the last ``keep`` pauses and the totals since installed."""

    def __init__(self, keep: int = 4096):
        self.pauses: Deque[Tuple[float, int]] = collections.deque(maxlen=keep)
        self.collections = self.full = 0
        self.ms_total = self.ms_max = 0.0
        self._start: Optional[float] = None

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            ms = (time.perf_counter() - self._start) * 1e3
            self._start = None
            self.pauses.append((ms, info["generation"]))
            self.collections += 1
            self.full += info["generation"] == 2
            self.ms_total += ms
            self.ms_max = max(self.ms_max, ms)

    def install(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __enter__(self) -> "GcPauses":
        return self.install()

    def __exit__(self, *exc) -> bool:
        self.uninstall()
        return False

    def report(self) -> dict:
        return {"gc_collections": self.collections, "gc_full_collections": self.full,
                "gc_ms_total": self.ms_total, "gc_ms_max": self.ms_max,
                "gc_frozen_objects": _frozen}


class LoopLag:
    """How late the running event loop wakes from a ``period_ms`` sleep, sampled from
    ``start()`` until ``stop()`` (or the loop's end): the last ``keep`` samples (None: all)."""

    def __init__(self, period_ms: float = 10.0, keep: Optional[int] = 2048):
        self.period_ms = period_ms
        self.samples: Deque[float] = collections.deque(maxlen=keep)
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start sampling on the running loop (once; later calls return at once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample())

    async def stop(self) -> None:
        """Stop sampling (the samples stay)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _sample(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period_ms / 1e3)
            self.samples.append(max(0.0, (time.perf_counter() - t) * 1e3 - self.period_ms))

    def report(self) -> dict:
        p50, p99 = percentiles(self.samples)
        return {"loop_lag_ms_p50": p50, "loop_lag_ms_p99": p99,
                "loop_lag_ms_max": max(self.samples, default=None)}
