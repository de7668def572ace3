"""The benchmark suite on one GPU: the ablation, the peers and the floor, in one process and run.

    python bench/suite.py --out bench/results/<date>-h200.json [--configs E,S,SRc,R,Rc,V,B,T,TM]
                          [--parts cfm,whole,moshi] [--depth 16] [--chunks 12]

Model: the real Token2Wav CFM loop (``CFMStep``: ``CausalConditionalCFM.forward_chunk`` + the
retention of ``stepaudio2/token2wav.py``; DiT depth 16, 10 Euler steps, CFG 0.7, random weights),
302-frame prompt state, two turns of 50-frame chunks each ending with a 56-frame call, under
``autocast("cuda", float32)`` as the stock loop runs it. Configurations:

* E: stock eager. S: state rule only (carries, rewritten graph run eagerly, no device graphs).
* R: replay only: device graphs over the stock state, staged (copied in) every call.
* Rc: replay with the stock-sized state bound by address (``Options.alias_state``).
* SRc: both rules, the product (``release_envelopes=True``: the stock envelope is freed). It runs
  first among the cadence configurations, so its warm-up pass is the cold compile of the catalog;
  the others reuse its traces (``trace_cache``) where their signatures match (keeping them copies
  each traced graph inside that cold compile, so a run with one cadence configuration keeps none).
* T / TM: ``torch.compile(mode="reduce-overhead" / "max-autotune")`` of the same step (TM runs in a
  subprocess under a time limit).
* V: the vendor's CUDA-graph branch as shipped (``CausalConditionalCFM.scatter_cuda_graph``:
  buckets 30/48/96). B: the same branch re-bucketed to the live widths 50/56 (padded to 500 cached
  frames, as the vendor pads).

Per configuration: per-chunk p50/p95 over ``--blocks`` timed passes of the stream (CUDA events,
after a warm-up pass), the paired 95% bootstrap interval of the per-chunk latency ratio against E,
peak memory over a memory pass of its own (``max_memory_allocated``, ``memory_reserved``: the whole
process, model included), kernel time (the floor: sum of GPU kernel durations per chunk, profiler)
and launches per chunk, compile and capture time, replays and fallbacks, and blocks bit-exact
against E (``torch.equal`` on mel and state, every chunk, on the device). docs/benchmarks.md
has the details. ``whole``: the whole Token2Wav chunk (flow + HiFT) E vs SRc. ``moshi``: E, V, cadence
(``bench/moshi_frame.py``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

import cadence_fx
from cadence_fx.demo import same_state  # mel/state equal; undeclared stock rows zero
from cadence_fx.pipeline import Options

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCKS = 8   # timed passes over the whole stream per configuration (--blocks)
ROW_KEYS = ("p50_ms", "p95_ms", "peak_bytes", "reserved_bytes", "bit_exact_blocks", "blocks",
            "replays", "fallbacks", "floor_ms", "status")


# -- measurement ----------------------------------------------------------------------------------

def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def ratio_ci(times, ref, n=2000, seed=0):
    """Paired 95% bootstrap interval of mean(t_i / ref_i) over chunks."""
    r = [a / b for a, b in zip(times, ref)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choice(r) for _ in r) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n) - 1]], statistics.fmean(r)


def cleanup():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def profile(run):
    """Kernel time (ms, copies and memsets excluded) and launches (kernel launches, graph
    launches, async copies) of ``run()``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA
                    and not e.key.startswith(("Memcpy", "Memset")))
    launches = {}
    for e in avg:
        if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                     "cudaGraphLaunch", "cudaMemcpyAsync"):
            launches[e.key] = launches.get(e.key, 0) + e.count
    return kernel_us / 1e3, launches


