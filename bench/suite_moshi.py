"""The Moshi frame in the suite (``bench/suite.py --parts moshi``): ``bench/moshi_frame.py`` (E:
stock eager, V: the vendor's ``CUDAGraphed`` path, cadence: ``MoshiStep`` compiled as shipped)
with each row in a child process of its own, one after another on the one GPU, and the rows the
suite keeps from their results.

    python bench/suite_moshi.py --out moshi.json      # the same part on its own

E runs first and writes its outputs; cadence and V read them to count their frames bit-exact.
Memory, per row (``moshi_frame.timed``): after the row's warm-up stream, ``torch.cuda.synchronize``
and ``reset_peak_memory_stats``, then ``peak_bytes = max_memory_allocated`` over the timed streams
and ``reserved_bytes = memory_reserved`` after them; ``process_peak_bytes`` is the most its process
ever had allocated (model, compile and capture included). Rows in processes of their own share
nothing, so their process peaks compare directly: ``cadence.process_peak_vs_E`` is cadence_fx's
over stock's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

__all__ = ["moshi_part"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ("E", "cadence", "V")


def moshi_part(args=None, extra=(), rows_run=ROWS):
    """The suite's ``moshi`` section: E, cadence and V (``rows_run``, E always), each from its
    own child process."""
    ref = "/tmp/suite-moshi-ref.pt"
    rows, meta = {}, {}
    for row in [r for r in ROWS if r == "E" or r in rows_run]:
        out = f"/tmp/suite-moshi-{row}.json"
        subprocess.run([sys.executable, os.path.join(HERE, "moshi_frame.py"), "--out", out,
                        "--configs", row, "--ref", ref, *extra], check=True, timeout=900)
        with open(out) as f:
            m = json.load(f)
        rows[row] = m.get(row)
        meta = meta or {k: m[k] for k in ("streams", "frames_per_stream", "gpu", "torch", "commit")}
    c, e, v = rows.get("cadence") or {}, rows["E"], rows.get("V") or {}
    if not c:
        return {**rows, **meta, "processes": "one per row"}
    c["floor_ms"] = e["floor_ms"]
    c["vs_floor_p50"] = c["p50_ms"] / e["floor_ms"] if e.get("floor_ms") else None
    c["speedup_vs_E_p50"] = e["p50_ms"] / c["p50_ms"]
    if "p50_ms" in v:
        c["vs_V_p50"] = c["p50_ms"] / v["p50_ms"]
    if e.get("process_peak_bytes") and c.get("process_peak_bytes"):
        c["process_peak_vs_E"] = c["process_peak_bytes"] / e["process_peak_bytes"]
    return {**rows, **meta, "processes": "one per row"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rows", default=",".join(ROWS), help="the rows to run (E always runs)")
    a = ap.parse_args()
    res = moshi_part(extra=("--small",) if a.small else (), rows_run=a.rows.split(","))
    print(json.dumps({k: {x: r.get(x) for x in ("p50_ms", "p95_ms", "floor_ms", "kernel_ms", "kernels",
                                                "kernels_per_frame", "bit_exact_frames",
                                                "graph_launches_per_frame", "process_peak_bytes",
                                                "process_peak_vs_E", "vs_V_p50", "vs_floor_p50")}
                      for k, r in res.items() if isinstance(r, dict)}, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
