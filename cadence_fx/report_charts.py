"""The report's two charts, drawn by matplotlib as inline SVG: the bytes of each region (stock
envelope, declared carry, the extent of one class) and the strip of a class's pieces in graph
order. matplotlib is optional (``pip install cadence_fx[report]``): without it each function
returns None and the report shows its tables alone."""
from __future__ import annotations

import importlib.util
import io
from typing import List, Optional, Sequence, Tuple

__all__ = ["available", "bytes_chart", "pieces_strip"]

GRAPH, EAGER = "#4c78a8", "#e45756"
STOCK, DECLARED, AT_CLASS = "#9d9d9d", "#4c78a8", "#9ecae9"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _human(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"


def _svg(fig, salt: str) -> str:
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prolog or doctype


def bytes_chart(rows: Sequence[Tuple[str, Optional[int], Optional[int], Optional[int]]],
                salt: str = "regions") -> Optional[str]:
    """Horizontal bars per region: ``(name, stock bytes, declared bytes, bytes at a class's
    extent)``, any of them None. A log scale when the sizes span more than two decades."""
    if not available():
        return None
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    series = [(STOCK, "stock envelope", 1), (DECLARED, "declared carry", 2), (AT_CLASS, "this class", 3)]
    used = [s for s in series if any(r[s[2]] for r in rows)]
    values = [r[k] for r in rows for _, _, k in used if r[k]]
    if not values:
        return None
    height = len(used) * 0.2 * len(rows) + 0.5
    fig = Figure(figsize=(7.5, height))
    ax = fig.subplots()
    bar = 0.8 / max(1, len(used))
    for i, (name, *_) in enumerate(rows):
        for k, (color, _, col) in enumerate(used):
            v = rows[i][col]
            if not v:
                continue
            y = i + (k - (len(used) - 1) / 2) * bar
            ax.barh(y, v, height=bar * 0.9, color=color)
            ax.text(v, y, " " + _human(v), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    if max(values) / min(values) > 100:
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 2, max(values) * 30)
    else:
        ax.set_xlim(0, max(values) * 1.3)
    ax.tick_params(axis="x", which="both", bottom=False, labelbottom=False)  # bars say their value
    ax.spines[["top", "right", "bottom"]].set_visible(False)
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab, _ in used], fontsize=7,
              loc="lower right", frameon=False)
    return _svg(fig, salt)


def pieces_strip(pieces: List[dict], salt: str = "pieces") -> Optional[str]:
    """One strip, a segment per piece in graph order, its width the piece's node count (a
    small piece is drawn at a least width so that it stays visible)."""
    if not available() or not pieces:
        return None
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    total = sum(p["nodes"] for p in pieces) or 1
    widths = [max(p["nodes"] / total, 0.006) for p in pieces]
    scale = sum(widths)
    fig = Figure(figsize=(7.5, 0.85))
    ax = fig.subplots()
    left = 0.0
    for p, w in zip(pieces, widths):
        w /= scale
        ax.barh(0, w, left=left, height=1, color=GRAPH if p["kind"] == "graph" else EAGER,
                edgecolor="white", linewidth=0.8)
        if w > 0.07:
            ax.text(left + w / 2, 0, f"{p['name']}\n{p['nodes']} nodes", ha="center",
                    va="center", fontsize=7, color="white")
        left += w
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, 0.5)
    ax.set_axis_off()
    ax.legend(handles=[Patch(color=GRAPH, label="capturable"), Patch(color=EAGER, label="eager")],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    return _svg(fig, salt)