class CFMStream:
    """The CFM stream: inputs, the stock step, and one pass of any step over it."""

    def __init__(self, depth, chunks, device="cuda"):
        from cadence_fx.models.token2wav import CFMStep, build_cfm, prime_cfm
        self.step = CFMStep(build_cfm(depth, device=device))
        self.spks, self.prompt = prime_cfm(self.step, device=device)
        g = torch.Generator().manual_seed(9)
        turn = [50] * (chunks // 2 - 1) + [56]
        self.widths = turn * 2
        self.xs = [(torch.randn(1, 80, w, generator=g).to(device), torch.zeros(1, 80, w, device=device))
                   for w in self.widths]
        self.resets = {0, len(self.xs) // 2}

    def run(self, step, times=None, check=None, limit=None):
        """One pass; ``check(i, mel, state)`` sees every chunk after its timing, ``limit`` stops
        after that many chunks."""
        state = self.prompt
        for i, (mu, cond) in enumerate(self.xs[:limit]):
            if i in self.resets:
                state = self.prompt
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
                mel, state = step(mu, self.spks, cond, state)
            end.record()
            if times is not None:
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            if check is not None:
                check(i, mel, state)


def host_copy(mel, state):
    """A copy in pinned host memory (never a view: stock state aliases the module's scratch
    buffers), compared later on the device without a host-side pass over gigabytes."""
    def pin(t):
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return h.copy_(t)
    return pin(mel), {k: pin(v) for k, v in state.items()}


def matches(ref, mel, state):
    dev = mel.device
    return same_state((ref[0].to(dev, non_blocking=True),
                       {k: v.to(dev, non_blocking=True) for k, v in ref[1].items()}), (mel, state))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(stream, step, ref, ref_times, *, warm=True, prof=True, blocks=None):
    """Warm-up pass; a memory pass (peak allocated and reserved over a whole stream, nothing else
    held); ``blocks`` timed passes over the stream, every chunk compared on the device with the
    reference (a block is bit-exact when all its chunks are); the profiled kernel floor. With
    ``ref=None`` (E) the first timed block is the reference, so the later ones check that the
    stock path reproduces itself."""
    blocks = blocks or BLOCKS
    t0 = time.perf_counter()
    if warm:
        stream.run(step)
    warm_s = time.perf_counter() - t0
    log(f"  warm pass {warm_s:.1f} s")
    cleanup()
    torch.cuda.reset_peak_memory_stats()
    stream.run(step)
    torch.cuda.synchronize()
    row = {"peak_bytes": torch.cuda.max_memory_allocated(),
           "reserved_bytes": torch.cuda.memory_reserved(), "warm_pass_s": warm_s}
    times, exact_blocks, exact_chunks = [], 0, 0
    for b in range(blocks):
        if ref is None:
            ref = []
            stream.run(step, times, check=lambda i, mel, state: ref.append(host_copy(mel, state)))
            same = [True] * len(ref)
        else:
            same = []
            stream.run(step, times, check=lambda i, mel, state: same.append(matches(ref[i], mel, state)))
        exact_blocks += all(same)
        exact_chunks += sum(same)
    row.update({"p50_ms": statistics.median(times), "p95_ms": p95(times), "blocks": blocks,
                "chunks_per_block": len(stream.xs), "bit_exact_blocks": exact_blocks,
                "bit_exact_chunks": exact_chunks, "times_ms": times})
    log(f"  timed {blocks} blocks: p50 {row['p50_ms']:.1f} ms, p95 {row['p95_ms']:.1f} ms; "
        f"{exact_blocks}/{blocks} blocks bit-exact")
    if ref_times is not None:
        row["ratio_vs_E_ci95"], row["ratio_vs_E_mean"] = ratio_ci(times, ref_times)
    if prof:  # two steady chunks, nothing compared
        n = 2
        kernel_ms, launches = profile(lambda: stream.run(step, limit=1 + n))
        first_ms, first = profile(lambda: stream.run(step, limit=1))  # turn start
        row["floor_ms"] = (kernel_ms - first_ms) / n
        row["launches_per_chunk"] = {k: (v - first.get(k, 0)) / n for k, v in launches.items()}
        log(f"  profiled: {row['floor_ms']:.1f} ms kernel time per chunk")
    else:
        row["floor_ms"] = None
        row["floor_note"] = "not profiled in this run (--no-floor)"
    return ref, row


def compile_breakdown(*compiled):
    """Where the cold compile of these compiled steps went, summed over their classes."""
    entries = [e for c in compiled for e in c.classes.values()]
    return {"trace_s": sum(e.traced.seconds for e in entries),
            "copied_calls": sum(c.counters.copied_calls for c in compiled),
            "passes_s": sum(p["seconds"] for e in entries for p in e.records["passes"]),
            "probe_s": sum(e.records.get("probe_s", 0.0) for e in entries),
            "capture_s": sum(getattr(c.backend, "capture_seconds", 0.0) for c in compiled),
            "warmup_s": sum(getattr(c.backend, "warmup_seconds", 0.0) for c in compiled)}


def counters_row(compiled):
    k = compiled.counters
    backend = compiled.backend
    return {"replays": k.replays, "fallbacks": k.fallbacks, "invalidations": k.invalidations,
            "classes": len(compiled.classes), "traces": k.traces, **compile_breakdown(compiled),
            "graphs_captured": getattr(backend, "captured", 0),
            "staging_bytes": getattr(backend, "staging_bytes", 0),
            "released_bytes": k.released_bytes,
            "fallback_reasons": dict(list(k.reasons.items())[:5])}


# -- configurations -------------------------------------------------------------------------------

TRACES: dict = {}   # traces shared by the cadence configurations (the first one traces cold)


NO_FLOOR: set = set()   # configurations not profiled (--no-floor)


def run_cadence(stream, ref, ref_times, name, share_traces=True, **compile_kwargs):
    from cadence_fx import adapters
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(stream.step, adapter, trace_cache=TRACES if share_traces else None,
                                  **compile_kwargs)
    try:
        _, row = measure(stream, compiled, ref, ref_times, prof=name not in NO_FLOOR)
        row.update(counters_row(compiled))
        row["trace_cache"] = "shared" if share_traces else "none"
        row["status"] = "ok"
        return row
    finally:
        compiled.close()
        del compiled
        cleanup()


class CountingGraph:
    """Stands in for a vendor ``torch.cuda.CUDAGraph`` to count its replays."""

    def __init__(self, graph, counter):
        self.graph, self.counter = graph, counter

    def replay(self):
        self.counter[0] += 1
        self.graph.replay()


def capture_buckets(dit, sizes):
    """The vendor branch's capture (``DiT._init_cuda_graph_chunk``) at other bucket sizes:
    ``sizes`` maps a chunk width to the cached frames it pads to."""
    dtype, device = dit.cnn_cache_buffer.dtype, dit.cnn_cache_buffer.device
    blocks = len(dit.blocks)
    with torch.no_grad():
        for chunk, max_size in sizes.items():
            dit.max_size_chunk[chunk] = max_size
            x = torch.zeros(2, 320, chunk, dtype=dtype, device=device)
            t = torch.zeros(2, 1, 512, dtype=dtype, device=device)
            mask = torch.ones(2, chunk, max_size + chunk, dtype=torch.bool, device=device)
            cnn = torch.zeros(blocks, 2, 1024, 2, dtype=dtype, device=device)
            att = torch.zeros(blocks, 2, 8, max_size, 128, dtype=dtype, device=device)
            new_cnn = torch.zeros(blocks, 2, 1024, 2, dtype=dtype, device=device)
            new_att = torch.zeros(blocks, 2, 8, max_size + chunk, 128, dtype=dtype, device=device)
            dit.blocks_forward_chunk(x, t, mask, cnn, att, new_cnn, new_att)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = dit.blocks_forward_chunk(x, t, mask, cnn, att, new_cnn, new_att)
            dit.inference_buffers_chunk[chunk] = {"static_inputs": [x, t, mask, cnn, att],
                                                  "static_outputs": [out, new_cnn, new_att]}
            dit.graph_chunk[chunk] = graph
    dit.use_cuda_graph = True


def run_vendor(stream, ref, ref_times, rebucket):
    dit = stream.step.cfm.estimator
    counter = [0]
    t0 = time.perf_counter()
    try:
        if rebucket:
            capture_buckets(dit, {50: 500, 56: 500})
        else:
            stream.step.cfm.scatter_cuda_graph(True)   # the branch as shipped
        capture_s = time.perf_counter() - t0
        dit.graph_chunk = {k: CountingGraph(g, counter) for k, g in dit.graph_chunk.items()}
        calls, forward_chunk = [0], dit.forward_chunk

        def counted(*a, **k):   # every estimator call (10 Euler steps per chunk)
            calls[0] += 1
            return forward_chunk(*a, **k)
        dit.forward_chunk = counted
        _, row = measure(stream, stream.step, ref, ref_times, prof=("B" if rebucket else "V") not in NO_FLOOR)
        row.update(replays=counter[0], fallbacks=calls[0] - counter[0], estimator_calls=calls[0],
                   capture_s=capture_s, buckets=sorted(dit.graph_chunk), status="ok",
                   note="replays and fallbacks count estimator calls (10 per chunk)")
        return row
    finally:
        dit.__dict__.pop("forward_chunk", None)
        dit.use_cuda_graph = False
        dit.graph_chunk, dit.inference_buffers_chunk, dit.max_size_chunk = {}, {}, {}
        cleanup()


def run_torch_compile(stream, ref, ref_times, mode, target="step"):
    """T / TM: ``torch.compile`` of the step itself. When that does not compile or run (or with
    ``target="estimator"``), the same mode on what it can take, the estimator's
    ``forward_chunk`` (10 calls per chunk), recorded as such with the step's error."""
    import torch._dynamo
    dit = stream.step.cfm.estimator
    step_error = "not attempted in this run (--t-target estimator)"
    try:
        if target == "step":
            return _torch_compile_row(stream, ref, ref_times, mode, target="CFMStep")
    except Exception as ex:  # noqa: BLE001 - recorded, then the estimator alone
        step_error = f"{type(ex).__name__}: {str(ex).splitlines()[0][:300]}"
        log(f"  torch.compile of the step failed ({step_error}); the estimator alone")
    plain = dit.forward_chunk
    dit.forward_chunk = torch.compile(plain, mode=mode, dynamic=False)
    try:
        row = _torch_compile_row(stream, ref, ref_times, mode, target="DiT.forward_chunk",
                                 compiled=stream.step)
        row["status"] = f"the step: {step_error}; on the estimator: {row['status']}"
        return row
    finally:
        dit.__dict__.pop("forward_chunk", None)
        torch._dynamo.reset()
        cleanup()


def _torch_compile_row(stream, ref, ref_times, mode, target, compiled=None):
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    if compiled is None:
        compiled = torch.compile(stream.step, mode=mode, dynamic=False)
    try:
        t0 = time.perf_counter()
        stream.run(compiled)
        compile_s = time.perf_counter() - t0
        log(f"  compiled and ran one pass in {compile_s:.1f} s")
        _, row = measure(stream, compiled, ref, ref_times, warm=False)
        row.update(target=target, mode=mode, compile_s=compile_s, replays=None, fallbacks=None,
                   graph_breaks=sum(counters["graph_break"].values()),
                   graph_break_reasons=list(counters["graph_break"])[:5],
                   unique_graphs=counters["stats"].get("unique_graphs"),
                   cudagraph_skips=dict(counters["inductor"]).get("cudagraph_skips"),
                   recompiles=dict(counters["recompiles"]),
                   status="ok" if row["bit_exact_blocks"] == row["blocks"] else
                   f"runs, not bit-exact ({row['bit_exact_blocks']}/{row['blocks']} blocks)")
        if row["bit_exact_blocks"] < row["blocks"]:
            diffs = []
            stream.run(compiled, check=lambda i, mel, state: diffs.append(
                float((ref[i][0].to(mel.device) - mel).abs().max())))
            row["max_abs_diff_mel"] = max(diffs)
        return row
    finally:
        del compiled
        torch._dynamo.reset()
        cleanup()


# -- parts ---------------------------------------------------------------------------------------

def cfm_part(args, configs, save, device="cuda"):
    stream = CFMStream(args.depth, args.chunks, device)
    cleanup()
    res = {"model": f"CFMStep, DiT depth {args.depth}, 10 Euler steps, CFG 0.7",
           "chunks": len(stream.xs), "widths": stream.widths, "turn_resets": sorted(stream.resets)}
    log("E")
    ref, e = measure(stream, stream.step, None, None, prof="E" not in NO_FLOOR)
    e.update(replays=0, fallbacks=0, status="ok")
    res["E"] = e
    save(res)
    # the traces are kept for the other cadence configurations only when there are any: keeping
    # them copies every traced graph, inside the cold compile of the configuration that traced it
    share = sum(c in ("S", "SRc", "R", "Rc") for c in configs) > 1
    jobs = {
        "S": lambda: run_cadence(stream, ref, e["times_ms"], "S", share, graphs=False),
        "SRc": lambda: run_cadence(stream, ref, e["times_ms"], "SRc", share, release_envelopes=True),
        "R": lambda: run_cadence(stream, ref, e["times_ms"], "R", share, state_rule=False),
        "Rc": lambda: run_cadence(stream, ref, e["times_ms"], "Rc", share,
                                  options=Options(state_rule=False, alias_state=True)),
        "V": lambda: run_vendor(stream, ref, e["times_ms"], rebucket=False),
        "B": lambda: run_vendor(stream, ref, e["times_ms"], rebucket=True),
        "T": lambda: run_torch_compile(stream, ref, e["times_ms"], args.t_mode, args.t_target),
    }
    for name in configs:
        if name in ("E", "TM"):
            continue
        t0 = time.perf_counter()
        log(name)
        try:
            res[name] = jobs[name]()
        except Exception as ex:  # noqa: BLE001 - recorded, the suite goes on
            res[name] = {"status": f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:300]}",
                         "traceback": traceback.format_exc()[-2000:]}
            cleanup()
        res[name]["config_wall_s"] = time.perf_counter() - t0
        print(f"{name}: {json.dumps({k: res[name].get(k) for k in ROW_KEYS})}", flush=True)
        save(res)
    if "TM" in configs:
        res["TM"] = run_subprocess_config("TM", args)
    return res


