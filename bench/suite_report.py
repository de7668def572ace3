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

from suite_merge import finished

ORDER = ("E", "S", "R", "Rc", "SRc", "T", "TM", "V", "B")
# how each part's peak memory was measured (docs/benchmarks.md, "Peak memory")
PART_MEMORY = {
    "whole_chunk": "Peak GiB: `max_memory_allocated` over the timed passes, with the peak reset "
                   "right before them (no `empty_cache`), E and SRc in the same process.",
    "moshi": "Peak GiB: `max_memory_allocated` over the timed streams, with the peak reset after "
             "the warm-up stream (no `empty_cache`), all three in `bench/moshi_frame.py`'s process.",
}


def _gib(n):
    return "–" if n is None else f"{n / 2**30:.2f}"


def _ms(x):
    return "–" if x is None else f"{x:.1f}"


def _commit(result):
    commits = result.get("commits")
    if commits:
        return ", ".join(f"{label} {c}" for label, c in commits.items())
    return result.get("commit")


def table(result) -> str:
    cfm = result.get("cfm", {})
    e = cfm.get("E", {})
    lines = [f"GPU {result.get('gpu')}, torch {result.get('torch')}; commits: {_commit(result)}. "
             f"{cfm.get('model', '')}, {cfm.get('chunks', '?')} chunks per block.", "",
             "| config | p50 ms | p95 ms | vs E (paired 95% CI) | peak GiB | reserved GiB | "
             "kernel floor ms | bit-exact blocks | replays / fallbacks | process | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
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
                     f"{_ms(r.get('floor_ms'))} | {exact} | {rf} | {r.get('process', '')} | "
                     f"{r.get('status', '')[:90]} |")
    lines += ["", "Peak GiB: `torch.cuda.max_memory_allocated` over the configuration's memory pass, "
                  "with the peak reset right before it (after `gc.collect` and `empty_cache`), in the "
                  "row's own process (TM's: the subprocess that ran it); reserved GiB: "
                  "`torch.cuda.memory_reserved` at the end of that pass."]
    if any(isinstance(r, dict) and r.get("process") for r in cfm.values()):
        lines += ["", "Each process measured its own E first; \"vs E\" is against the E of the same "
                      "process (E's p50 per process: " + ", ".join(
                          f"{label} {rows['E']['p50_ms']:.1f} ms" for label, rows in
                          result.get("cfm_by_process", {}).items() if "p50_ms" in rows.get("E", {})) + ")."]
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
        lines += ["", PART_MEMORY[part]]
    if e.get("floor_ms"):
        lines += ["", f"E's kernel-time floor: {e['floor_ms']:.1f} ms per chunk."]
    lines += ["", "**Targets**", "", "| target | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {t} | {m} | {'yes' if ok else 'no'} |" for t, m, ok in targets(result)]
    return "\n".join(lines) + "\n"


def same_process(result, a, b):
    """Rows ``a`` and ``b`` of the CFM part measured in one process, and where they come from:
    ``(row_a, row_b, where)``.

    A merged result (``bench/suite_merge.py``) takes each configuration from its own process, so
    a ratio of two merged rows can mix processes. Here the merged rows are used when they came
    from the same process (or the result is one process's, ``where`` is then None); otherwise
    the rows of one process that finished both (``a``'s process first, then the last listed);
    and only when no process has both, the merged rows with ``where`` saying "cross-process"."""
    cfm, by_process = result.get("cfm", {}), result.get("cfm_by_process") or {}
    ra, rb = cfm.get(a) or {}, cfm.get(b) or {}
    pa, pb = ra.get("process"), rb.get("process")
    if pa == pb:
        return ra, rb, None if pa is None else f"{a} and {b} from {pa}"
    both = [label for label, rows in by_process.items()
            if finished(rows.get(a)) and finished(rows.get(b))]
    if both:
        label = pa if pa in both else both[-1]
        return by_process[label][a], by_process[label][b], f"{a} and {b} from {label}"
    return ra, rb, f"cross-process: {a} from {pa}, {b} from {pb}"


def _where(where):
    return "" if where is None else f" ({where})"


