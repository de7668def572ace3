"""cadence-fx: inspect an adapter's catalog before any model runs, explain it, write the HTML
report of a short stream, run the demo, list and clear the persistent compile cache, or serve
a model's sessions through Ray Serve.

An adapter is named three ways: a registered name (minicpmo-token2wav), a module attribute
(pkg.module:NAME) or an attribute of a Python file (path/to/file.py:NAME).
"""
# The docstring above is what cadence-fx --help prints: plain text, no reST markup.
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import List, Optional

__all__ = ["main", "load_adapter"]

MODELS = ("token2wav", "moshi", "freeze-omni", "toy")  # cadence_fx.demo.MODELS, without importing torch
FORMS = "a registered name ({names}), 'pkg.module:NAME', or 'path/to/file.py:NAME'"


def load_adapter(spec: str):
    """The adapter ``spec`` names, validated; a ``ContractError`` saying what was tried and the
    forms accepted when it names none."""
    from cadence_fx import adapters
    from cadence_fx.contract import Adapter
    from cadence_fx.errors import ContractError
    forms = FORMS.format(names=", ".join(adapters.names()))
    if spec in adapters.names():
        return adapters.get(spec)
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr.isidentifier():
        raise ContractError(f"no adapter named {spec!r}; give {forms}")
    if source.endswith(".py") or "/" in source or os.sep in source:
        where = f"file {source!r}"
        if not os.path.isfile(source):
            raise ContractError(f"adapter {spec!r}: tried {where}, which does not exist; give {forms}")
        name = "cadence_fx_adapter_" + "".join(ch if ch.isalnum() else "_" for ch in
                                               os.path.abspath(source))
        try:
            module_spec = importlib.util.spec_from_file_location(name, source)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module   # dataclasses declared in the file look their module up
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any error in the user's file, named
            sys.modules.pop(name, None)
            raise ContractError(f"adapter {spec!r}: loading {where} failed: "
                                f"{type(e).__name__}: {e}; fix the file, or give {forms}") from e
    else:
        where = f"module {source!r}"
        try:
            module = importlib.import_module(source)
        except Exception as e:  # noqa: BLE001 - ImportError, or an error inside the module
            raise ContractError(f"adapter {spec!r}: importing {where} failed: "
                                f"{type(e).__name__}: {e}; give {forms}") from e
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, Adapter))
        raise ContractError(f"adapter {spec!r}: {where} has no attribute {attr!r}; give one of "
                            f"its adapters ({', '.join(found) or 'it has none'}) after the ':', "
                            f"or {forms}")
    adapter = getattr(module, attr)
    if not isinstance(adapter, Adapter):
        raise ContractError(f"adapter {spec!r}: {attr!r} in {where} is a "
                            f"{type(adapter).__name__}, not a cadence_fx.Adapter; name an "
                            f"Adapter instance after the ':', or give {forms}")
    return adapter.validate()


def _adapter_or_error(command: str, spec: str):
    from cadence_fx.errors import ContractError
    try:
        return load_adapter(spec)
    except ContractError as e:
        print(f"cadence-fx {command}: {e}", file=sys.stderr)
        return None


def _derive(command: str, spec: str, derive):
    """``derive(adapter)`` for the adapter ``spec`` names, or None after printing why not."""
    from cadence_fx.errors import ContractError
    adapter = _adapter_or_error(command, spec)
    if adapter is None:
        return None
    try:
        return derive(adapter)
    except ContractError as e:
        print(f"cadence-fx {command}: {e}", file=sys.stderr)
        return None


def _analyze(args) -> int:
    from cadence_fx.catalog import build_catalog
    d = _derive("analyze", args.adapter, lambda adapter: build_catalog(adapter).as_dict())
    if d is None:
        return 2
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


def _explain(args) -> int:
    from cadence_fx.explain import explain, explain_text
    d = _derive("explain", args.adapter, explain)
    if d is None:
        return 2
    print(json.dumps(d, indent=2) if args.json else explain_text(d))
    return 0