def run_subprocess_config(name, args):
    """A configuration that may not finish (max-autotune): its own process, a wall-clock limit."""
    out = f"/tmp/suite-{name}.json"
    cmd = [sys.executable, __file__, "--out", out, "--parts", "cfm", "--configs", "E,T",
           "--depth", str(args.depth), "--chunks", str(args.chunks), "--blocks", str(args.blocks),
           "--t-mode", "max-autotune", "--t-target", args.t_target]
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, timeout=args.tm_timeout, check=True, capture_output=True, text=True)
        with open(out) as f:
            row = json.load(f)["cfm"]["T"]
        row["note"] = "mode='max-autotune', in a subprocess"
        return row
    except subprocess.TimeoutExpired:
        return {"status": f"did not finish compiling and running within {args.tm_timeout} s "
                          "(max-autotune)", "wall_s": time.perf_counter() - t0}
    except Exception as ex:  # noqa: BLE001
        return {"status": f"failed: {type(ex).__name__}: {str(ex)[-300:]}"}


def whole_part(args):
    """The whole chunk (flow + HiFT), E vs SRc, deterministic kernels on both sides, ``BLOCKS``
    timed passes each (every pass starts from the same generator state)."""
    cadence_fx.pin_deterministic_kernels()   # stock HiFT is not reproducible without them
    sys.path.insert(0, HERE)
    import token2wav_chunk as tc
    flow, hift, spk, prompt, tokens, last, turn = tc.build(args.depth, args.chunks)
    cleanup()

    def timed(f, h, ref):
        torch.cuda.reset_peak_memory_stats()
        ms, exact = [], 0
        for _ in range(BLOCKS):
            outs, t = tc.run(f, h, spk, prompt, tokens, last, turn)
            ref = ref or outs
            exact += all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, outs))
            ms += t
        return ref, ms, {"p50_ms": statistics.median(ms), "p95_ms": p95(ms),
                         "peak_bytes": torch.cuda.max_memory_allocated(),
                         "reserved_bytes": torch.cuda.memory_reserved(), "blocks": BLOCKS,
                         "chunks_per_block": len(tokens), "bit_exact_blocks": exact}

    res = {}
    tc.run(flow, hift, spk, prompt, tokens, last, turn)
    ref, ref_ms, res["E"] = timed(flow, hift, None)
    res["E"].update(replays=0, fallbacks=0, status="ok")
    log(f"  E p50 {res['E']['p50_ms']:.1f} ms, {res['E']['bit_exact_blocks']}/{BLOCKS} blocks reproduce")
    t0 = time.perf_counter()
    cflow = cadence_fx.compile(flow, "minicpmo-token2wav-flow", release_envelopes=True)
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift")
    tc.run(cflow, chift, spk, prompt, tokens, last, turn)
    cold_s = time.perf_counter() - t0
    _, ms, res["SRc"] = timed(cflow, chift, ref)
    res["SRc"].update(
        replays=cflow.counters.replays + chift.counters.replays,
        fallbacks=cflow.counters.fallbacks + chift.counters.fallbacks,
        cold_compile_s=cold_s, **compile_breakdown(cflow, chift),
        classes=len(cflow.classes) + len(chift.classes), status="ok")
    res["SRc"]["ratio_vs_E_ci95"], res["SRc"]["ratio_vs_E_mean"] = ratio_ci(ms, ref_ms)
    log(f"  SRc p50 {res['SRc']['p50_ms']:.1f} ms, {res['SRc']['bit_exact_blocks']}/{BLOCKS} blocks "
        f"bit-exact, cold compile {cold_s:.1f} s")
    res["deterministic_kernels"] = True
    cflow.close()
    chift.close()
    return res


