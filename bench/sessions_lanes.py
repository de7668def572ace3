"""Token2Wav conversations per GPU with lanes, compiled priming and the deadline scheduler.

    python bench/sessions_lanes.py [--out bench/results/<date>-h200-sessions-lanes.json]
        [--depth 16] [--lanes 1,2] [--ns 8,16,24,32] [--seconds 6] [--budget-s 420]
        [--threads] [--host-profile]
    python bench/sessions_lanes.py --device cpu --depth 1 --ns 2 --lanes 1,2 --seconds 2   # harness

Per lane count L and session count N: N conversations arrive (a Poisson process, mean gap
``--gap-ms``; ``--arrivals burst``: each slot after a gap of its own, as rows before 2026-12-03),
each primed through the compiled flow (its priming class, prepared by ``capture_catalog`` on
every lane), then sending a 1 s chunk (28 tokens, 50 mel frames) every second for a random
length (``--seconds`` on average); as one retires a new speaker arrives (churn). The
``cadence_fx.scheduler`` serves them over ``SessionPool(..., lanes=L)`` for flow and HiFT; a chunk's
deadline is its arrival + ``--budget-ms``. A row is real-time when no chunk misses its deadline.
Every session's mel and PCM are compared (``torch.equal``) with the same speaker run alone through
stock, after the row's traffic, in ``--ref-workers`` processes of their own (8 on CUDA: a 3 x 16
row took 219 s at 62217a0, much of it its references run one after another here). The stock baseline
(one stream, sessions in turn) runs in the same process first. Also:
the priming pass p50 (stock ``setup_cache`` and the compiled priming class, CUDA events after
warm-up) with each one's kernel time and launches (``*priming_kernels``: the compiled class is one
device graph, nothing eager, so its p50 over its kernel time says what is left to gain), the fraction of wall time the GPU spends in kernels (profiler) for stock and for the
best row (``summed``: kernel time over wall, above ``busy`` when lanes overlap; ``busy``: the union
of the kernels' intervals; the best row's is its traffic again, ``--fraction-s``, measured after
the rows whatever ``--budget-s`` says, over ``--fraction-window`` of it; ``--fraction-at L,N``
names the traffic instead, so ``--ns=`` measures the fraction alone), and peak memory (``torch.cuda.max_memory_allocated``) with memory per lane and session.
Moshi batches per lane are measured by ``bench/moshi_lanes.py`` (``moshi_conversations_per_gpu`` is
null here).
Rows stop once ``--budget-s`` is spent (recorded under ``skipped``).

Before traffic every lane is prepared: ``capture_catalog`` (the flow's classes and priming class)
and one throwaway conversation per lane (``sessions.warm_lanes``: HiFT's classes, which read the
mel in the layout the compiled flow returns it). ``warm`` in the result says per lane what that
compiled and what ran stock. A class still met first in traffic compiles inside a chunk and holds
every lane: each row reports ``compiles`` (and ``compile_chunks``: which session, which lane, the
host ms of that dispatch), which should be 0. Before this, HiFT's two classes compiled inside the
first chunks of each lane, about 8 s in which every queued chunk missed its deadline.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import datetime
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch

import cadence_fx
from cadence_fx.models.token2wav import (FlowStep, HiFTStep, build_flow, build_hift,
                                         empty_hift_cache, prompt_call, stock_conversation)
from cadence_fx.scheduler import Scheduler
from cadence_fx.serve.host import LoopLag, freeze_start_up
from cadence_fx.sessions import warm_lanes

import common   # bench/common.py, beside this script

DEVICE = "cuda"
WARM_CHUNKS = 3   # a conversation's flow classes: 302, 352, then 402 retained frames


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _tokens(speaker, n, device=None):
    g = torch.Generator().manual_seed(50_000 + speaker)
    return [torch.randint(0, 6561, (1, 28), generator=g).to(device or DEVICE) for _ in range(n)]


_ALONE = {}   # speaker -> its chunks alone through stock (a stream's first n chunks do not depend on n)
_REFERENCES = {"pool": None, "workers": 0, "processes_checked": None}
_WORKER = {}


def _alone(flow, hift, speaker, n):
    """The speaker alone through stock: mel and PCM of its first ``n`` chunks (host). Rows reuse
    speakers, so each speaker's stock stream runs once (again only when a row needs more chunks)."""
    if len(_ALONE.get(speaker, ())) < n:
        _ALONE[speaker] = _alone_run(flow, hift, speaker, n)
    return _ALONE[speaker][:n]


