"""The demo: one stream through the stock path and through cadence_fx, compared bit for bit.

Models (``--model``):

* ``token2wav`` (default): the real MiniCPM-o 4.5 / Step-Audio2 Token2Wav classes (conformer
  encoder, CFM with the DiT, 10 Euler steps, HiFT), random weights. On CUDA, and with ``--full``,
  at the real configuration (encoder 6 + 4 blocks, DiT depth 16); on the CPU by default at DiT
  depth 2 and encoder 1 + 1 blocks, the same code and state layout at a size a laptop runs in
  under a minute (``config`` says which ran). The prompt-priming pass (``setup_cache``, 302
  frames) runs eager by construction and is counted; then two turns of 28-token chunks, each
  turn restoring the prompt state and ending with a last (flush) chunk. Each chunk is the flow
  step then the HiFT step, each compiled on its own. On CUDA, deterministic kernels are pinned
  on both sides (stock HiFT is not reproducible without them).
* ``moshi``: Mimi encode + ``LMGen`` step + Mimi decode per 1920-sample frame (the loop of
  ``moshi/server.py``); the 7B LM on CUDA (and with ``--full``), a 2-layer LM of the same code on
  the CPU (``config`` says which). A turn boundary calls the stock ``reset_streaming``; the
  compiled step restarts from a fresh state.
* ``freeze-omni``: the streaming conv + chunked-attention encoder (24 x 1024), 16 fbank frames
  per call, a turn reset in the middle.
* ``toy``: a prompt-retained attention toy with a partial flush and a longer last call.

The compiled path runs the stream once to trace and capture its classes (on CUDA the stock path
once to warm up), then each path ``timed_passes`` times timed per chunk -- CUDA events on a GPU
(2 passes), ``perf_counter`` on the CPU (1 pass); progress on stderr names each chunk as it ends,
with an estimate of what is left. On the CPU the compiled path is the rewritten graph on the
guarded eager path (about stock speed): the result leads with exactness and memory and keeps the
times under ``timing``; on CUDA it replays CUDA graphs and the times are top-level keys. Every
key of the result is described in docs/benchmarks.md ("The demo's JSON").
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from . import progress
from .demo_streams import BUILDERS as _BUILDERS
from .demo_streams import _same

__all__ = ["run_demo", "MODELS"]

MODELS = tuple(_BUILDERS)


class _Clock:
    """Per-chunk latency: ``tick(i)`` before and after chunk i; ``done(i, ms)``, if given, after
    each chunk's second tick."""

    def __init__(self, dev: torch.device, done: Optional[Callable[[int, float], None]] = None):
        self.dev, self.times, self._open, self._done = dev, [], None, done

    def __call__(self, i: int) -> None:
        if self._open is None:
            if self.dev.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._open = start
            else:
                self._open = time.perf_counter()
            return
        if self.dev.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.times.append(self._open.elapsed_time(end))
        else:
            self.times.append((time.perf_counter() - self._open) * 1e3)
        self._open = None
        if self._done is not None:
            self._done(i, self.times[-1])


class _Progress:
    """Per-chunk progress of one path's passes on stderr: the chunk that just ended, its pass and
    time, and what is left of the path's passes at the mean chunk time so far. ``kinds`` names
    each pass (``warm-up``, ``timed``, or ``compiling``: a pass that compiles each new class, so
    not a steady chunk time); until a steady chunk is seen, the estimate uses ``guess_ms``."""

    def __init__(self, label: str, kinds: List[str], chunks: int,
                 guess_ms: Optional[float] = None):
        self.label, self.kinds, self.chunks, self.guess_ms = label, kinds, chunks, guess_ms
        self.steady: List[float] = []

    def clock(self, dev: torch.device, p: int) -> _Clock:
        return _Clock(dev, lambda i, ms: self._chunk(p, i, ms))

    def _chunk(self, p: int, i: int, ms: float) -> None:
        compiling = self.kinds[p] == "compiling"
        if not compiling:
            self.steady.append(ms)
        per = statistics.mean(self.steady) if self.steady else self.guess_ms
        left = len(self.kinds) * self.chunks - (p * self.chunks + i + 1)
        eta = ""
        if left and per is not None:
            eta = f"; about {_seconds(left * per / 1e3)} left"
        if compiling and i + 1 < self.chunks:
            eta += " plus compiling any new class"
        progress.note("demo %s: chunk %d/%d of pass %d/%d (%s) %.1f s%s", self.label, i + 1,
                      self.chunks, p + 1, len(self.kinds), self.kinds[p], ms / 1e3, eta,
                      running=True)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s" if s < 100 else f"{s / 60:.0f} min"


