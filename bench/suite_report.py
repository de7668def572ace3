"""Table and plots of a ``bench/suite.py`` result.

    python bench/suite_report.py bench/results/<date>-h200.json

Writes, next to the JSON: ``<stem>.md`` (the per-configuration table), ``<stem>-pareto.png``
(p50 latency against peak memory, one point per configuration: the Pareto picture) and
``<stem>-latency.png`` (the per-chunk latency distribution of each configuration).
Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import json
import os
import sys

ORDER = ("E", "S", "R", "Rc", "SRc", "T", "TM", "V", "B")


def _gib(n):
    return "–" if n is None else f"{n / 2**30:.2f}"


def _ms(x):
    return "–" if x is None else f"{x:.1f}"


def table(result) -> str:
    cfm = result.get("cfm", {})
    e = cfm.get("E", {})
    lines = [f"GPU {result.get('gpu')}, torch {result.get('torch')}, commit {result.get('commit')}. "
             f"{cfm.get('model', '')}, {cfm.get('chunks', '?')} chunks.", "",
             "| config | p50 ms | p95 ms | vs E (paired 95% CI) | peak GiB | reserved GiB | "
             "kernel floor ms | bit-exact | replays / fallbacks | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ORDER:
        r = cfm.get(name)
        if not r:
            continue
        ci = r.get("ratio_vs_E_ci95")
        vs = "1" if name == "E" else ("–" if not ci else
                                      f"{r['ratio_vs_E_mean']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
        exact = ("–" if r.get("blocks") is None else f"{r.get('bit_exact_blocks')}/{r.get('blocks')}")
        rf = f"{r.get('replays', '–')} / {r.get('fallbacks', '–')}"
        lines.append(f"| {name} | {_ms(r.get('p50_ms'))} | {_ms(r.get('p95_ms'))} | {vs} | "
                     f"{_gib(r.get('peak_bytes'))} | {_gib(r.get('reserved_bytes'))} | "
                     f"{_ms(r.get('floor_ms'))} | {exact} | {rf} | {r.get('status', '')[:80]} |")
    for part in ("whole_chunk", "moshi"):
        p = result.get(part)
        if not isinstance(p, dict):
            continue
        lines += ["", f"**{part}**", "", "| config | p50 ms | p95 ms | peak GiB | bit-exact | status |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in p.items():
            if isinstance(r, dict) and "p50_ms" in r:
                frames = r.get("blocks") or r.get("frames")
                lines.append(f"| {name} | {_ms(r.get('p50_ms'))} | {_ms(r.get('p95_ms'))} | "
                             f"{_gib(r.get('peak_bytes'))} | {r.get('bit_exact_blocks', r.get('bit_exact_frames'))}"
                             f"/{frames} | {r.get('status', '')[:60]} |")
    if e.get("floor_ms"):
        lines += ["", f"E's kernel-time floor: {e['floor_ms']:.1f} ms per chunk."]
    return "\n".join(lines) + "\n"


def plots(result, stem):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfm = result.get("cfm", {})
    rows = [(n, cfm[n]) for n in ORDER if isinstance(cfm.get(n), dict) and cfm[n].get("p50_ms")]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, r in rows:
        if r.get("peak_bytes") is None:
            continue
        exact = r.get("bit_exact_blocks") == r.get("blocks")
        ax.scatter(r["peak_bytes"] / 2**30, r["p50_ms"], s=60,
                   marker="o" if exact else "x", color="tab:green" if name == "SRc" else "tab:blue")
        ax.annotate(name, (r["peak_bytes"] / 2**30, r["p50_ms"]), textcoords="offset points",
                    xytext=(6, 4))
    ax.set_xlabel("peak memory, GiB (max_memory_allocated, whole process)")
    ax.set_ylabel("per-chunk p50, ms")
    ax.set_title("CFM loop: latency vs memory (o bit-exact, x not)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{stem}-pareto.png", dpi=120)
    plt.close(fig)
    timed = [(n, r["times_ms"]) for n, r in rows if r.get("times_ms")]
    if timed:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.boxplot([t for _, t in timed])
        ax.set_xticks(range(1, len(timed) + 1), [n for n, _ in timed])
        ax.set_ylabel("per-chunk latency, ms")
        ax.set_yscale("log")
        ax.set_title("CFM loop: per-chunk latency distribution")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(f"{stem}-latency.png", dpi=120)
        plt.close(fig)


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        result = json.load(f)
    stem = os.path.splitext(argv[0])[0]
    with open(f"{stem}.md", "w") as f:
        f.write(table(result))
    plots(result, stem)
    print(open(f"{stem}.md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