def _references(flow, hift, needs, args):
    """Fill ``_ALONE`` for ``{speaker: chunks}``. Stock runs a chunk in about 0.6 s of host time
    on the H200, so a 3 x 24 row's references alone took minutes: with ``--ref-workers`` W > 1
    they run in W processes, each with its own stock flow and HiFT built from the same seeds
    (after the row's traffic, never during it). The first speaker is also run in this process
    and the workers' result must equal it (``references_processes_checked``)."""
    missing = {s: n for s, n in needs.items() if len(_ALONE.get(s, ())) < n}
    if not missing:
        return
    if args.ref_workers <= 1:
        for s, n in missing.items():
            _alone(flow, hift, s, n)
        return
    if _REFERENCES["pool"] is None:
        import multiprocessing
        _REFERENCES["pool"] = concurrent.futures.ProcessPoolExecutor(
            args.ref_workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init, initargs=(args.depth, tuple(int(b) for b in
                                                                 args.blocks.split(",")), DEVICE))
        _REFERENCES["workers"] = args.ref_workers
    jobs = [_REFERENCES["pool"].submit(_worker_alone, s, n) for s, n in missing.items()]
    if _REFERENCES["processes_checked"] is None:
        s, n = next(iter(missing.items()))
        here = _alone_run(flow, hift, s, n)
        there = jobs[0].result()[1]
        _REFERENCES["processes_checked"] = all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(here, there))
    for job in jobs:
        s, outs = job.result()
        _ALONE[s] = outs


def _worker_init(depth, blocks, device):
    global DEVICE
    DEVICE = device
    cadence_fx.pin_deterministic_kernels()
    _WORKER["flow"] = FlowStep(build_flow(depth, blocks=blocks, device=device))
    _WORKER["hift"] = HiFTStep(build_hift(device=device))


def _worker_alone(speaker, n):
    return speaker, _alone_run(_WORKER["flow"], _WORKER["hift"], speaker, n)


def _alone_run(flow, hift, speaker, n):
    return stock_conversation(flow, hift, prompt_call(flow, seed=speaker, device=DEVICE),
                              _tokens(speaker, n), seed=1000 + speaker, device=DEVICE)