def targets(result):
    """``(target, measured, met)`` for every target the result can speak to. A ratio of two
    configurations uses rows of one process when one has both, and says so; otherwise its
    measured text says "cross-process" (``same_process``)."""
    cfm, out = result.get("cfm", {}), []
    src, e, t, b = cfm.get("SRc") or {}, cfm.get("E") or {}, cfm.get("T") or {}, cfm.get("B") or {}
    if src.get("p50_ms") and src.get("floor_ms"):
        r = src["p50_ms"] / src["floor_ms"]
        out.append(("SRc p50 <= 1.08x its kernel floor", f"{r:.3f}x ({src['p50_ms']:.1f} / "
                    f"{src['floor_ms']:.1f} ms)", r <= 1.08))
    if src.get("p50_ms") and t.get("p50_ms"):
        s_row, t_row, where = same_process(result, "SRc", "T")
        exact = s_row.get("bit_exact_blocks") == s_row.get("blocks") and s_row.get("blocks")
        out.append(("SRc p50 <= T p50, SRc bit-exact", f"{s_row['p50_ms']:.1f} vs "
                    f"{t_row['p50_ms']:.1f} ms (T {t_row.get('bit_exact_blocks')}/"
                    f"{t_row.get('blocks')} blocks bit-exact){_where(where)}",
                    bool(exact) and s_row["p50_ms"] <= t_row["p50_ms"]))
    if src.get("p50_ms") and b.get("p50_ms"):
        s_row, b_row, where = same_process(result, "SRc", "B")
        r = b_row["p50_ms"] / s_row["p50_ms"]
        out.append((">= 1.3x faster than B", f"{r:.2f}x{_where(where)}", r >= 1.3))
    if src.get("p50_ms") and src.get("E_p50_ms_same_process", e.get("p50_ms")):
        r = src.get("E_p50_ms_same_process", e.get("p50_ms")) / src["p50_ms"]
        out.append((">= 2.8x faster than E (same process)", f"{r:.2f}x", r >= 2.8))
    s_row, e_row, where = same_process(result, "SRc", "E")
    for key, name in (("peak_bytes", "max_memory_allocated"), ("reserved_bytes", "memory_reserved")):
        if s_row.get(key) and e_row.get(key):
            r = s_row[key] / e_row[key]
            out.append((f"SRc {name} <= 0.60x E", f"{r:.3f}x{_where(where)}", r <= 0.60))
    cold = src.get("warm_pass_s")
    if cold:
        out.append(("cold compile of the CFM classes (trace + passes + capture) <= 30 s",
                    f"{cold:.1f} s (trace {src.get('trace_s', 0):.1f} s, capture "
                    f"{src.get('capture_s', 0):.2f} s, {src.get('classes')} classes)", cold <= 30))
    w = result.get("whole_chunk") or {}
    we, ws = w.get("E") or {}, w.get("SRc") or {}
    if we.get("p50_ms") and ws.get("p50_ms"):
        r = we["p50_ms"] / ws["p50_ms"]
        out.append(("whole chunk >= 2.5x faster than E, bit-exact PCM",
                    f"{r:.2f}x, {ws.get('bit_exact_blocks')}/{ws.get('blocks')} blocks", r >= 2.5
                    and ws.get("bit_exact_blocks") == ws.get("blocks")))
    if ws.get("cold_compile_s"):
        out.append(("whole Token2Wav catalog cold <= 30 s, capture <= 2 s",
                    f"{ws['cold_compile_s']:.1f} s (trace {ws.get('trace_s', 0):.1f} s, capture "
                    f"{ws.get('capture_s', 0):.2f} s, {ws.get('classes')} classes)",
                    ws["cold_compile_s"] <= 30 and ws.get("capture_s", 99) <= 2))
    m = result.get("moshi") or {}
    mc, mv, me = m.get("cadence") or {}, m.get("V") or {}, m.get("E") or {}
    if mc.get("p50_ms") and mv.get("p50_ms") and me.get("floor_ms"):
        ok = (mc["p50_ms"] <= mv["p50_ms"] and mc["p50_ms"] <= 1.25 * me["floor_ms"]
              and mc.get("bit_exact_frames") == mc.get("frames"))
        out.append(("Moshi frame <= V p50 and <= 1.25x floor, bit-exact",
                    f"{mc['p50_ms']:.1f} ms vs V {mv['p50_ms']:.1f} ms, {mc['p50_ms'] / me['floor_ms']:.2f}x "
                    f"floor ({me['floor_ms']:.1f} ms), {mc.get('bit_exact_frames')}/{mc.get('frames')} "
                    f"frames (V {mv.get('bit_exact_frames')}/{mv.get('frames')})", ok))
    return out


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
