"""One result from several ``bench/suite.py`` processes (the configurations of one device call
split over its GPUs, or calls that each fit the device's time limit).

    python bench/suite_merge.py --out bench/results/<date>-h200.json \
        call1-gpu0=suite.json call1-gpu1=suite.json call3-gpu0=... [--status TM="not run: ..."]

Every process measures its own E first, and each configuration's ``ratio_vs_E_*`` is against
the E of its own process. Per configuration the last listed process that ran it to the end
(bit-exact counts present) is taken; the row gets ``process`` (its label) and
``E_p50_ms_same_process``. The flat per-letter view keys (``p50_ms`` ... ``status``) come from
the taken row; E is the first listed process's. Every process's rows stay under
``cfm_by_process``. ``whole_chunk`` and ``moshi`` come from the process that has them. ``--status NAME=text``
records a configuration that no process ran, and why.

Two merged rows may come from different processes, each with its own timings and memory peak;
``bench/suite_report.py`` compares two configurations with one process's rows (from
``cfm_by_process``) where a process ran both, and labels the ratio "cross-process" otherwise.
"""
from __future__ import annotations

import argparse
import json

ROW_KEYS = ("p50_ms", "p95_ms", "peak_bytes", "reserved_bytes", "bit_exact_blocks", "blocks",
            "replays", "fallbacks", "floor_ms", "status")
LETTERS = ("E", "S", "R", "Rc", "SRc", "T", "TM", "V", "B")


def finished(row) -> bool:
    return isinstance(row, dict) and row.get("blocks") is not None and "bit_exact_blocks" in row


def merge(labelled, statuses=()):
    first = labelled[0][1]
    out = {k: first.get(k) for k in ("gpu", "torch", "cuda", "deterministic_kernels")}
    out["commits"] = {label: r.get("commit") for label, r in labelled}
    out["cfm_by_process"] = {label: r.get("cfm", {}) for label, r in labelled}
    cfm = {k: v for k, v in first.get("cfm", {}).items() if not isinstance(v, dict)}
    for name in LETTERS:
        for label, r in (labelled[:1] if name == "E" else labelled):
            row = r.get("cfm", {}).get(name)
            if finished(row):
                e = r["cfm"].get("E", {})
                cfm[name] = {**row, "process": label, "E_p50_ms_same_process": e.get("p50_ms")}
        if name not in cfm:   # ran nowhere to the end: the last attempt says why
            tried = [(label, r["cfm"][name]) for label, r in labelled if name in r.get("cfm", {})]
            if tried:
                cfm[name] = {**tried[-1][1], "process": tried[-1][0]}
    for item in statuses:
        name, _, text = item.partition("=")
        if name not in cfm:
            cfm[name] = {"status": text}
    out["cfm"] = cfm
    for name, row in cfm.items():
        if isinstance(row, dict) and "status" in row:
            out[name] = {k: row.get(k) for k in ROW_KEYS}
    for part in ("whole_chunk", "moshi"):
        for label, r in labelled:
            if part in r:
                out[part] = {**r[part], "process": label}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("inputs", nargs="+", help="LABEL=path/to/suite.json, in order")
    ap.add_argument("--status", action="append", default=[],
                    help="NAME=text: a configuration no process ran, and why")
    args = ap.parse_args(argv)
    labelled = []
    for item in args.inputs:
        label, _, path = item.partition("=")
        if not path:
            ap.error(f"{item!r}: expected LABEL=path")
        with open(path) as f:
            labelled.append((label, json.load(f)))
    with open(args.out, "w") as f:
        json.dump(merge(labelled, args.status), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
