"""``cadence-fx``: inspect an adapter's catalog before any model runs, or run the demo."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

__all__ = ["main"]


def _analyze(args) -> int:
    from cadence_fx import adapters
    from cadence_fx.catalog import build_catalog
    from cadence_fx.errors import ContractError
    try:
        catalog = build_catalog(adapters.get(args.adapter))
    except ContractError as e:
        print(f"cadence-fx analyze: {e}", file=sys.stderr)
        return 2
    d = catalog.as_dict()
    if args.json:
        keys = ("name", "extents", "K", "admissible", "stock_bytes", "declared_bytes",
                "declared_extent", "rho", "staging_bytes_aliased", "staging_bytes_unaliased")
        print(json.dumps({"adapter": d["adapter"], "catalog_size": d["catalog_size"],
                          "admissible": d["admissible"], "call_widths": d["call_widths"],
                          "regions": [{k: r[k] for k in keys} for r in d["regions"]]}, indent=2))
        return 0
    print(f"adapter {d['adapter']}: {d['catalog_size']} signature classes "
          f"({'admissible' if d['admissible'] else 'NOT admissible'}), call widths {d['call_widths']}")
    for r in d["regions"]:
        rho = f"{r['rho']:.2f}x" if r["rho"] else "-"
        print(f"  {r['name']:<24} K={r['K']:<5} extents {_short(r['extents'])}  "
              f"{'admissible' if r['admissible'] else 'excluded (K over the width limit)'}  "
              f"A+={r['declared_extent']}  stock {_bytes(r['stock_bytes'])} -> declared "
              f"{_bytes(r['declared_bytes'])} (rho {rho})")
    return 0


def _short(extents) -> str:
    return str(extents) if len(extents) <= 8 else f"[{extents[0]}, {extents[1]}, ..., {extents[-1]}]"


def _bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _demo(args) -> int:
    from cadence_fx.demo import run_demo
    try:
        result = run_demo(model=args.model, device=args.device, chunks=args.chunks)
    except (ValueError, RuntimeError, ImportError) as e:  # bad input, no CUDA, model not installed
        print(f"cadence-fx demo: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0 if result["bit_exact"] else 1


MODELS = ("token2wav", "moshi", "freeze-omni", "toy")  # cadence_fx.demo.MODELS, without importing torch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("analyze", help="print the catalog an adapter implies")
    a.add_argument("adapter", help="a registered adapter, e.g. minicpmo-token2wav")
    a.add_argument("--json", action="store_true")
    a.set_defaults(run=_analyze)
    d = sub.add_parser("demo", help="run a stream stock vs compiled and compare bit for bit")
    d.add_argument("--model", default="token2wav", choices=list(MODELS),
                   help="token2wav (default, real configuration), moshi, freeze-omni, or toy")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    d.add_argument("--chunks", type=int, default=None,
                   help="chunks in the stream (default: 4 on the CPU, 16 on CUDA and for the toy)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
