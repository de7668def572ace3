"""Moshi conversations per GPU: batched frames per lane, lanes ticking in lockstep.

    python bench/moshi_lanes.py [--out bench/results/<date>-h200-moshi-lanes.json]
        [--batches 8,16,32] [--lanes 1,2] [--frames 16] [--budget-s 420]
    python bench/moshi_lanes.py --device cpu --small --batches 2 --lanes 1,2 --frames 6   # harness

A lane serves one batch of B conversations: ``MoshiStep(mimi, lm_gen, batch=B)`` compiled with the
``moshi`` adapter at ``batch=B``, one session of ``SessionPool(compiled, lanes=L)`` per lane. A
tick sends every lane its next 1920-sample frame (B conversations each) and waits for all of them,
as a lockstep server does; L x B conversations are real-time when the tick's p99 is within
``--frame-ms`` (80 ms of audio). ``queued_p50_ms`` is the host time until every lane's frame was
queued: near the tick, the lanes wait on the host (drawing chunks are queued one at a time), not
on the device. Each lane's conversations start from their own seed and input; every frame's PCM
and tokens are compared (``torch.equal``) with the stock loop at the same batch
(``lm_gen.streaming(B)``, plain eager, the same seed and frames). Lanes draw device randomness
(the LM samples), each from a generator state of its own, so their frames overlap on the device
(``docs/sessions.md``); they are queued one at a time on the host. Memory (the KV rings, below)
limits the conversations a GPU holds. Before the timed ticks every lane runs a throwaway
conversation (``sessions.warm_lanes``: the LM's delay-filling frames and the steady frame are
classes of their own), and each row counts the classes still compiled during its ticks
(``compiles``, which should be 0). Then the objects start-up made are frozen (``gc.freeze()``,
as a server does after its start; ``--no-gc-freeze`` leaves them): at 12b1985, nothing frozen,
one of 48 ticks took 989 ms (the others 59-61 ms after the first), and with start-up's objects
frozen (00dd56f) no tick of 64 did, the longest collection 0.2 ms; that run did not record the
collector, so the 989 ms tick is most likely, not surely, a full collection. Each row records
the collector's pauses during its ticks.

Kernels are not pinned (``--deterministic`` pins them, on both sides): the stock Moshi frame is
reproducible against itself without, as the vendor runs it, and pinned kernels took a frame of
batch 16 2.5x the kernel time (46.3 ms and 14,539 launches at 5f5a256 against 18.5 ms and 3,275
at c01e663: every uninitialized tensor filled, ``fill_uninitialized_memory``, and every ring
write an ``index_put`` that sorts its indices). Lanes need only ``CUBLAS_WORKSPACE_CONFIG`` (set here
when absent, before CUDA starts), for one cuBLAS workspace per stream.

Memory decides what fits: the 7B LM's KV rings take 1.57 GB per conversation (32 layers, 3000
frames of context, bf16), so a lane of B conversations holds B x 1.57 GB of carries, and opening
the lanes' sessions holds one more fresh state of that size until their first frame. A row that
runs out of memory is recorded with its error and larger lane counts of that batch are skipped.

What takes the time on one H200 (measured at batch 16, kernels not pinned, c01e663 to 00dd56f):
building the 7B LM, 3-4 s; per batch the stock references (max lanes x frames eager frames),
9 s for 4 x 12 frames, 52 s for 4 x 64; the first row of a batch compiles lane 0 cold, 170-180 s
(with exact fusion), and its other lanes thaw lane 0's classes in 1.4-2.6 s each; a later row of
that batch loads lane 0 from ``--cache-dir`` in about 10 s; the ticks themselves, a few seconds.
The run of one row of 4 lanes of 16 with 64 frames took 240 s: the LM 3 s, references 52 s,
warm-up 180 s, ticks 4 s. ``--budget-s`` stops adding rows after
that many seconds, and ``--batches``, ``--lanes``, ``--frames`` shrink it. Each row records its
``seconds`` per part, to check these figures against.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before CUDA starts

import torch  # noqa: E402

import cadence_fx  # noqa: E402
import common  # noqa: E402 - bench/common.py, beside this script
from cadence_fx.models import moshi as M  # noqa: E402
from cadence_fx.serve.host import freeze_start_up, percentiles  # noqa: E402
from cadence_fx.sessions import warm_lanes  # noqa: E402

DEVICE = "cuda"
WARM_FRAMES = 5   # the LM's delays fill for max_delay + 1 = 3 frames: offsets 0, 1, 2, then steady


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _frames(seed, batch, n):
    g = torch.Generator().manual_seed(70_000 + seed)
    return [(0.1 * torch.randn(batch, 1, 1920, generator=g)).to(DEVICE) for _ in range(n)]


def _host(t):
    return None if t is None else t.detach().to("cpu", copy=True)


def _stock(mimi, lm_gen, frames, seed, batch):
    """The stock loop at ``batch`` (moshi/server.py's per frame, plain eager): (pcm, tokens)."""
    torch.manual_seed(seed)
    outs = []
    with M._plain_eager(), mimi.streaming(batch), lm_gen.streaming(batch), torch.no_grad():
        for frame in frames:
            tokens = lm_gen.step(mimi.encode(frame))
            pcm = None if tokens is None else mimi.decode(tokens[:, 1:])
            outs.append((_host(pcm), _host(tokens)))
    return outs


def _same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _pct(xs, q):
    return percentiles(xs, (q,))[0]


def _warmed(step, batch, lanes, args):
    """The step compiled at ``batch``, its pool of ``lanes`` lanes, each lane warmed."""
    adapter = M.moshi_adapter(M.SMALL_LM if args.small else None).with_clocks(batch=batch)
    compiled = cadence_fx.compile(step, adapter, cache_dir=args.cache_dir)
    pool = cadence_fx.SessionPool(compiled, lanes=lanes)
    fresh = step.initial_state()   # regions are absorbed by copy: one fresh state opens them all

    def conversation(lane):
        sid = pool.open(fresh, seed=0, lane=lane)
        for frame in _frames(10_000, batch, WARM_FRAMES):
            pool.step(sid, frame)
        pool.close(sid)

    with torch.no_grad():
        warm = warm_lanes([pool], conversation, modes=torch.no_grad)
    return pool, fresh, warm


def _ticks(pool, fresh, inputs, profile=False):
    """Every lane's session through its frames in lockstep ticks: tick ms, the host ms until
    every lane's frame was queued (``pool.step`` returned), outputs per lane; with ``profile``
    one more tick (its frames again, not compared) under the profiler: its kernels; and the ms
    to open the sessions (their fresh states copied in, timed apart from the ticks)."""
    start = time.perf_counter()
    sids = [pool.open(fresh, seed=1 + lane, lane=lane) for lane in range(len(inputs))]
    _sync()   # the fresh state is copied into every lane's carries before the first tick
    open_ms = (time.perf_counter() - start) * 1e3
    outs, ticks, queued = [[] for _ in inputs], [], []
    with torch.no_grad():
        for i in range(len(inputs[0])):
            start = time.perf_counter()
            results = [pool.step(sid, frames[i]) for sid, frames in zip(sids, inputs)]
            queued.append((time.perf_counter() - start) * 1e3)
            _sync()
            ticks.append((time.perf_counter() - start) * 1e3)
            for lane, r in enumerate(results):
                outs[lane].append((_host(r[0]), _host(r[1])))
        kernels = _tick_kernels(pool, sids, [frames[-1] for frames in inputs]) if profile \
            else None
    for sid in sids:
        pool.close(sid)
    return ticks, queued, outs, kernels, open_ms


def _tick_kernels(pool, sids, frames):
    """One tick under the profiler: its wall ms, the kernel ms summed over the lanes' streams
    (above the wall when lanes overlap on the device), launches, and the top kernels. Whether a
    tick is the device's time (kernels) or waits (gaps between them)."""
    if DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:   # its start and flush untimed
        _sync()
        start = time.perf_counter()
        for sid, frame in zip(sids, frames):
            pool.step(sid, frame)
        _sync()
        wall = (time.perf_counter() - start) * 1e3
    return dict(common.kernel_summary(prof, top=12, width=70), tick_ms=wall)


def _row(mimi, lm_gen, batch, lanes, refs, inputs, args):
    """One (batch, lanes) row: build, warm, tick, compare; everything freed after, even on an
    error (the modules leave streaming, so the next batch's stock loop can stream)."""
    t0, pool = time.perf_counter(), None
    step = M.MoshiStep(mimi, lm_gen, batch=batch)
    try:
        pool, fresh, warm = _warmed(step, batch, lanes, args)
        if args.gc_freeze:   # what start-up made (graphs, traces, modules) is never collected again
            freeze_start_up()
        t1 = time.perf_counter()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with common.GcPauses() as pauses:
            ticks, queued, outs, kernels, open_ms = _ticks(pool, fresh, inputs[:lanes], args.profile)
        del fresh
        exact = [sum(_same(a, b) for a, b in zip(got, refs[lane])) for lane, got in enumerate(outs)]
        frames, mem = sum(len(o) for o in outs), pool.memory()
        return {"batch": batch, "lanes": lanes, "conversations": batch * lanes,
                "tick_p50_ms": statistics.median(ticks), "tick_p99_ms": _pct(ticks, 0.99),
                "tick_max_ms": max(ticks), "ticks": len(ticks), "tick_ms": ticks,
                # host-bound when queuing the lanes' frames takes most of the tick
                "queued_p50_ms": statistics.median(queued),
                "open_ms": open_ms,   # opening the lanes' sessions: their states copied in
                "realtime": _pct(ticks, 0.99) <= args.frame_ms, "bit_exact_frames": sum(exact),
                "frames": frames, "all_bit_exact": sum(exact) == frames,
                "compiles": pool.compiles, "warm": warm, "profiled_tick": kernels,
                **pauses.report(),
                "fallbacks": sum(lane.compiled.counters.fallbacks for lane in pool.lanes),
                "fallback_reasons": [dict(lane.compiled.counters.reasons) for lane in pool.lanes],
                "lane_bytes": mem["lane_bytes"],
                "carry_bytes_per_conversation": mem["lanes"][0]["carries"] / batch,
                "peak_bytes": torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0,
                "seconds": {"build_and_warm": t1 - t0, "ticks": time.perf_counter() - t1}}
    finally:
        _free(step, pool)


def _free(step, pool):
    for lane in (pool.lanes if pool is not None else ()):
        lane.compiled.close()
    step.close()   # the modules leave streaming: the stock loop or another batch can stream
    del step, pool
    gc.unfreeze()   # the row's graphs and modules can be collected now
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _batch_rows(mimi, lm_gen, batch, lane_counts, args, result, start, save):
    """The stock references of ``batch`` (one per lane), then a row per lane count."""
    t = time.perf_counter()
    inputs = [_frames(lane, batch, args.frames) for lane in range(max(lane_counts))]
    refs = [_stock(mimi, lm_gen, frames, 1 + lane, batch) for lane, frames in enumerate(inputs)]
    result["stock_s"][str(batch)] = time.perf_counter() - t
    for lanes in lane_counts:
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append({"batch": batch, "lanes": lanes, "why": "--budget-s"})
            continue
        try:
            row = _row(mimi, lm_gen, batch, lanes, refs, inputs, args)
        except torch.OutOfMemoryError as e:
            result["rows"].append({"batch": batch, "lanes": lanes, "error": f"out of memory: "
                                   f"{str(e).splitlines()[0]}"})
            save()
            break   # more lanes of this batch need more memory still
        result["rows"].append(row)
        quiet = ("fallback_reasons", "warm", "profiled_tick", "tick_ms")
        print(json.dumps({k: v for k, v in row.items() if k not in quiet}), flush=True)
        if row.get("profiled_tick"):
            print(json.dumps(row["profiled_tick"]), flush=True)
        save()


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    day = datetime.date.today().isoformat()
    ap.add_argument("--out", default=f"bench/results/{day}-h200-moshi-lanes.json")
    ap.add_argument("--batches", default="8,16,32", help="conversations per lane")
    ap.add_argument("--lanes", default="1,2", help="lane counts")
    ap.add_argument("--frames", type=int, default=16, help="timed frames per conversation")
    ap.add_argument("--frame-ms", type=float, default=80.0, help="audio per frame (the budget)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding rows after this")
    ap.add_argument("--cache-dir", default=os.environ.get("CADENCE_FX_CACHE",
                                                          "/tmp/cadence-fx-moshi-lanes"))
    ap.add_argument("--small", action="store_true", help="the CPU-sized LM (harness checks)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deterministic", action="store_true",
                    help="pin deterministic kernels on both sides (not needed: see the docstring)")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="leave the objects start-up made to the collector (default: gc.freeze())")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more tick per row: kernel ms, launches, top kernels")
    return ap.parse_args()