class Served:
    """Flow + HiFT pools with L lanes; a session's chunk runs both on its flow lane's stream."""

    def __init__(self, cflow, chift, lanes, flow_step):
        self.fpool = cadence_fx.SessionPool(cflow, lanes=lanes)
        self.hpool = cadence_fx.SessionPool(chift, lanes=lanes)
        self.flow_step, self.ids, self.use = flow_step, {}, lanes
        # lane_io: inputs come from the host and go to the device on the session's lane stream,
        # results come back to the host there (the lane's thread waits for them): the loop's
        # thread then queues nothing on the device, where a full launch queue would hold it
        self.lane_io, self.on_device = False, {}

    def prepare(self):
        """The flow's catalog and priming class on every lane (``capture_catalog``), then one
        throwaway conversation per lane (``warm_lanes``): it compiles what one example cannot
        make, HiFT's first-chunk and steady classes at the layout of the mel the compiled flow
        returns. Returns the warm-up per lane (classes compiled, calls left stock)."""
        tokens, mel_p, spk = prompt_call(self.flow_step, device=DEVICE)
        with torch.inference_mode(), torch.autocast(DEVICE, dtype=torch.float32,
                                                    enabled=DEVICE == "cuda"):
            state = self.flow_step(tokens, spk, None, prompt_mel=mel_p)[1]
            state = {k: v.clone() for k, v in state.items()}
            self.preparations = self.fpool.capture_catalog(
                torch.zeros(1, 28, dtype=torch.long, device=DEVICE), spk, state,
                priming_example=lambda n: ((tokens, spk, None), {"prompt_mel": mel_p}))

        def conversation(lane):   # prime, then chunks until retention holds (302 -> 402 frames)
            fid = self.open(10_000 + lane, lane=lane)
            for i, tok in enumerate([None] + _tokens(10_000 + lane, WARM_CHUNKS)):
                self.run(fid, "prime" if i == 0 else "chunk", tok)
            self.close(fid)

        return warm_lanes([self.fpool, self.hpool], conversation)

    def open(self, speaker, lane=None):
        if lane is None:
            lane = min(self.fpool.lanes[:self.use], key=lambda x: (x.sessions, x.index)).index
        fid = self.fpool.open(None, seed=1000 + speaker, lane=lane)
        hid = self.hpool.open(empty_hift_cache(DEVICE), seed=1000 + speaker,
                              lane=self.fpool.lane_of(fid))
        self.ids[fid] = (hid, speaker, prompt_call(self.flow_step, seed=speaker,
                                                   device="cpu" if self.lane_io else DEVICE))
        return fid

    def run(self, fid, op, tok=None):
        hid, _, prompt = self.ids[fid]
        lane = self.fpool.lanes[self.fpool.lane_of(fid)]
        on_lane = torch.cuda.stream(lane.stream) if lane.stream is not None else _null()
        if self.lane_io:   # (host inputs: the prompt once per session, then each chunk's tokens)
            with on_lane:
                if fid not in self.on_device:
                    self.on_device[fid] = [t.to(DEVICE) for t in prompt]
                tok = None if tok is None else tok.to(DEVICE)
            prompt = self.on_device[fid]
        tokens, mel_p, spk = prompt
        with torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda"):
            if op == "prime":
                return self.fpool.step(fid, tokens, spk, prompt_mel=mel_p)
            mel, _ = self.fpool.step(fid, tok, spk)
        if op == "flow":   # the flow alone (the lane-concurrency probe)
            return mel, None
        with on_lane:
            pcm = self.hpool.step(hid, mel)[0]
            if self.lane_io:   # HiFT ran on the HiFT pool's lane stream: read after it
                if lane.stream is not None:
                    lane.stream.wait_event(self.hpool.done(hid))
                return mel.cpu(), pcm.cpu()
        return mel, pcm

    def close(self, fid):
        hid = self.ids.pop(fid)[0]
        self.on_device.pop(fid, None)
        self.fpool.close(fid)
        self.hpool.close(hid)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _concurrency(served, lanes, trials=5):
    """k chunks dispatched at once, one per lane, for k = 1..lanes (after 3 warm-up rounds):
    the wall time until all are done (synchronized) and the host time the k dispatches took,
    for whole chunks (flow and HiFT) and for the flow alone. Lanes that overlap on the device
    keep the wall near one chunk's; lanes that do not make it k times that; a host-bound
    dispatch shows as host ms near the wall. HiFT draws device randomness, so its chunks take
    turns across lanes (docs/sessions.md): whole chunks against the flow alone say what that
    costs."""
    out = {}
    for k in range(1, lanes + 1):
        out[k] = {op: _at_once(served, k, op, trials) for op in ("chunk", "flow")}
        if k > 1:   # each lane's chunk queued from a thread of its own (Scheduler(threads=True))
            out[k]["chunk_lane_threads"] = _at_once(served, k, "chunk", trials, threads=True)
    return out


def _at_once(served, k, op, trials, threads=False):
    fids = [served.open(20_000 + i, lane=i) for i in range(k)]
    toks = {f: _tokens(20_000 + i, 3 + trials) for i, f in enumerate(fids)}
    walls, hosts = [], []
    before = _totals(served)
    pool = concurrent.futures.ThreadPoolExecutor(k) if threads else None

    def run(f, t):
        with torch.inference_mode():
            served.run(f, op, toks[f][t])

    with torch.inference_mode():
        for f in fids:
            served.run(f, "prime")
        for t in range(3 + trials):
            _sync()
            t0 = time.perf_counter()
            if pool is not None:
                list(pool.map(lambda f: run(f, t), fids))
            else:
                for f in fids:
                    run(f, t)
            t1 = time.perf_counter()
            _sync()
            if t >= 3:
                walls.append((time.perf_counter() - t0) * 1e3)
                hosts.append((t1 - t0) * 1e3)
    if pool is not None:
        pool.shutdown()
    for f in fids:
        served.close(f)
    ran = {k: v - before[k] for k, v in _totals(served).items()}
    return {"wall_ms_p50": statistics.median(walls), "host_ms_p50": statistics.median(hosts), **ran}