def _report(args) -> int:
    if args.adapter is not None and args.model is not None:
        print("cadence-fx report: give an adapter (its catalog alone) or --model (a stream), "
              "not both", file=sys.stderr)
        return 2
    if args.adapter is not None:
        from cadence_fx.report_html import catalog_page
        adapter = _adapter_or_error("report", args.adapter)
        if adapter is None:
            return 2
        text = catalog_page(adapter)
    else:
        try:
            text = _stream_report(args.model or "toy", args.chunks, args.verify, args.full)
        except (ValueError, RuntimeError, ImportError) as e:  # bad input, model not installed
            print(f"cadence-fx report: {e}", file=sys.stderr)
            return 2
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.html} ({len(text.encode()) / 1024:,.0f} KiB)")
    return 0


def _stream_report(model: str, chunks: Optional[int], verify: bool, full: bool = False) -> str:
    """Run a short stream of a demo model through its compiled steps on the CPU (at the demo's
    CPU size unless ``full``), keeping each class's trace (for the code before the passes), and
    render the report of every step."""
    import torch
    from cadence_fx.demo_streams import BUILDERS
    from cadence_fx.report_html import page
    if chunks is None:
        chunks = 16 if model == "toy" else 4
    if chunks < 4:
        raise ValueError("a demo stream needs at least 4 chunks (two turns of two)")
    stream = BUILDERS[model](torch.device("cpu"), chunks, full=full)
    if stream.prepare_compiled is not None:
        stream.prepare_compiled()
    import dataclasses
    for step in stream.steps.values():
        step.config = dataclasses.replace(step.config, verify=step.config.verify or verify)
    stream.compiled(lambda i: None)
    notes = {"model": model, "device": "cpu", "chunks": stream.chunks, "shadow audit": verify,
             **{k: str(v) for k, v in stream.config.items()}}
    return page({name: step.report() for name, step in stream.steps.items()},
                f"cadence_fx report: {model}", notes)


def _demo(args) -> int:
    from cadence_fx import progress
    from cadence_fx.demo import run_demo
    if not args.quiet:
        progress.show()
    try:
        result = run_demo(model=args.model, device=args.device, chunks=args.chunks,
                          full=args.full)
    except (ValueError, RuntimeError, ImportError) as e:  # bad input, no CUDA, model not installed
        print(f"cadence-fx demo: {e}", file=sys.stderr)
        return 2
    finally:
        progress.hide()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            if k == "timing":   # the CPU's times, nested: one line each
                for tk, tv in v.items():
                    print(f"{'timing.' + tk:>31}: {tv}")
            else:
                print(f"{k:>31}: {v}")
    return 0 if result["bit_exact"] else 1


def _cache(args) -> int:
    from cadence_fx import compile_cache
    root = args.dir or compile_cache.default_dir()
    if args.action == "clear":
        print(f"removed {compile_cache.clear(root)} cached steps from {root}")
        return 0
    rows = compile_cache.entries(root)
    if args.json:
        print(json.dumps({"dir": str(root), "entries": rows}, indent=2))
    elif not rows:
        print(f"no cached steps in {root}")
    else:
        print(f"{root}:")
        for r in rows:
            print(f"  {r['model']} ({r['step']}), adapter {r['adapter']}: {r['classes']} classes, "
                  f"{r['bytes'] / 2**20:.1f} MiB, created {r['created']}, torch {r['torch']}")
    return 0


def _serve(args) -> int:
    """Serve a demo model's sessions through Ray Serve on this machine (cadence_fx.serve)."""
    try:
        from cadence_fx.serve.launch import serve_locally
        import ray.serve  # noqa: F401 - the extra, checked before anything starts
    except ImportError as e:
        print(f"cadence-fx serve: {e}; install the extra: pip install 'cadence_fx[serve]'",
              file=sys.stderr)
        return 2
    return serve_locally(args)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    spec_help = ("an adapter: a registered name (e.g. minicpmo-token2wav), pkg.module:NAME, or "
                 "path/to/file.py:NAME")
    _inspecting(sub, spec_help)
    _demo_parser(sub)
    _cache_parser(sub)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