def _p95(xs) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


# -- the run ------------------------------------------------------------------------------------

# Timed passes per path: on CUDA several (a single pass's p50 swings with the machine's load);
# on the CPU one, after no warm-up pass on the stock side: the CPU's times are the guarded eager
# path's, not the product's figure, and a first run must stay under a minute.
TIMED_PASSES = {"cuda": 2, "cpu": 1}
WARM_UP_PASSES = {"cuda": 1, "cpu": 0}


def _passes(fn, dev, runs, bar: _Progress, skip: int = 0):
    """``runs`` passes of a stream, each chunk reported to ``bar``: their results, each pass's
    per-chunk times, and the allocator peak (CUDA) over the last one."""
    results, times = [], []
    for i in range(runs):
        if dev.type == "cuda" and i == runs - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = bar.clock(dev, skip + i)
        results.append(fn(clock))
        times.append(clock.times)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    return results, times, peak


def run_demo(model: str = "token2wav", device: str = "cpu", chunks: Optional[int] = None,
             verify: bool = True, full: Optional[bool] = None) -> Dict:
    """Run ``model``'s demo stream stock and compiled on ``device`` and return the result (keys
    in docs/benchmarks.md). ``full``: the model's real configuration (default on CUDA); the CPU
    default is a smaller one of the same code where the model has one."""
    if model not in _BUILDERS:
        raise ValueError(f"unknown demo model {model!r}; choose from {', '.join(MODELS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device")
    if full is None:
        full = dev.type == "cuda"
    if chunks is None:
        chunks = 16 if model == "toy" or dev.type == "cuda" else 4
    if chunks < 4:
        raise ValueError("a demo stream needs at least 4 chunks (two turns of two)")
    if model == "token2wav" and dev.type == "cuda":
        from .determinism import pin_deterministic_kernels
        pin_deterministic_kernels()
    kind = "cuda" if dev.type == "cuda" else "cpu"
    timed_passes, warm_up = TIMED_PASSES[kind], WARM_UP_PASSES[kind]
    progress.note("demo %s on %s: building the model ...", model, dev.type, running=True)
    stream = _BUILDERS[model](dev, chunks, full=full)
    full_size = stream.config.get("full_size")
    progress.note("demo %s: %s configuration%s", model, stream.config["size"],
                  f" (--full: {full_size})" if full_size else "")
    stock_bar = _Progress(f"{model} stock", ["warm-up"] * warm_up + ["timed"] * timed_passes,
                          stream.chunks)
    stock_runs, stock_times, stock_peak = _passes(stream.stock, dev, warm_up + timed_passes,
                                                  stock_bar)
    stock_times = stock_times[warm_up:]
    stock_p50 = statistics.median(sum(stock_times, []))
    progress.note("demo %s: stock p50 %.1f ms per chunk", model, stock_p50)
    if stream.prepare_compiled is not None:
        stream.prepare_compiled()
    bar = _Progress(f"{model} compiled", ["compiling"] + ["timed"] * timed_passes, stream.chunks,
                    guess_ms=stock_p50)
    first = stream.compiled(bar.clock(dev, 0))               # traces and captures here
    warm = {n: (s.counters.replays, s.counters.fallbacks) for n, s in stream.steps.items()}
    timed, times, compiled_peak = _passes(stream.compiled, dev, timed_passes, bar, skip=1)
    progress.note("demo %s: compiled p50 %.1f ms per chunk", model,
                  statistics.median(sum(times, [])))
    ref = stock_runs[-1]
    runs = [first, *timed]
    equal = stream.equal or _same
    if verify and stream.audit is not None:  # the shadow auditor on every carry write (syncs)
        progress.note("demo %s: the shadow audit pass (every carry write checked) ...", model,
                      running=True)
        runs.append(stream.extra["audit_run"](lambda i: None))
    bit_exact = all(len(r) == len(ref) and all(map(equal, ref, r)) for r in runs)
    steps = _steps(stream, warm)
    exact = {"bit_exact": bit_exact,
             "bit_exact_chunks": sum(equal(a, b) for a, b in zip(ref, timed[-1])),
             "chunks": stream.chunks}
    memory = _memory(dev, stream, stock_peak, compiled_peak)
    counters = _counters(stream, steps, verify)
    timing = _timing(timed_passes, stock_times, times)
    where = {"model": model, "device": str(dev), "config": stream.config}
    return _layout(dev.type, where, exact, memory, counters, timing)