def _host_profile(served, k, trials=3):
    """Where the host time of k chunks dispatched at once (one per lane) goes: the profiler's CPU
    side (torch ops and CUDA runtime calls such as ``cudaGraphLaunch``, ``cudaStreamSynchronize``)
    over ``trials`` rounds after 3 warm-up rounds, the 15 largest by self time, per round."""
    from torch.profiler import ProfilerActivity, profile
    fids = [served.open(30_000 + i, lane=i) for i in range(k)]
    toks = {f: _tokens(30_000 + i, 3 + trials) for i, f in enumerate(fids)}
    with torch.inference_mode():
        for f in fids:
            served.run(f, "prime")
        for t in range(3):
            for f in fids:
                served.run(f, "chunk", toks[f][t])
        _sync()
        t0 = time.perf_counter()
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (DEVICE == "cuda")
        with profile(activities=activities) as prof:
            for t in range(3, 3 + trials):
                for f in fids:
                    served.run(f, "chunk", toks[f][t])
            host_ms = (time.perf_counter() - t0) * 1e3 / trials
            _sync()
    for f in fids:
        served.close(f)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"lanes": k, "host_ms_per_round": host_ms,
            "top_self_cpu": [(e.key[:60], round(e.self_cpu_time_total / 1e3 / trials, 2),
                              e.count // trials) for e in events[:15]]}


def _totals(served) -> dict:
    """Calls, compiled calls and fallbacks of every lane of both pools."""
    steps = [lane.compiled for pool in (served.fpool, served.hpool) for lane in pool.lanes]
    return {f: sum(getattr(c.counters, f) for c in steps)
            for f in ("calls", "compiled_calls", "fallbacks")}


async def _churn(served, n, seconds, gap_ms, budget_ms, period_s, seed, threads=False,
                 arrivals="poisson", window=None):
    """One row's traffic. Returns the scheduler's report (with the loop's lag, each lane's busy
    fraction and the per-second timeline added), its records and each conversation's outputs on
    the host. ``arrivals``: ``poisson``, the N slots' first conversations arrive as a Poisson
    process of mean gap ``gap_ms`` (N x gap_ms on average for all of them); ``burst``, each slot
    waits its own exponential gap of that mean, so half of them arrive within 0.7 x ``gap_ms``
    and all of them within a few gaps (the rows before this option). ``window``: a coroutine
    function run beside the traffic from its start (``_kernel_fraction_window``'s profiler)."""
    sched = Scheduler(served.fpool, period_ms=budget_ms, run=served.run,
                      done=lambda fid: served.hpool.done(served.ids[fid][0]),
                      pools=(served.fpool, served.hpool), threads=threads)
    served.lane_io = threads   # a lane's thread may wait for its results; the loop may not
    g, results, next_speaker = random.Random(seed), [], [0]
    marks = []   # (submitted, op, latency ms) per request
    lag = LoopLag(period_ms=1.0, keep=None)   # how late the loop wakes: what held it
    if arrivals == "poisson":
        firsts = list(itertools.accumulate(g.expovariate(1000.0 / gap_ms) for _ in range(n)))
    elif arrivals == "burst":
        firsts = [g.expovariate(1000.0 / gap_ms) for _ in range(n)]
    else:
        raise ValueError(f"arrivals {arrivals!r}: poisson or burst")

    async def timed(fid, op, *args):
        t = time.perf_counter()
        out = await sched.submit(fid, op, *args)
        marks.append((t - t0, op, (time.perf_counter() - t) * 1e3))
        return out

    async def conversation():
        speaker = next_speaker[0]
        next_speaker[0] += 1
        length = max(1, int(g.expovariate(1.0 / seconds)))
        fid = served.open(speaker)
        start = time.perf_counter()
        await timed(fid, "prime")
        outs = []
        for i, tok in enumerate(_tokens(speaker, length, "cpu" if served.lane_io else DEVICE)):
            await asyncio.sleep(max(0.0, start + i * period_s - time.perf_counter()))
            mel, pcm = await timed(fid, "chunk", tok)
            outs.append((mel.cpu(), pcm.cpu()))
        sched.on_lane(fid, served.close, fid)   # on its lane's thread with --threads
        results.append((speaker, outs))

    async def slot(first):
        await asyncio.sleep(first)
        end = time.perf_counter() + seconds * 2
        while time.perf_counter() < end:
            await conversation()

    lag.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(slot(first) for first in firsts), *([window()] if window else []))
    await sched.stop()
    wall = time.perf_counter() - t0
    await lag.stop()
    served.lane_io = False
    report = sched.report()
    busy = collections.defaultdict(float)
    for r in sched.records:
        busy[r.lane] += r.completed - r.dispatched
    report.update(lane_io=threads, **lag.report(), arrivals=arrivals,
                  lane_busy_fraction={k: round(v / wall, 3) for k, v in sorted(busy.items())},
                  timeline=_timeline(marks, budget_ms))
    return report, sched.records, results


def _timeline(marks, budget_ms) -> list:
    """Per second of the row (by submission): chunks and primings submitted, those whose answer
    came later than ``budget_ms`` after submission (as the conversation saw it), the worst."""
    rows = collections.defaultdict(lambda: {"chunks": 0, "primings": 0, "late": 0, "worst_ms": 0.0})
    for t, op, ms in marks:
        r = rows[int(t)]
        r["chunks" if op == "chunk" else "primings"] += 1
        r["late"] += ms > budget_ms
        r["worst_ms"] = round(max(r["worst_ms"], ms), 1)
    return [{"s": k, **rows[k]} for k in sorted(rows)]



def _row(flow, hift, served, lanes, n, args):
    torch.cuda.reset_peak_memory_stats() if DEVICE == "cuda" else None
    t0 = time.perf_counter()
    with common.GcPauses() as pauses:
        report, records, results = asyncio.run(_churn(served, n, args.seconds, args.gap_ms,
                                                      args.budget_ms, args.period_ms / 1e3, n,
                                                      args.threads, args.arrivals))
    t_ref = time.perf_counter()
    needs = {}
    for speaker, outs in results:
        needs[speaker] = max(needs.get(speaker, 0), len(outs))
    _references(flow, hift, needs, args)
    exact = [all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in
                 zip(outs, _alone(flow, hift, speaker, len(outs)))) for speaker, outs in results]
    references_s = time.perf_counter() - t_ref
    mem = served.fpool.memory()
    return {"lanes": lanes, "sessions": n, "lane_threads": args.threads, **report,
            **pauses.report(),
            "sessions_served": len(results),
            "realtime": report["deadline_misses"] == 0, "all_bit_exact": all(exact),
            "sessions_bit_exact": sum(exact), "wall_s": time.perf_counter() - t0,
            "traffic_s": t_ref - t0,   # the served traffic alone, before the references
            "references_s": references_s, "reference_workers": _REFERENCES["workers"],
            "references_processes_checked": _REFERENCES["processes_checked"],
            "max_memory_allocated": torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0,
            "flow_lane_bytes": mem["lane_bytes"], "flow_session_bytes_mean": mem["session_bytes_mean"],
            "fallbacks": _totals(served)["fallbacks"],
            "fallback_reasons": [dict(l.compiled.counters.reasons) for p in
                                 (served.fpool, served.hpool) for l in p.lanes]}


