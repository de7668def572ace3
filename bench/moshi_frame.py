"""Moshi full frame on one GPU: stock eager, the vendor's own CUDA-graph path, and cadence_fx.

    python bench/moshi_frame.py --out moshi.json [--streams 8] [--frames 12] [--small]
                                [--configs E,cadence,V] [--ref e-outputs.pt] [--no-fuse]

A frame is what ``moshi/server.py`` does per 1920 samples: Mimi encode, ``LMGen.step`` (7B LM,
bf16, sampling with top-k), Mimi decode of the generated audio tokens. Each stream has a turn
boundary in the middle (``reset_streaming`` for the stock paths, a fresh state for cadence_fx)
and starts from its own seed, so the three paths draw the same random numbers.

Configurations, in the order E, cadence_fx, V, all in one process (the compiled step is closed --
its modules leave streaming -- and its carries and graphs are freed before V runs; each row
records what was allocated when its peak was reset), or each in a process of its own
(``--configs`` names the rows a process runs; E writes its outputs to ``--ref``, the others read
them there; ``bench/suite_moshi.py`` runs them so):

* ``E``: stock eager (the vendor's ``CUDAGraphed`` and lazy ``torch.compile`` switched off by its
  own switches) -- the bit-exact reference.
* ``V``: the vendor path as shipped: ``CUDAGraphed`` Mimi encoder/decoder/transformers and LM
  main/depth steps, with its lazy ``torch.compile`` of rope, RMS norm and gating. Streaming is
  entered once and reset between streams, as a server does; a warm-up stream captures first.
* ``cadence``: ``MoshiStep`` compiled by cadence_fx as shipped (exact fusion on; ``--no-fuse``
  without it), the state donated as a server gives it (``donate_state=True``: the rings become
  the carries; ``--no-donate`` copies them); a warm-up stream traces, fuses and captures.

Per configuration: per-frame p50/p95 (CUDA events, timed streams only), frames bit-exact against
E (``torch.equal`` on PCM and tokens), peak memory (``max_memory_allocated``/``memory_reserved``
over the timed streams; ``process_peak_bytes``: the most the process has had allocated since it
started, model, compile and capture included -- the number to compare with rows in processes
of their own; for cadence_fx also ``compile_peak_bytes``, that peak right after its warm-up
stream, and ``memory``, the report's breakdown of what it holds: carries, private buffers, the
captured graphs' pool), and the kernel-time floor of E (the profiler's sum of GPU kernel time per
frame over the first six frames of a stream); for cadence_fx also its own kernel time and kernels
per frame over the same six frames (``kernel_ms``, ``kernels``) and the device graphs launched per
timed frame (``graph_launches_per_frame``).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time

import torch

import cadence_fx
from cadence_fx.models import moshi as M
from common import median, p95, parser, write_result


CUDA = torch.cuda.is_available()   # without CUDA (a smoke test of this script): host clocks


class Ticks:
    def __init__(self):
        self.times, self._start = [], None

    def __call__(self, i):
        if self._start is None:
            if CUDA:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._start = time.perf_counter()
        elif CUDA:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            self.times.append(self._start.elapsed_time(end))
            self._start = None
        else:
            self.times.append((time.perf_counter() - self._start) * 1e3)
            self._start = None


def seed(s):
    torch.manual_seed(s)
    if CUDA:
        torch.cuda.manual_seed(s)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def memory():
    if not CUDA:
        return {"peak_bytes": None, "reserved_bytes": None}
    return {"peak_bytes": torch.cuda.max_memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
            "allocated_at_start_bytes": _start["allocated"]}


def process_peak():
    """The most this process has had allocated on the device since it started (model included),
    across the peak resets of the rows."""
    if not CUDA:
        return None
    _start["process_peak"] = max(_start.get("process_peak", 0), torch.cuda.max_memory_allocated())
    return _start["process_peak"]


def reset_peak():
    if CUDA:
        torch.cuda.synchronize()
        process_peak()
        torch.cuda.reset_peak_memory_stats()
        _start["allocated"] = torch.cuda.memory_allocated()


_start = {"allocated": None}   # allocated when the row's peak was reset (what it inherits)


def stock_streams(mimi, lm_gen, streams, reset_at, as_shipped, ticks=None, warm=()):
    """The stock loop over several streams in one streaming session, reset between streams, as a
    server runs it. ``warm`` streams run first, untimed and not returned (the vendor path
    captures its graphs then); the allocator peak is reset after them."""
    vendor = M.import_stock().compile
    outs = []
    with contextlib.ExitStack() as stack:
        if not as_shipped:
            stack.enter_context(vendor.no_cuda_graph())
            stack.enter_context(vendor.no_compile())
        stack.enter_context(mimi.streaming(1))
        stack.enter_context(lm_gen.streaming(1))
        for s, frames in enumerate([*warm, *streams]):
            timed_stream = s >= len(warm)
            seed(100 + s - len(warm) if timed_stream else 100)
            mimi.reset_streaming()
            lm_gen.reset_streaming()
            stream = []
            for i, frame in enumerate(frames):
                if i == reset_at:
                    mimi.reset_streaming()
                    lm_gen.reset_streaming()
                if ticks and timed_stream:
                    ticks(i)
                with torch.no_grad():
                    tokens = lm_gen.step(mimi.encode(frame))
                    pcm = None if tokens is None else mimi.decode(tokens[:, 1:])
                if ticks and timed_stream:
                    ticks(i)
                stream.append((None if pcm is None else pcm.clone(),
                               None if tokens is None else tokens.clone()))
            if timed_stream:
                outs.append(stream)
            elif s == len(warm) - 1:
                reset_peak()
    return outs


_held = {}   # the state the compiled step last returned: later streams reset it in place


def cadence_streams(step, compiled, streams, reset_at, ticks=None):
    """As a server runs it: one state for the step's lifetime, reset in place at every new stream
    and turn (a second ``initial_state()`` would allocate a whole second state beside it)."""
    outs = []
    for s, frames in enumerate(streams):
        seed(100 + s)
        state = step.reset_state(_held["state"]) if "state" in _held else step.initial_state()
        stream = []
        for i, frame in enumerate(frames):
            if i == reset_at:   # in place, as the stock loop's reset_streaming
                state = step.reset_state(state)
            if ticks:
                ticks(i)
            with torch.no_grad():
                pcm, tokens, state = compiled(frame, state)
            if ticks:
                ticks(i)
            stream.append((None if pcm is None else pcm.clone(),
                           None if tokens is None else tokens.clone()))
        _held["state"] = state
        outs.append(stream)
    return outs


def same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def exact_frames(ref, got):
    return sum(same(a, b) for sa, sb in zip(ref, got) for a, b in zip(sa, sb))


def timed(fn):
    reset_peak()
    ticks = Ticks()
    t0 = time.perf_counter()
    outs = fn(ticks)
    sync()
    return outs, {"p50_ms": median(ticks.times), "p95_ms": p95(ticks.times),
                  **memory(), "frames": len(ticks.times), "wall_s": time.perf_counter() - t0}


def kernel_floor_ms(fn, frames, row=None):
    """Sum of GPU kernel time per frame over ``frames`` frames of ``fn`` (torch.profiler), and
    kernels per frame; with ``row``, also its ``kernel_top`` and ``kernel_kinds`` (by name)."""
    if not CUDA:
        return None, None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    avg = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    if row is not None:
        from suite_measure import kernel_kinds, top_kernels
        by_kernel = {e.key: (e.device_time_total / 1e3, e.count) for e in avg}
        row["kernel_top"] = top_kernels(by_kernel, {}, frames)
        row["kernel_kinds"] = kernel_kinds(by_kernel, {}, frames)
    total_us = sum(e.device_time_total for e in avg)
    kernels = sum(e.count for e in avg)
    return total_us / 1e3 / frames, kernels / frames


class PhasePeaks:
    """Which part of a cold compile holds the most device memory: each phase's peak
    ``max_memory_allocated`` and what was allocated when it began (``phases``), by wrapping the
    compiler's trace, probationary call, passes, eager warm-ups (verifications of fused regions
    included), region verifications and captures. The peak is reset at every phase boundary, so
    the process peak is kept up to date through ``process_peak`` on the way."""

    WRAPPED = (("cadence_fx.class_compiler", None, "trace_step", "trace"),
               ("cadence_fx.class_compiler", None, "probe_effects", "probe"),
               ("cadence_fx.class_compiler", None, "run_pipeline", "passes"),
               ("cadence_fx.cudagraphs", "CudaGraphBackend", "_warm_up", "warm-up"),
               ("cadence_fx.cudagraphs", "CudaGraphBackend", "_capture", "capture"),
               ("cadence_fx.fusion", "FusedRegion", "verify", "region verify"))

    def __init__(self):
        self.phases = {}
        self._stack = []   # [name, peak so far] of the phases entered
        self._undo = []

    def __enter__(self):
        import importlib
        for module, owner, attr, name in self.WRAPPED:
            obj = importlib.import_module(module)
            obj = getattr(obj, owner) if owner else obj
            original = getattr(obj, attr)
            setattr(obj, attr, self._wrap(original, name))
            self._undo.append((obj, attr, original))
        return self

    def __exit__(self, *exc):
        for obj, attr, original in reversed(self._undo):
            setattr(obj, attr, original)

    def _mark(self):
        """Fold the peak since the last mark into every open phase, then reset it."""
        torch.cuda.synchronize()
        process_peak()   # the process peak, kept before the reset
        peak = torch.cuda.max_memory_allocated()
        for frame in self._stack:
            frame[1] = max(frame[1], peak)
        torch.cuda.reset_peak_memory_stats()

    def _wrap(self, fn, name):
        def wrapped(*args, **kwargs):
            if not CUDA:
                return fn(*args, **kwargs)
            self._mark()
            entry = torch.cuda.memory_allocated()
            self._stack.append([name, entry])
            try:
                return fn(*args, **kwargs)
            finally:
                self._mark()
                _, peak = self._stack.pop()
                row = self.phases.setdefault(name, {"calls": 0, "peak_bytes": 0,
                                                    "allocated_at_peak_entry_bytes": 0,
                                                    "most_above_entry_bytes": 0})
                row["calls"] += 1
                if peak > row["peak_bytes"]:
                    row["peak_bytes"], row["allocated_at_peak_entry_bytes"] = peak, entry
                row["most_above_entry_bytes"] = max(row["most_above_entry_bytes"], peak - entry)
        return wrapped


def _parser():
    ap = parser(__doc__, streams=8, frames=12)
    ap.add_argument("--small", action="store_true", help="2-layer LM (a quick check)")
    ap.add_argument("--skip-vendor", action="store_true")
    ap.add_argument("--memory-trace", action="store_true",
                    help="cadence: record the allocator's history from the step's construction to "
                         "the end of its warm-up and report the blocks live at the peak (slower; "
                         "its timings are not comparable)")
    ap.add_argument("--configs", default="E,cadence,V",
                    help="the rows this process runs (always in the order E, cadence, V)")
    ap.add_argument("--ref", help="E's outputs: written by a process that runs E, read by one "
                                  "that does not (each row in a process of its own)")
    ap.add_argument("--no-fuse", action="store_true", help="cadence without exact fusion")
    ap.add_argument("--no-donate", action="store_true",
                    help="cadence copies the first state into new carries (donate_state=False)")
    return ap


def main():
    args = _parser().parse_args()
    configs = args.configs.split(",")
    dev = torch.device("cuda" if CUDA else "cpu")
    t0 = time.perf_counter()
    mimi = M.build_mimi(device=dev)
    lm_gen = M.build_lm_gen(device=dev, seed=1, overrides=M.SMALL_LM if args.small else None,
                            dtype=torch.float32 if args.small else torch.bfloat16)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    streams = [[(0.1 * torch.randn(1, 1, 1920, generator=g)).to(dev) for _ in range(args.frames)]
               for _ in range(args.streams + 1)]   # stream 0 warms up
    warm, timed_streams = streams[:1], streams[1:]
    reset_at = args.frames // 2
    result = {"gpu": torch.cuda.get_device_name() if CUDA else "none (CPU smoke run)",
              "torch": torch.__version__,
              "commit": os.environ.get("CADENCE_COMMIT", "unknown"),
              "lm": "2-layer (SMALL_LM) fp32" if args.small else "7B bf16 (loaders._lm_kwargs)",
              "streams": args.streams, "frames_per_stream": args.frames, "reset_at": reset_at,
              "build_s": build_s, "configs": configs,
              "model_bytes": torch.cuda.memory_allocated() if CUDA else None}

    if "E" in configs:   # plain eager, the reference
        stock_streams(mimi, lm_gen, warm, reset_at, as_shipped=False)
        ref, e = timed(lambda t: stock_streams(mimi, lm_gen, timed_streams, reset_at, False, t))
        e["bit_exact_frames"] = exact_frames(ref, ref)
        floor, kernels = kernel_floor_ms(
            lambda: stock_streams(mimi, lm_gen, [timed_streams[0][:6]], reset_at=99, as_shipped=False), 6, e)
        e.update(floor_ms=floor, kernels_per_frame=kernels, status="ok", process_peak_bytes=process_peak())
        result["E"] = e
        if args.ref:
            torch.save([[tuple(None if t is None else t.cpu() for t in f) for f in s] for s in ref], args.ref)
    else:
        ref = [[tuple(None if t is None else t.to(dev) for t in f) for f in s]
               for s in torch.load(args.ref)]

    if "cadence" in configs:
        result["cadence"] = cadence_row(mimi, lm_gen, args, warm, timed_streams, reset_at, ref,
                                        result.get("E"))

    if "V" in configs and not args.skip_vendor:   # the vendor's CUDAGraphed path as shipped
        try:
            t1 = time.perf_counter()
            v_ticks = Ticks()
            vendor_outs = stock_streams(mimi, lm_gen, timed_streams, reset_at, True, v_ticks, warm=warm)
            v = {"p50_ms": median(v_ticks.times), "p95_ms": p95(v_ticks.times),
                 **memory(), "frames": len(v_ticks.times),
                 "wall_s_incl_capture": time.perf_counter() - t1,
                 "bit_exact_frames": exact_frames(ref, vendor_outs), "status": "ok",
                 "process_peak_bytes": process_peak()}
        except Exception as ex:  # noqa: BLE001 - recorded, the run goes on
            v = {"status": f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:300]}"}
        result["V"] = v

    c = result.get("cadence")
    if c and "p50_ms" in result.get("V", {}):
        c["vs_V_p50"] = c["p50_ms"] / result["V"]["p50_ms"]
    result["total_frames"] = args.streams * args.frames
    print(json.dumps(result, indent=1))
    write_result(args.out, result)


def cadence_row(mimi, lm_gen, args, warm, timed_streams, reset_at, ref, e):
    """``MoshiStep`` compiled by cadence_fx (the shipped default: exact fusion on), measured;
    then closed and freed, so a later row in this process does not count its memory."""
    trace = None
    if args.memory_trace and CUDA:
        from memory_trace import Recorder
        trace = Recorder().__enter__()
    try:
        step = M.MoshiStep(mimi, lm_gen)
        adapter = M.moshi_adapter(M.SMALL_LM if args.small else None)
        # a server gives each stream's state to the step (the stock loop lets its modules write
        # theirs in place): the rings become the carries, the state is held once
        compiled = cadence_fx.compile(step, adapter, fuse=not args.no_fuse,
                                      donate_state=not args.no_donate)
        t1 = time.perf_counter()
        with PhasePeaks() as phases:
            cadence_streams(step, compiled, warm, reset_at)   # traces and captures every class
    finally:
        if trace is not None:   # recording stops here, whatever happened
            trace.__exit__(None, None, None)
    compile_s = time.perf_counter() - t1
    compile_peak = process_peak()   # the most allocated so far: model, compile, verify, capture
    before = (compiled.counters.replays, compiled.counters.fallbacks)
    ours, c = timed(lambda t: cadence_streams(step, compiled, timed_streams, reset_at, t))
    k = compiled.counters
    c.update(bit_exact_frames=exact_frames(ref, ours),
             warm_stream_s=compile_s, classes=len(compiled.classes), traces=k.traces,
             capture_s=getattr(compiled.backend, "capture_seconds", None),
             steady_replays=k.replays - before[0], steady_fallbacks=k.fallbacks - before[1],
             eager_pieces=k.eager_pieces, fused_regions=k.fused_regions,
             fusions_refused=k.fusions_refused, fuse=not args.no_fuse, status="ok",
             donate_state=not args.no_donate, adoptions=k.adoptions, absorptions=k.absorptions,
             fallback_reasons=dict(k.reasons), process_peak_bytes=process_peak(),
             compile_peak_bytes=compile_peak, compile_phases=phases.phases,
             # where the held bytes are: carries, private buffers, the captured graphs' pool
             memory=compiled.report().memory())
    if trace is not None:   # who held the most, from the step's construction to the end of warm-up
        c["memory_trace"] = trace.peak()
    c["graph_launches_per_frame"] = c["steady_replays"] / c["frames"]
    # the same six frames as E's floor: its own kernel time and kernels per frame (the kernels a
    # replayed graph launches are traced one by one)
    c["kernel_ms"], c["kernels"] = kernel_floor_ms(
        lambda: cadence_streams(step, compiled, [timed_streams[0][:6]], reset_at=99), 6, c)
    if e is not None:
        c["speedup_vs_E_p50"] = e["p50_ms"] / c["p50_ms"]
        c["floor_ms"] = e["floor_ms"]
        c["vs_floor_p50"] = c["p50_ms"] / e["floor_ms"] if e["floor_ms"] else None
    # free what cadence_fx holds (carries, graphs, their pool) before the vendor path runs, so
    # neither row's peak counts the other's memory (each row has allocated_at_start_bytes)
    step.close()   # the modules leave streaming: the vendor path enters it again
    compiled = step = ours = None   # dropped (not del: the lambdas above close over them)
    _held.clear()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return c


if __name__ == "__main__":
    main()