def moshi_part(args):
    out = "/tmp/suite-moshi.json"
    subprocess.run([sys.executable, os.path.join(HERE, "moshi_frame.py"), "--out", out],
                   check=True, timeout=900)
    with open(out) as f:
        return json.load(f)


def main():
    global BLOCKS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="E,SRc,S,R,Rc,V,B,T,TM",
                    help="in this order; the first cadence configuration traces cold (SRc: its "
                         "warm_pass_s is the cold compile of the catalog), later ones reuse traces")
    ap.add_argument("--parts", default="cfm,whole,moshi")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=BLOCKS, help="timed passes over the stream")
    ap.add_argument("--tm-timeout", type=int, default=300)
    ap.add_argument("--t-mode", default="reduce-overhead", help="torch.compile mode of T")
    ap.add_argument("--t-target", default="step", choices=("step", "estimator"),
                    help="what T compiles first (the estimator is the fallback either way)")
    ap.add_argument("--no-floor", default="", help="configurations not profiled, e.g. R,Rc,V")
    args = ap.parse_args()
    BLOCKS = args.blocks
    NO_FLOOR.update(filter(None, args.no_floor.split(",")))
    configs = args.configs.split(",")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "commit": os.environ.get("CADENCE_COMMIT", "unknown"),
              "deterministic_kernels": "cfm: no; whole_chunk: yes (both sides)"}
    t0 = time.perf_counter()
    parts = args.parts.split(",")
    def save(cfm):
        result["cfm"] = cfm
        for name, row in cfm.items():   # the flat per-configuration view
            if isinstance(row, dict) and "status" in row:
                result[name] = {k: row.get(k) for k in ROW_KEYS}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if "cfm" in parts:
        save(cfm_part(args, configs, save))
    if "whole" in parts:
        log("whole chunk")
        try:
            result["whole_chunk"] = whole_part(args)
        except Exception as ex:  # noqa: BLE001
            result["whole_chunk"] = {"status": f"failed: {type(ex).__name__}: {ex}"}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if "moshi" in parts:
        log("moshi")
        try:
            m = moshi_part(args)
            result["moshi"] = {"E": m["E"], "V": m.get("V"), "cadence": m["cadence"],
                               "streams": m["streams"], "frames_per_stream": m["frames_per_stream"]}
        except Exception as ex:  # noqa: BLE001
            result["moshi"] = {"status": f"failed: {type(ex).__name__}: {ex}"}
    result["wall_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k in ROW_KEYS or len(k) <= 3}, indent=1))


if __name__ == "__main__":
    main()