def _priming_ms(fn, repeat):
    """p50 of ``fn`` (CUDA events after two warm-up calls; wall time on the CPU)."""
    times = []
    for i in range(repeat + 2):
        if DEVICE == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t) * 1e3
        if i >= 2:
            times.append(ms)
    return statistics.median(times)


def _is_kernel(name: str) -> bool:
    """A device activity that is a kernel: not a copy or a fill the driver runs."""
    return not name.startswith(("Memcpy", "Memset"))


def _kernel_fraction(fn):
    """Fraction of wall time the GPU spends in kernels while ``fn`` runs (profiler; the wall is
    timed inside the profiled block, so the profiler's start and its flush are not in it): the
    device time of every kernel summed over the wall (above the busy fraction when lanes overlap
    on the device, and it can pass 1), and the busy fraction, the union of the kernels'
    intervals over every stream (None, with ``busy_why``, where the profiler gives no device
    intervals). Copies and fills (``Memcpy``, ``Memset``) and annotations are not kernels."""
    if DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        wall_us = (time.perf_counter() - t) * 1e6
    return _fraction_of(prof, wall_us)


def _kernel_fraction_window(run, delay_s, length_s):
    """The kernel-time fraction over a window of traffic: ``run(window)`` runs the traffic with
    ``window`` beside it, which starts the profiler ``delay_s`` into it and stops it
    ``length_s`` later. At full load 8 lanes put ~300,000 kernels a second on the device: a
    profile of a whole row's traffic took longer to read than a device call lasts. The window's
    wall is the host's, from the profiler's start to its stop; the kernels are those the device
    ran meanwhile, the queued backlog included, so at full load their union can pass the window
    (``busy`` > 1): ``busy_in_extent`` is the union over the kernels' own first start to last
    end."""
    if DEVICE != "cuda":   # the CPU harness: the traffic and its window run, nothing recorded
        async def idle():
            await asyncio.sleep(delay_s + length_s)
        run(idle)
        return None
    from torch.profiler import ProfilerActivity, profile
    prof, span = profile(activities=[ProfilerActivity.CUDA]), {}

    async def window():
        await asyncio.sleep(delay_s)
        prof.start()
        span["start"] = time.perf_counter()
        await asyncio.sleep(length_s)
        span["end"] = time.perf_counter()
        prof.stop()

    run(window)
    t = time.perf_counter()
    out = _fraction_of(prof, (span["end"] - span["start"]) * 1e6)
    out.update(window_s=[delay_s, length_s], read_s=round(time.perf_counter() - t, 1))
    return out