def _inspecting(sub, spec_help: str) -> None:
    """analyze, explain, report: what an adapter implies, and what a compile made of a stream."""
    a = sub.add_parser("analyze", help="print the catalog an adapter implies")
    a.add_argument("adapter", help=spec_help)
    a.add_argument("--json", action="store_true")
    a.set_defaults(run=_analyze)
    e = sub.add_parser("explain", help="walk through what an adapter implies, region by region")
    e.add_argument("adapter", help=spec_help)
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_explain)
    r = sub.add_parser("report", help="write the HTML report of a short demo stream (CPU), "
                                      "or of an adapter's catalog alone")
    r.add_argument("adapter", nargs="?", default=None,
                   help=f"{spec_help}; its catalog alone, no model runs (instead of --model)")
    r.add_argument("--html", required=True, metavar="FILE", help="where to write the page")
    r.add_argument("--model", default=None, choices=list(MODELS),
                   help="the demo stream to run and report (default: toy)")
    r.add_argument("--chunks", type=int, default=None,
                   help="chunks in the stream (default: 16 for the toy, 4 otherwise)")
    r.add_argument("--full", action="store_true",
                   help="the model's real configuration, as demo --full (token2wav: DiT depth "
                        "16, encoder 6 + 4 blocks); default: the demo's CPU size")
    r.add_argument("--verify", action="store_true",
                   help="compile with the shadow auditor (its nodes show in the rewrites)")
    r.set_defaults(run=_report)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="run a stream stock vs compiled and compare bit for bit")
    d.add_argument("--model", default="token2wav", choices=list(MODELS),
                   help="token2wav (default: the real MiniCPM-o 4.5 Token2Wav classes, random "
                        "weights), moshi, freeze-omni, or toy")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    d.add_argument("--full", action=argparse.BooleanOptionalAction, default=None,
                   help="the model's real configuration (token2wav: DiT depth 16, encoder 6 + 4 "
                        "blocks; moshi: the 7B LM), the default on CUDA; on the CPU the default "
                        "is a smaller one of the same code (token2wav: DiT depth 2, encoder 1 + 1; "
                        "moshi: a 2-layer LM) that runs in about a minute")
    d.add_argument("--chunks", type=int, default=None,
                   help="chunks in the stream (default: 4 on the CPU, 16 on CUDA and for the toy)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (each chunk with what is left, which class is "
                        "tracing and how long it took)")
    d.set_defaults(run=_demo)


def _cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="list or clear the persistent compile cache")
    c.add_argument("action", choices=["ls", "clear"])
    c.add_argument("--dir", default=None,
                   help="the cache directory (default: $CADENCE_FX_CACHE_DIR, else ~/.cache/cadence_fx)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=_cache)


def _served_model(name: str) -> str:
    if name in MODELS or (":" in name and all(name.partition(":")[::2])):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: choose one of {', '.join(MODELS)}, or give "
                                     "your own model as package.module:factory")


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model's sessions over WebSockets through Ray Serve "
                                     "(needs the serve extra; docs/serving.md)")
    s.add_argument("--model", default="toy", type=_served_model,
                   help=f"{', '.join(MODELS)}, or your own as package.module:factory (a "
                        "function of (device, cache_dir, full) returning a ServedModel; "
                        "docs/serving.md)")
    s.add_argument("--replicas", type=int, default=1, help="one per GPU (default 1)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--address", default=None, help="a Ray cluster to join (default: start one)")
    s.add_argument("--cache-dir", default=None,
                   help="the compile cache the replicas share (default: as `cadence-fx cache`)")
    s.add_argument("--gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 with CUDA, else 0)")
    s.add_argument("--cpus", type=float, default=1.0, help="CPUs per replica")
    s.add_argument("--lanes", type=int, default=1,
                   help="lanes per replica: sets of carries and graphs whose chunks run "
                        "concurrently on the GPU (docs/sessions.md; default 1)")
    s.add_argument("--full", action=argparse.BooleanOptionalAction, default=None,
                   help="the model's real configuration, as demo --full")
    s.add_argument("--direct", action="store_true",
                   help="each replica also serves its sessions' chunks on a WebSocket of its "
                        "own, bound to --host, for sessions opened with direct=True "
                        "(docs/serving.md, Direct connections)")
    s.add_argument("--switch-interval-ms", type=float, default=None,
                   help="each replica's sys.setswitchinterval: how soon a worker thread hands "
                        "the GIL to the replica's network loop (default: Python's 5 ms)")
    s.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="leave the objects a replica's start made to the garbage collector "
                        "(default: frozen once warm, so collections skip them; docs/serving.md)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds Ctrl-C waits for live sessions to end their turn")
    s.set_defaults(run=_serve)


if __name__ == "__main__":
    sys.exit(main())