def main():
    global DEVICE
    args = _args()
    DEVICE = args.device
    start = time.perf_counter()
    if DEVICE == "cuda" and args.deterministic:
        cadence_fx.pin_deterministic_kernels()
    mimi = M.build_mimi(device=DEVICE)
    lm_gen = M.build_lm_gen(device=DEVICE, seed=1, overrides=M.SMALL_LM if args.small else None,
                            dtype=torch.float32 if args.small else torch.bfloat16)
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("CADENCE_COMMIT", "unknown"),
              "lm": "small" if args.small else "7B", "args": vars(args), "rows": [],
              "skipped": [], "stock_s": {}, "build_s": time.perf_counter() - start}

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    lane_counts = sorted(int(x) for x in args.lanes.split(","))
    for batch in [int(x) for x in args.batches.split(",")]:
        _batch_rows(mimi, lm_gen, batch, lane_counts, args, result, start, save)
    good = [r for r in result["rows"] if r.get("realtime") and r.get("all_bit_exact")]
    best = max(good, key=lambda r: (r["conversations"], -r["lanes"]), default=None)
    result["moshi_conversations_per_gpu"] = best["conversations"] if best else 0
    result["best"] = best and {"batch": best["batch"], "lanes": best["lanes"],
                               "tick_p99_ms": best["tick_p99_ms"]}
    result["all_bit_exact"] = all(r.get("all_bit_exact", False) for r in result["rows"])
    result["wall_s"] = time.perf_counter() - start
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, default=str))


if __name__ == "__main__":
    sys.exit(main())