def _fraction_of(prof, wall_us):
    """Summed kernel time and the busy union over ``wall_us`` (``_kernel_fraction``)."""
    from torch.autograd import DeviceType
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if _is_kernel(e.key))
    out = {"summed": kernel_us / wall_us, "busy": None, "wall_s": wall_us / 1e6}
    try:
        spans = [(e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3)
                 for e in prof.profiler.kineto_results.events()
                 if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
                 and not e.is_user_annotation() and _is_kernel(e.name())]
    except (AttributeError, RuntimeError) as e:   # another torch's profiler API
        out["busy_why"] = f"no device intervals: {type(e).__name__}: {e}"
        return out
    if not spans:
        out["busy_why"] = "the profiler recorded no device intervals"
        return out
    union_us = common.busy_us(spans)
    extent_us = max(e for _, e in spans) - min(s for s, _ in spans)
    out["busy"] = union_us / wall_us
    # a window's kernels are those the device ran while the profiler recorded, which at full load
    # include the backlog queued before its start: their extent can pass the host's window (busy
    # over the window > 1, as at 241eed9: 1.245). The union over their own extent says how much
    # of that time the device idled.
    out["kernels_extent_s"] = extent_us / 1e6
    out["busy_in_extent"] = union_us / extent_us if extent_us > 0 else None
    return out


def _kernels(fn):
    """GPU work of one call of ``fn`` (profiler, after it ran once): kernel ms and launches.
    For the priming pass: whether its time is kernels (a floor the graph cannot lower) or gaps."""
    if DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    return common.kernel_summary(prof)


def _stock_rows(flow, hift, ns, rounds, budget_ms):
    """Stock: N sessions in turn on one stream (bench/sessions.py's serve_stock)."""
    if DEVICE != "cuda":   # serve_stock times with CUDA events: a CPU run checks the rest
        return [], None
    import sessions
    sessions.DEVICE = DEVICE
    spk, prompt = sessions.prime_flow(flow, device=DEVICE)
    rows = []
    for n in ns:
        chunk_ms, round_ms, _, _ = sessions.serve_stock(flow, hift, spk, prompt,
                                                        sessions.chunk_inputs(n, rounds), rounds)
        rows.append({"sessions": n, "chunk_p50_ms": statistics.median(chunk_ms),
                     "round_max_ms": max(round_ms), "realtime": max(round_ms) <= budget_ms})
    frac = _kernel_fraction(lambda: sessions.serve_stock(flow, hift, spk, prompt,
                                                         sessions.chunk_inputs(1, 2), 2))
    return rows, frac