def _steps(stream, warm) -> Dict:
    """Per compiled step: its calls, replays and fallbacks (steady: after the compiling pass),
    classes, traces, pieces and memory."""
    steps = {}
    for name, s in stream.steps.items():
        c = s.counters
        steps[name] = {"calls": c.calls, "replays": c.replays, "fallbacks": c.fallbacks,
                       "steady_replays": c.replays - warm[name][0],
                       "steady_fallbacks": c.fallbacks - warm[name][1],
                       "classes": len(s.classes), "traces": c.traces,
                       "eager_pieces": c.eager_pieces, "guarded_eager": c.guarded_eager,
                       "memory": s.report().memory()}
    return steps


def _memory(dev, stream, stock_peak, compiled_peak) -> Dict:
    if dev.type == "cuda":
        # the allocator's peak during the timed pass of each path (weights included)
        memory = {"stock_peak_bytes": stock_peak, "compiled_peak_bytes": compiled_peak,
                  "peak_bytes_kind": "max_memory_allocated"}
    else:
        # torch reports no CPU allocator peak: the bytes of state each path keeps resident
        carries = sum(c.tensor.numel() * c.tensor.element_size()
                      for s in stream.steps.values() for c in s.carries.values())
        memory = {"stock_peak_bytes": stream.extra.get("resident_stock"),
                  "compiled_peak_bytes": carries, "peak_bytes_kind": "resident_state"}
    memory["carry_addresses"] = max(s.counters.carry_addresses for s in stream.steps.values())
    if "addresses" in stream.extra:
        memory["stock_state_addresses"] = len(stream.extra["addresses"]["stock"])
    return memory


def _counters(stream, steps, verify: bool) -> Dict:
    total = lambda key: sum(getattr(s.counters, key) for s in stream.steps.values())  # noqa: E731
    counters = {
        "retentions": total("retentions"),
        "replays": total("replays"), "fallbacks": total("fallbacks"),
        "steady_replays": sum(s["steady_replays"] for s in steps.values()),
        "steady_fallbacks": sum(s["steady_fallbacks"] for s in steps.values()),
        "invalidations": total("invalidations"), "traces": total("traces"),
        "per_invocation": dict(stream.priming or {}, **steps),
        "fallback_reasons": {k: v for s in stream.steps.values()
                             for k, v in s.counters.reasons.items()},
    }
    if verify and stream.audit is not None:
        counters["audited_writes"] = sum(stream.audit.auditor.comparisons.values())
    return counters


def _timing(timed_passes: int, stock_times, times) -> Dict:
    stock_p50 = statistics.median(sum(stock_times, []))
    # stock pass i against compiled pass i: how far one pass's figure can be trusted
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(stock_times, times)]
    return {
        "timed_passes": timed_passes,
        "stock_ms_p50": stock_p50, "compiled_ms_p50": statistics.median(sum(times, [])),
        "stock_ms_p95": _p95(sum(stock_times, [])), "compiled_ms_p95": _p95(sum(times, [])),
        "speedup_p50": stock_p50 / statistics.median(sum(times, [])),
        "stock_ms_p50_per_pass": [statistics.median(t) for t in stock_times],
        "compiled_ms_p50_per_pass": [statistics.median(t) for t in times],
        "speedup_p50_spread": [min(ratios), max(ratios)],
    }


CPU_TIMING_NOTE = ("on the CPU the compiled path runs its rewritten graphs eagerly (no device "
                   "graphs): expect about stock speed, and these times are not the speed-up, "
                   "which is a GPU figure (--device cuda)")


def _layout(device_type: str, where: Dict, exact: Dict, memory: Dict, counters: Dict,
            timing: Dict) -> Dict:
    """The result in the order its reader wants: on CUDA the stream, exactness, then the times
    as top-level keys; on the CPU, whose times are no headline, exactness and memory first and
    the times nested under ``timing`` with the note that says why."""
    if device_type == "cuda":
        return {**where, **exact, **timing, **memory, **counters}
    return {**exact, **memory, **where, **counters,
            "timing": {"note": CPU_TIMING_NOTE, **timing}}
