"""Put the Moshi row into the sessions-lanes result (the lanes issue's one file of targets).

    python bench/lanes_merge.py bench/results/<date>-h200-sessions-lanes.json \\
        bench/results/<date>-h200-moshi-lanes[-<commit>].json

``bench/sessions_lanes.py`` measures Token2Wav and leaves ``moshi_conversations_per_gpu`` to
``bench/moshi_lanes.py`` (batched frames per lane, another process). This copies that file's
``moshi_conversations_per_gpu`` into the first file, with where it came from (``moshi``: the
file, its commit, its best row and whether every row was bit-exact), and writes the first file
back. Both commits stay recorded: the two benchmarks may have run at different commits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def merge(lanes: dict, moshi: dict, moshi_path: str) -> dict:
    if "moshi_conversations_per_gpu" not in moshi:
        raise SystemExit(f"{moshi_path} has no moshi_conversations_per_gpu: give the result of "
                         "bench/moshi_lanes.py (a finished run)")
    rows = [r for r in moshi.get("rows", []) if "error" not in r]
    lanes["moshi_conversations_per_gpu"] = moshi["moshi_conversations_per_gpu"]
    lanes["moshi"] = {"file": os.path.basename(moshi_path), "commit": moshi.get("commit"),
                      "best": moshi.get("best"), "all_bit_exact": moshi.get("all_bit_exact"),
                      "rows": [{k: r.get(k) for k in ("batch", "lanes", "conversations",
                                                      "tick_p50_ms", "tick_p99_ms",
                                                      "tick_max_ms", "realtime", "all_bit_exact")}
                               for r in rows]}
    return lanes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lanes", help="bench/sessions_lanes.py's result (written back)")
    ap.add_argument("moshi", help="bench/moshi_lanes.py's result")
    args = ap.parse_args(argv)
    with open(args.lanes) as f:
        lanes = json.load(f)
    with open(args.moshi) as f:
        moshi = json.load(f)
    merged = merge(lanes, moshi, args.moshi)
    with open(args.lanes, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    print(json.dumps({"moshi_conversations_per_gpu": merged["moshi_conversations_per_gpu"],
                      "moshi": merged["moshi"]["best"]}))


if __name__ == "__main__":
    sys.exit(main())
