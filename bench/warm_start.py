"""Cold vs warm start with the persistent compile cache, in fresh processes, alternated on one host.

    python bench/warm_start.py --model token2wav --device cuda --runs 3 --out warm.json

Each run is a fresh process that builds the demo's stream of ``--model`` (``cadence_fx/demo.py``:
the real model, a turn reset in the middle), then runs the compiled stream twice: the first pass
meets every class of the stream and compiles it (cold: an empty cache directory; trace, passes,
probationary call, capture) or loads it compiled (warm: the directory the cold run before it
filled) and captures it; the second pass is steady. ``compile_s`` is the first pass's wall time minus the steady pass's: what a
restart costs before the stream runs at full speed. Runs alternate cold, warm, cold, warm, ... so a
drift in the host's speed touches both. Per run: ``first_pass_s``, ``steady_pass_s``,
``compile_s``, and the breakdown summed over the compiled steps: ``trace_s`` (tracing),
``load_s`` (reading the cache), ``thaw_s`` (making the loaded classes' modules), ``store_s``
(writing the cache), ``passes_s``, ``probe_s``, ``capture_s``, with ``traces``,
``cache_loads`` and ``compiled_loads`` (classes loaded compiled: no passes, no probe), the
``replays`` and ``fallbacks`` of both passes, and ``exact_chunks`` per pass (chunks equal to the
stock stream's, ``torch.equal``, out of ``chunks``); for the fused regions, ``fused_regions``,
``fusions_loaded`` (verdict and code from the cache), ``verifications`` (eager runs that verified
regions before a capture), ``kernel_loads``, ``kernel_stores`` and ``kernel_load_s`` (reading and
deserializing the regions' code). Every child gets empty Inductor and Triton cache directories
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``); ``inductor_cache_files`` counts their files at
its start and end: a warm run starts from the cadence_fx cache directory alone. The result keeps
every run and the best of each kind: ``whole_cold_s`` and ``whole_warm_s`` for token2wav (the
whole catalog), ``moshi_cold_s`` and ``moshi_warm_s`` for moshi (``--model token2wav,moshi``
measures both, alternated within each pair).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _files(*envs) -> int:
    return sum(sum(len(f) for _, _, f in os.walk(os.environ[e])) for e in envs if e in os.environ)


CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def child(model: str, device: str, chunks) -> dict:
    at_start = _files(*CACHES)
    import torch

    from cadence_fx.demo import _Clock
    from cadence_fx.demo_streams import BUILDERS, _same

    dev = torch.device(device)
    if model == "token2wav" and dev.type == "cuda":
        from cadence_fx.determinism import pin_deterministic_kernels
        pin_deterministic_kernels()
    stream = BUILDERS[model](dev, chunks or (16 if dev.type == "cuda" else 4))
    ref = stream.stock(_Clock(dev))                    # library set-up: not a restart's cost
    if stream.prepare_compiled is not None:
        stream.prepare_compiled()
    passes, outs = [], []
    for _ in range(2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(stream.compiled(_Clock(dev)))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        passes.append(time.perf_counter() - t0)
    equal = stream.equal or _same
    steps = list(stream.steps.values())
    records = [e.records for s in steps for e in s.classes.values()]
    return {
        "first_pass_s": passes[0], "steady_pass_s": passes[1], "compile_s": passes[0] - passes[1],
        "trace_s": sum(e.traced.seconds for s in steps for e in s.classes.values()),
        "load_s": sum(s.compile_cache.load_seconds for s in steps if s.compile_cache),
        "thaw_s": sum(r.load_s or 0.0 for r in records),
        "store_s": sum(s.compile_cache.store_seconds for s in steps if s.compile_cache),
        "passes_s": sum(p.seconds for r in records for p in r.passes),
        "probe_s": sum(r.probe_s or 0.0 for r in records),
        "capture_s": sum(getattr(s.backend, "capture_seconds", 0.0) for s in steps),
        "traces": sum(s.counters.traces for s in steps),
        "cache_loads": sum(s.counters.cache_loads for s in steps),
        "compiled_loads": sum(s.counters.compiled_loads for s in steps),
        "replays": sum(s.counters.replays for s in steps),
        "fallbacks": sum(s.counters.fallbacks for s in steps),
        # both passes against the stock stream, chunk by chunk (torch.equal)
        "exact_chunks": [sum(map(equal, ref, o)) for o in outs], "chunks": len(ref),
        "classes": sum(len(s.classes) for s in steps),
        "fused_regions": sum(s.counters.fused_regions for s in steps),
        "fusions_refused": sum(s.counters.fusions_refused for s in steps),
        "fusions_loaded": sum(s.counters.fusions_loaded for s in steps),
        "verifications": sum(getattr(s.backend, "verifications", 0) for s in steps),
        "warmups": sum(getattr(s.backend, "warmups", 0) for s in steps),
        "kernel_loads": _store(steps).loads if _store(steps) else 0,
        "kernel_stores": _store(steps).stores if _store(steps) else 0,
        "kernel_load_s": _store(steps).load_seconds if _store(steps) else 0.0,
        "inductor_cache_files": [at_start, _files(*CACHES)],
    }


def _store(steps):
    return next((s.kernel_store for s in steps if getattr(s, "kernel_store", None)), None)


_CACHE = {}


def _run(model: str, kind: str, pair: int, a) -> dict:
    """One fresh process: cold (the model's cadence_fx cache emptied first) or warm (from the
    cold run's), with empty Inductor and Triton caches either way."""
    cache = _CACHE.setdefault(model, tempfile.mkdtemp(prefix=f"cadence-warm-start-{model}-"))
    if kind == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    scratch = [tempfile.mkdtemp(prefix=f"cadence-{c.lower()}-") for c in CACHES]
    env = dict(os.environ, CADENCE_FX_CACHE_DIR=cache, **dict(zip(CACHES, scratch)))
    cmd = [sys.executable, __file__, "--child", "--model", model, "--device", a.device]
    if a.chunks:
        cmd += ["--chunks", str(a.chunks)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
    if out.returncode != 0:
        sys.exit(f"warm_start: the {kind} run of {model} failed:\n{out.stderr[-3000:]}")
    row = dict(json.loads(out.stdout.strip().splitlines()[-1]), model=model, kind=kind, pair=pair)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="token2wav", help="a model, or several: token2wav,moshi")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--runs", type=int, default=2, help="cold/warm pairs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.device, a.chunks)))
        return 0
    import torch
    runs = []
    models = a.model.split(",")
    for pair in range(a.runs):
        for model in models:
            for kind in ("cold", "warm"):
                runs.append(_run(model, kind, pair, a))
    best = lambda model, kind: min((r["compile_s"] for r in runs  # noqa: E731
                                    if r["kind"] == kind and r["model"] == model), default=None)
    result = {"model": a.model, "device": a.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
              "commit": os.environ.get("CADENCE_COMMIT", "unknown"), "fusion": "on (default)",
              "inductor_cache": "empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR per process",
              "whole_cold_s": best("token2wav", "cold"), "whole_warm_s": best("token2wav", "warm"),
              "moshi_cold_s": best("moshi", "cold"), "moshi_warm_s": best("moshi", "warm"),
              "all_bit_exact": all(r["exact_chunks"] == [r["chunks"]] * 2 for r in runs),
              "runs": runs}
    for d in _CACHE.values():
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
