"""Where a replayed chunk spends the time its kernels do not: a per-kernel timeline of one steady
chunk of the suite's CFM step (SRc) and of the whole flow step, each against stock eager.

    python bench/replay_timeline.py --out DIR [--depth 16]

For each step (``cfm``: the suite's ``CFMStep`` with the estimator's two caches, compiled with
``release_envelopes=True`` as the suite's SRc row; ``flow``: the flow step through the public API,
``minicpmo-token2wav-flow``), one warm stream, then one steady chunk (the second of a turn) under
the profiler, stock and compiled, one chunk per profiler session (``--deterministic`` pins
deterministic kernels on both paths; by default neither is pinned, as in the suite's CFM part). Per chunk: the wall time (CUDA
events around the call, as the suite times it), the GPU span (first device event start to last
end), the kernel time and count (copies and memsets apart), copies and memsets (count, time),
the idle time inside the span (``gaps_ms``) and the largest gaps with the events around them, and
the host time from the call to the first device event, and the idle gaps counted by length.
Writes ``DIR/timeline.json`` (and prints it) and the profiler traces ``DIR/<step>-<path>.json.gz``
(chrome://tracing, Perfetto).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil

import torch

import cadence_fx


def _device_events(prof):
    """Kernels, copies and memsets on the device; the ``chunk`` annotation's device range, which
    spans them all, is not one of them."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "chunk":
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def _kind(name):
    low = name.lower()
    if low.startswith("memcpy") or "memcpy" in low:
        return "copy"
    if low.startswith("memset") or "memset" in low:
        return "memset"
    return "kernel"


def analyse(events, host_start_us, wall_ms):
    if not events:
        return {"wall_ms": wall_ms, "device_events": 0}
    start, end = events[0][0], max(e[1] for e in events)
    busy_until, gaps = start, []
    for s, e, name in events:
        if s > busy_until:
            gaps.append((s - busy_until, busy_until, s, name))
        busy_until = max(busy_until, e)
    row = {"wall_ms": wall_ms, "span_ms": (end - start) / 1e3,
           "host_to_first_device_event_ms": (start - host_start_us) / 1e3,
           "gaps_ms": sum(g[0] for g in gaps) / 1e3, "gaps": len(gaps)}
    for kind in ("kernel", "copy", "memset"):
        mine = [e for e in events if _kind(e[2]) == kind]
        row[f"{kind}s"] = len(mine)
        row[f"{kind}_ms"] = sum(e[1] - e[0] for e in mine) / 1e3
    row["copy_names"] = sorted({e[2] for e in events if _kind(e[2]) == "copy"})
    top = sorted(gaps, reverse=True)[:8]
    prev = {}
    last = None
    for s, e, n in events:
        prev[s] = last
        last = n
    row["top_gaps"] = [{"us": round(g[0], 1), "before": prev.get(g[2]), "after": g[3]} for g in top]
    row["gap_histogram_us"] = gap_histogram(events)
    return row


def profile_call(call, label, trace_dir):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("chunk"):
            a.record()
            call()
            b.record()
        torch.cuda.synchronize()
    host = [e for e in prof.events() if e.name == "chunk"]
    host_start = host[0].time_range.start if host else 0
    row = analyse(_device_events(prof), host_start, a.elapsed_time(b))
    path = os.path.join(trace_dir, f"{label}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)
    return row


def gap_histogram(events):
    """Idle gaps between device events, counted by whole microseconds (10 = 10 or more)."""
    hist, busy = {}, events[0][0] if events else 0
    for s, e, _ in events:
        if s > busy:
            us = min(int(s - busy), 10)
            hist[us] = hist.get(us, 0) + 1
        busy = max(busy, e)
    return dict(sorted(hist.items()))


def profile_paths(name, stock, compiled, warm, call, prompt, trace_dir):
    """Stock (``E``) and ``compiled`` (``SRc``) alike: ``warm(step)`` (the compiled step traces and
    captures), then from ``prompt`` chunk 0 unprofiled and chunk 1 profiled;
    ``call(step, i, state)`` runs chunk ``i`` and returns the new state."""
    res = {}
    for label, step in (("E", stock), ("SRc", compiled)):
        warm(step)
        state = call(step, 0, prompt)
        res[label] = profile_call(lambda: call(step, 1, state), f"{name}-{label}", trace_dir)
    res["SRc"]["replays"] = compiled.counters.replays
    res["SRc"]["fallbacks"] = compiled.counters.fallbacks
    compiled.close()
    return res


def cfm_part(depth, trace_dir):
    from cadence_fx import adapters
    from suite_measure import CFMStream
    stream = CFMStream(depth, chunks=8)
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(stream.step, adapter, release_envelopes=True)

    def call(step, i, state):
        mu, cond = stream.xs[i]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
            return step(mu, stream.spks, cond, state)[1]

    return profile_paths("cfm", stream.step, compiled, stream.run, call, stream.prompt, trace_dir)


def flow_part(depth, trace_dir):
    import suite_whole as tc   # the whole chunk stream (build, run)
    flow, hift, spk, prompt, tokens, last, turn = tc.build(depth, 4)
    compiled = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)

    def call(step, i, state):
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
            return step(tokens[i], spk, state, last_chunk=False)[1]

    def warm(step):
        state = prompt
        for i in range(3):
            state = call(step, i, state)

    return profile_paths("flow", flow, compiled, warm, call, prompt, trace_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a directory")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--parts", default="cfm,flow")
    ap.add_argument("--deterministic", action="store_true",
                    help="pin deterministic kernels on both paths (the suite's CFM part does not)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "depth": a.depth,
           "deterministic_kernels": a.deterministic}
    for part in a.parts.split(","):
        res[part] = (cfm_part if part == "cfm" else flow_part)(a.depth, a.out)
        e, s = res[part]["E"], res[part]["SRc"]
        s["wall_vs_E_kernel_ms"] = s["wall_ms"] / e["kernel_ms"] if e.get("kernel_ms") else None
        print(part, json.dumps({k: v for k, v in s.items() if not isinstance(v, list)}), flush=True)
    with open(os.path.join(a.out, "timeline.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))   # in the log too: the device returns a few files only


if __name__ == "__main__":
    main()