def _lane_rows(result, served, flow, hift, lanes, args, start, save):
    """A row per lane count and session count within ``--budget-s``; the best row's kernel
    fraction."""
    for L in lanes:
        for n in [int(x) for x in args.ns.split(",") if x]:
            if time.perf_counter() - start > args.budget_s:
                result["skipped"].append({"lanes": L, "sessions": n})
                continue
            served.use = L
            row = _row(flow, hift, served, L, n, args)
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "fallback_reasons"}), flush=True)
            save()
    good = [r for r in result["rows"] if r["realtime"] and r["all_bit_exact"]]
    best = max(good, key=lambda r: (r["sessions"], -r["lanes"]), default=None)
    result["cadence_realtime_sessions_churn"] = best["sessions"] if best else 0
    result["best"] = best and {"lanes": best["lanes"], "sessions": best["sessions"]}
    at = (best["lanes"], best["sessions"]) if best else None
    if args.fraction_at:
        at = tuple(int(x) for x in args.fraction_at.split(","))
        if len(at) != 2 or not 1 <= at[0] <= len(served.fpool.lanes) or at[1] < 1:
            raise SystemExit(f"--fraction-at {args.fraction_at}: give L,N with L among the "
                             f"{len(served.fpool.lanes)} prepared lanes (--lanes) and N >= 1")
    if at is not None and args.fraction_s > 0:
        # that traffic again (no references), its N conversations arriving in a burst, all
        # within about a second, profiled over --fraction-window of it, at full load
        served.use = at[0]
        delay_s, length_s = (float(x) for x in args.fraction_window.split(","))
        try:   # the rows are saved; a profiler that fails says so in the result, not as a crash
            frac = _kernel_fraction_window(lambda window: asyncio.run(_churn(
                served, at[1], args.fraction_s, args.gap_ms, args.budget_ms,
                args.period_ms / 1e3, 99, args.threads, "burst", window)), delay_s, length_s)
        except Exception as e:  # noqa: BLE001
            frac = {"error": f"{type(e).__name__}: {e}"}
        if frac is not None:
            result["cadence_kernel_fraction"] = dict(frac, lanes=at[0], sessions=at[1],
                                                     arrivals="burst")
            print(json.dumps({"cadence_kernel_fraction": result["cadence_kernel_fraction"]}),
                  flush=True)


def _compiled_priming(result, lane0, prime):
    """The compiled priming class timed and profiled on lane 0's step, outside the pool."""
    cflow = lane0.compiled
    with torch.inference_mode(), torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda"):
        before = cflow.counters.compiled_calls
        result["priming_p50_ms"] = _priming_ms(prime, 5)
        result["priming_compiled"] = cflow.counters.compiled_calls - before == 7
        result["priming_kernels"] = _kernels(prime)
    lane0.calls_seen = cflow.counters.calls   # the priming timing ran outside the pool
    lane0.resident = None


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    day = datetime.date.today().isoformat()
    ap.add_argument("--out", default=f"bench/results/{day}-h200-sessions-lanes.json")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--blocks", default="6,4", help="conformer blocks before,after upsampling")
    ap.add_argument("--lanes", default="1,2", help="lane counts (each lane compiles its classes: budget it)")
    ap.add_argument("--ns", default="8,16,24,32")
    ap.add_argument("--stock-ns", default="1,2")
    ap.add_argument("--seconds", type=float, default=6.0, help="mean conversation length (s)")
    ap.add_argument("--gap-ms", type=float, default=200.0, help="mean gap between arrivals")
    ap.add_argument("--arrivals", choices=("poisson", "burst"), default="poisson",
                    help="poisson: the first N conversations arrive as a Poisson process of mean "
                         "gap --gap-ms; burst: each slot waits a gap of its own, all N within a "
                         "few gaps (rows before 2026-12-03)")
    ap.add_argument("--period-ms", type=float, default=1000.0, help="audio per chunk")
    ap.add_argument("--budget-ms", type=float, default=900.0, help="a chunk's deadline")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding rows after this")
    ap.add_argument("--fraction-s", type=float, default=2.0,
                    help="the best row's traffic again under the profiler, for the fraction of "
                         "wall time in kernels: conversations of this mean length in seconds, "
                         "slots open twice as long; after the rows whatever --budget-s says "
                         "(0: not measured)")
    ap.add_argument("--fraction-window", default="1.0,0.5",
                    help="DELAY,LENGTH: the profiler records LENGTH seconds of that traffic, "
                         "from DELAY seconds into it (the burst's arrivals in by then)")
    ap.add_argument("--fraction-at", default=None,
                    help="L,N: measure the fraction at L lanes and N sessions instead of the "
                         "best row's (with --ns= no row runs: no references, a short call)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", action="store_true",
                    help="the scheduler queues each lane's chunks from a thread of its own")
    ap.add_argument("--host-profile", action="store_true",
                    help="profile the host side of k chunks at once (k = 1 and the most lanes)")
    ap.add_argument("--ref-workers", type=int, default=None,
                    help="processes that run the stock references after each row (default: 8 "
                         "on CUDA, 1 = in this process)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the run (lane threads and the loop share the "
                         "GIL; default: Python's 5 ms)")
    ap.add_argument("--cache-dir", default=None,
                    help="compile both steps with this cache_dir (an empty one: lane 0 still "
                         "compiles cold). Lanes thaw lane 0's classes either way; with it they "
                         "also take its fused regions' verdicts from the kernel store instead of "
                         "verifying each region again")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave the objects start-up made to the collector (default: gc.freeze())")
    return ap.parse_args()


