"""Where a start-up's seconds go, and what loading compiled region kernels costs.

    python bench/probe_startup.py --model token2wav --out DIR      # cold then warm, profiled
    python bench/probe_startup.py --artifacts DIR                   # standalone_compile save/load
    python bench/probe_startup.py --kernels CACHE_DIR [--threads N]  # load every stored kernel

The first form runs ``bench/warm_start.py``'s child twice in fresh processes (cold into an empty
cache directory, then warm from it), each under cProfile, and counts per process the fused
regions' compiles: calls of ``fusion.compile_region``, distinct ``(graph, layout)`` keys, time in
``torch._inductor.compile`` and in ``FusedRegion.verify``. With ``--keep N`` the cold process
also saves the first N distinct regions (graph module, inputs, stock outputs) for the second form.

The second form compiles each saved region with ``torch._inductor.standalone_compile`` (AOT
artifact when this torch has it), serializes it, and in a fresh process with empty Inductor and
Triton cache directories deserializes and runs it, comparing bits with the stock outputs.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def instrument(keep_dir=None, keep=0):
    import torch

    from cadence_fx import fusion
    stats = {"compile_region_calls": 0, "distinct": 0, "inductor_compiles": 0,
             "inductor_s": 0.0, "verify_s": 0.0, "verifies": 0, "compile_region_s": 0.0}
    seen = set()
    inner = torch._inductor.compile

    def timed_compile(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            stats["inductor_compiles"] += 1
            stats["inductor_s"] += time.perf_counter() - t
    torch._inductor.compile = timed_compile
    orig = fusion.compile_region

    def compile_region(module, args, graph=None):
        t = time.perf_counter()
        stats["compile_region_calls"] += 1
        out = orig(module, args, graph)
        key = (graph, fusion.layout_key(args))
        if key not in seen:
            seen.add(key)
            stats["distinct"] += 1
            if keep_dir and len(seen) <= keep and isinstance(module, torch.fx.GraphModule):
                with torch.no_grad():
                    expected = module(*args)
                torch.save({"gm_code": None, "args": [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args],
                            "expected": [e.clone() for e in expected]}, Path(keep_dir) / f"r{len(seen):04d}.pt")
                import pickle
                (Path(keep_dir) / f"r{len(seen):04d}.gm").write_bytes(pickle.dumps(module))
        stats["compile_region_s"] += time.perf_counter() - t
        return out
    fusion.compile_region = compile_region
    verify = fusion.FusedRegion.verify

    def timed_verify(self, args):
        t = time.perf_counter()
        try:
            return verify(self, args)
        finally:
            stats["verifies"] += 1
            stats["verify_s"] += time.perf_counter() - t
    fusion.FusedRegion.verify = timed_verify
    return stats


def child(model, out_dir, tag, keep):
    sys.path.insert(0, str(Path(__file__).parent))
    import warm_start
    keep_dir = None
    if keep:
        keep_dir = Path(out_dir) / "regions"
        keep_dir.mkdir(exist_ok=True)
    stats = instrument(keep_dir, keep)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    row = warm_start.child(model, "cuda", None)
    prof.disable()
    row["wall_s"] = time.perf_counter() - t
    row.update(stats)
    s = io.StringIO()
    p = pstats.Stats(prof, stream=s)
    p.sort_stats("cumulative").print_stats(70)
    p.sort_stats("tottime").print_stats(40)
    (Path(out_dir) / f"profile-{model}-{tag}.txt").write_text(s.getvalue())
    print(json.dumps(row))


def artifacts(region_dir, out):
    """Compile and serialize each kept region; then load them in a fresh process."""
    import pickle

    import torch

    from cadence_fx import fusion
    sc = torch._inductor.standalone_compile
    import inspect
    params = inspect.signature(sc).parameters
    aot = "aot" in params
    rows = []
    blob_dir = Path(region_dir) / "blobs"
    blob_dir.mkdir(exist_ok=True)
    for gm_path in sorted(Path(region_dir).glob("r*.gm")):
        gm = pickle.loads(gm_path.read_bytes())
        d = torch.load(gm_path.with_suffix(".pt"), weights_only=False)
        args = d["args"]
        t = time.perf_counter()
        import torch._inductor.config as config
        with config.patch(fusion._numerics()), torch.no_grad():
            try:
                kw = {"aot": True} if aot else {}
                art = sc(fusion.inductor_form(gm), list(args), dynamic_shapes="from_example_inputs",
                         options={}, **kw)
                path = blob_dir / (gm_path.stem + ".bin")
                art.save(path=str(path), format="binary")
                ok = True
            except Exception as e:  # noqa: BLE001
                ok = repr(e)[:300]
        rows.append({"region": gm_path.stem, "compile_s": time.perf_counter() - t, "saved": ok,
                     "bytes": (blob_dir / (gm_path.stem + ".bin")).stat().st_size if ok is True else 0})
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp())
    res = subprocess.run([sys.executable, __file__, "--load", str(region_dir)], env=env,
                         capture_output=True, text=True)
    result = {"torch": torch.__version__, "aot": aot, "params": list(params), "compiled": rows,
              "load": res.stdout[-20000:], "load_err": res.stderr[-5000:]}
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("compiled",)})[:3000])


def load(region_dir):
    t0 = time.perf_counter()
    import torch
    import torch._inductor  # noqa: F401
    t_import = time.perf_counter() - t0
    from torch._inductor import CompiledArtifact
    rows, exact = [], 0
    t_all = time.perf_counter()
    loaded = []
    for path in sorted((Path(region_dir) / "blobs").glob("*.bin")):
        t = time.perf_counter()
        try:
            art = CompiledArtifact.load(path=str(path), format="binary")
        except Exception as e:  # noqa: BLE001
            rows.append({"region": path.stem, "error": repr(e)[:300]})
            continue
        rows.append({"region": path.stem, "load_s": time.perf_counter() - t})
        loaded.append((path, art))
    load_s = time.perf_counter() - t_all
    t_run = time.perf_counter()
    for path, art in loaded:
        d = torch.load(Path(region_dir) / (path.stem + ".pt"), weights_only=False)
        with torch.no_grad():
            got = art(*d["args"])
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        from cadence_fx.fusion import _difference
        exact += _difference(d["expected"], got) is None
    torch.cuda.synchronize()
    print(json.dumps({"import_s": t_import, "load_all_s": load_s, "first_run_all_s": time.perf_counter() - t_run,
                      "exact": exact, "n": len(loaded), "rows": rows[:50]}))


def kernels(cache_dir, threads, out):
    """Deserialize every kernel entry of a cadence_fx cache directory in this (fresh) process,
    timing reading, unpickling and Inductor's post-compile per entry, serially or on threads."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch._inductor  # noqa: F401
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as B

    from cadence_fx import region_kernels
    paths = sorted((Path(cache_dir) / "kernels").glob("*.kernel"))
    phases = {"read_s": 0.0, "unpickle_s": 0.0, "post_compile_s": 0.0}

    def one(path):
        t = time.perf_counter()
        header, blob = region_kernels.read_entry(path, region_kernels.FORMAT, {}, "kernel", "")
        t1 = time.perf_counter()
        if header.get("verdict") != "fused":
            return
        pickle.loads(blob)
        t2 = time.perf_counter()
        B.deserialize_compile_artifacts(blob)
        t3 = time.perf_counter()
        phases["read_s"] += t1 - t
        phases["unpickle_s"] += t2 - t1
        phases["post_compile_s"] += t3 - t2
    prof = cProfile.Profile()
    t = time.perf_counter()
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, paths))
    else:
        prof.enable()
        for path in paths:
            one(path)
        prof.disable()
    row = dict(phases, entries=len(paths), threads=threads, wall_s=time.perf_counter() - t)
    if threads <= 1:
        s = io.StringIO()
        p = pstats.Stats(prof, stream=s)
        p.sort_stats("cumulative").print_stats(60)
        p.sort_stats("tottime").print_stats(40)
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "profile-kernel-loads.txt").write_text(s.getvalue())
    print(json.dumps(row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="token2wav")
    ap.add_argument("--out", default="/tmp/probe")
    ap.add_argument("--keep", type=int, default=0)
    ap.add_argument("--child", default=None)
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=None, help="the cadence_fx cache directory to use (kept)")
    a = ap.parse_args()
    if a.kernels:
        return kernels(a.kernels, a.threads, a.out)
    if a.load:
        return load(a.load)
    if a.artifacts:
        return artifacts(a.artifacts, Path(a.out) / "artifacts.json")
    if a.child:
        return child(a.model, a.out, a.child, a.keep)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    cache = a.cache or tempfile.mkdtemp(prefix="cadence-probe-")
    for tag in ("cold", "warm"):   # each with empty Inductor and Triton caches
        env = dict(os.environ, CADENCE_FX_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(),
                   TRITON_CACHE_DIR=tempfile.mkdtemp())
        cmd = [sys.executable, __file__, "--child", tag, "--model", a.model, "--out", a.out]
        if tag == "cold" and a.keep:
            cmd += ["--keep", str(a.keep)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(tag, r.returncode, r.stdout[-3000:], r.stderr[-2000:] if r.returncode else "", flush=True)


if __name__ == "__main__":
    main()