def main():
    global DEVICE
    args = _args()
    DEVICE = args.device
    if args.ref_workers is None:
        args.ref_workers = 8 if DEVICE == "cuda" else 1
    if args.switch_interval_ms is not None:
        if not args.switch_interval_ms > 0:
            raise SystemExit(f"--switch-interval-ms {args.switch_interval_ms}: give a positive "
                             "number of milliseconds")
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    start = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cadence_fx.pin_deterministic_kernels()
    blocks = tuple(int(b) for b in args.blocks.split(","))
    flow = FlowStep(build_flow(args.depth, blocks=blocks, device=DEVICE))
    hift = HiFTStep(build_hift(device=DEVICE))
    lanes = [int(x) for x in args.lanes.split(",")]
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("CADENCE_COMMIT", "unknown"),
              "depth": args.depth, "blocks": blocks, "deterministic_kernels": True,
              "release_envelopes": False, "args": vars(args), "rows": [], "skipped": []}

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    tokens, mel_p, spk = prompt_call(flow, device=DEVICE)
    with torch.inference_mode(), torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda"):
        result["stock_priming_p50_ms"] = _priming_ms(
            lambda: flow(tokens, spk, None, prompt_mel=mel_p), 5)
        result["stock_priming_kernels"] = _kernels(lambda: flow(tokens, spk, None, prompt_mel=mel_p))
    stock_ns = [int(x) for x in args.stock_ns.split(",") if x]
    result["stock"], result["stock_kernel_fraction"] = _stock_rows(flow, hift, stock_ns, 4,
                                                                   args.budget_ms)
    ok = [r["sessions"] for r in result["stock"] if r["realtime"]]
    result["stock_realtime_sessions"] = max(ok) if ok else 0
    save()
    from cadence_fx import adapters
    cflow = cadence_fx.compile(flow, adapters.get("minicpmo-token2wav-flow").with_clocks(
        conformer_layers=sum(blocks)), cache_dir=args.cache_dir)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift", cache_dir=args.cache_dir)
    t = time.perf_counter()
    served = Served(cflow, chift, max(lanes), flow)
    result["warm"] = served.prepare()
    result["prepare_s"] = time.perf_counter() - t
    # per lane: each class, how it came, seconds
    result["preparations"] = [str(p) for p in served.preparations]
    result["prepare_lane_s"] = [round(sum(r["seconds"] for r in p.rows), 2)
                                for p in served.preparations]
    print(json.dumps({"prepare_s": result["prepare_s"], "warm": result["warm"]}), flush=True)
    _compiled_priming(result, served.fpool.lanes[0], lambda: cflow(tokens, spk, None,
                                                                   prompt_mel=mel_p))
    result["lane_concurrency"] = _concurrency(served, max(lanes))
    print(json.dumps({"lane_concurrency": result["lane_concurrency"]}), flush=True)
    if args.host_profile:
        result["host_profile"] = [_host_profile(served, k) for k in sorted({1, max(lanes)})]
        print(json.dumps({"host_profile": result["host_profile"]}), flush=True)
    # what start-up made (graphs, traces, kernels) is never collected again; the count walks
    # every frozen object, so it is taken once, by the freeze
    result["gc_frozen_objects"] = freeze_start_up() if args.gc_freeze else 0
    result["switch_interval_ms"] = sys.getswitchinterval() * 1e3
    save()
    _lane_rows(result, served, flow, hift, lanes, args, start, save)
    result["moshi_conversations_per_gpu"] = None
    result["moshi"] = {"not_run": "measured by bench/moshi_lanes.py (batched frames per lane)"}
    result["all_bit_exact"] = all(r["all_bit_exact"] for r in result["rows"])
    if _REFERENCES["pool"] is not None:
        _REFERENCES["pool"].shutdown()
    result["wall_s"] = time.perf_counter() - start
    save()
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "stock")}, default=str))


if __name__ == "__main__":
    sys.exit(main())
