"""What a compiled step shows: its catalog, memory before/after, counters, and per class the
rewritten graph with carry writes and partitions marked. ``str(report)`` for a terminal,
``_repr_html_`` for a notebook (rendered by ``report_html``; the code before the passes is shown
unless the step was compiled with ``keep_before=False``).

``compiled.report()`` on a line of its own shows itself: the text on stdout in a script, the
HTML in a notebook (``show``). Kept in a variable or passed on, it shows nothing, so code that
reads its numbers (``report().memory()``) prints nothing either."""
from __future__ import annotations

import dis
import sys
from types import FrameType
from typing import Dict, List, Optional

from .passes.fx_utils import aten, view_chain

__all__ = ["Report", "show", "shown"]

MAX_GRAPH_LINES = 400


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def show(report) -> None:
    """Show a report now: through IPython's display where IPython runs (the HTML in a notebook,
    the text in a terminal IPython), else its text on stdout."""
    ipython = sys.modules.get("IPython")
    if ipython is not None and ipython.get_ipython() is not None:
        from IPython.display import display
        display(report)
    else:
        sys.stdout.write(f"{report}\n")


def _discarded(frame: FrameType) -> bool:
    """Does ``frame`` throw away the value of the call it is making (an expression statement:
    the next instruction pops it)? A REPL's echo (``PRINT_EXPR``), an assignment, an argument or
    an attribute read keep it."""
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > frame.f_lasti:
            return ins.opname == "POP_TOP"
    return False


def shown(report, frame: FrameType, show_it: Optional[bool] = None):
    """``report``, shown first when ``show_it`` is True, or when it is None and ``frame`` (the
    caller's) discards it."""
    if show_it or (show_it is None and _discarded(frame)):
        show(report)
    return report


class Report:
    def __init__(self, compiled):
        self.c = compiled

    def __repr__(self) -> str:
        """The text report: what a REPL echoes."""
        return str(self)

    # -- data -----------------------------------------------------------------------------
    def memory(self) -> Dict[str, int]:
        c = self.c
        backend = c.backend
        carry = sum(x.tensor.numel() * x.tensor.element_size() for x in c.carries.values())
        private = sum(t.numel() * t.element_size() for t in c.tensors.private.values())
        stock = sum(r.stock_bytes or r.declared_bytes or 0 for r in c.catalog.regions
                    if r.name in c.carries)
        return {"stock_envelope_bytes": stock, "carry_bytes": carry, "private_buffer_bytes": private,
                "graph_allocated_bytes": getattr(backend, "graph_allocated_bytes", 0),
                "graph_reserved_bytes": getattr(backend, "graph_reserved_bytes", 0),
                "capture_seconds": round(getattr(backend, "capture_seconds", 0.0), 3)}

    def classes(self) -> List[dict]:
        rows = []
        for key, e in self.c.classes.items():
            extents, width = key[0]
            rows.append({"extents": list(extents), "width": width,
                         "traced_nodes": e.traced_nodes,
                         "trace_seconds": round(e.traced.seconds, 3),
                         "rewrites": [w.as_dict() for w in e.records.rewrites],
                         "near_misses": [m.as_dict() for m in e.records.near_misses],
                         "constants": [k.as_dict() for k in e.records.constants],
                         "pieces": [{"name": p.name, "kind": p.kind, "nodes": p.nodes,
                                     "reasons": list(p.reasons)} for p in e.records.pieces],
                         "passes": [p.as_dict() for p in e.records.passes],
                         "staging_predicted": e.records.staging_predicted,
                         "fusion": _fusion(e),
                         "staging_bytes": sum(m.staging_bytes for m in e.gm.modules()
                                              if hasattr(m, "staging_bytes"))})
        return rows

    def as_dict(self) -> dict:
        return {"adapter": self.c.adapter.name, "catalog": self.c.catalog.as_dict(),
                "memory": self.memory(), "counters": self.c.counters.as_dict(),
                "audited": dict(self.c.auditor.comparisons), "classes": self.classes()}

    def graph_lines(self, index: int = 0, limit: int = MAX_GRAPH_LINES) -> List[str]:
        """The rewritten (unsplit) graph of one class, a line per node, marked
        ``[piece_i graph|eager]`` and ``<- carry write`` where a node writes a carry."""
        entry = list(self.c.classes.values())[index]
        gm = entry.records.graph
        if gm is None:
            return [line for line in entry.gm.code.splitlines() if line.strip()][:limit]
        piece_of = entry.records.piece_of
        kinds = {i: p.kind for i, p in enumerate(entry.records.pieces)}
        carries = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("carry_")}
        lines = []
        for n in gm.graph.nodes:
            mark = ""
            if n.name in piece_of:
                mark = f"[piece_{piece_of[n.name]} {kinds.get(piece_of[n.name], '?')}] "
            write = (n.op == "call_function" and n.target is aten.copy_.default
                     and view_chain(n.args[0])[0] in carries)
            lines.append(f"{mark}{n.format_node()}{'   <- carry write' if write else ''}")
        if len(lines) > limit:
            head = limit // 2
            writes = [l for l in lines[head:-head] if l.endswith("<- carry write")]
            lines = lines[:head] + [f"... {len(lines) - 2 * head} nodes ..."] + writes + lines[-head:]
        return lines

    # -- text -----------------------------------------------------------------------------
    def __str__(self) -> str:
        d = self.as_dict()
        cat = d["catalog"]
        out = [f"cadence_fx report: adapter {d['adapter']!r}, catalog {cat['catalog_size']} classes, "
               f"{len(d['classes'])} compiled", "", "catalog:"]
        for r in cat["regions"]:
            out.append(f"  {r['name']:<24} extents {r['extents']}  K={r['K']} "
                       f"{'admissible' if r['admissible'] else 'NOT admissible'}  "
                       f"stock {_mib(r['stock_bytes'])} -> declared {_mib(r['declared_bytes'])}")
        m = d["memory"]
        out += ["", f"memory: stock envelopes {_mib(m['stock_envelope_bytes'])}, carries "
                f"{_mib(m['carry_bytes'])}, private buffers {_mib(m['private_buffer_bytes'])}, "
                f"graphs {_mib(m['graph_allocated_bytes'])} held / {_mib(m['graph_reserved_bytes'])} "
                f"reserved, captured in {m['capture_seconds']}s",
                "counters: " + ", ".join(f"{k}={v}" for k, v in d["counters"].items() if k != "reasons")]
        for reason, n in d["counters"]["reasons"].items():
            out.append(f"  fallback x{n}: {reason}")
        for cls in d["classes"]:
            out += ["", f"class extents={cls['extents']} width={cls['width']}: "
                    f"{cls['traced_nodes']} nodes traced in {cls['trace_seconds']}s"]
            out.append(f"  staging     {cls['staging_bytes']} bytes (predicted "
                       f"{cls['staging_predicted']} with the regions aliased)")
            out += [f"  {w['kind']:<11} {w['region']}: {w['detail']}" for w in cls["rewrites"]]
            out += [f"  near-miss   {w['region']}: {w['detail']}" for w in cls["near_misses"]]
            out += [f"  constant    {k['name']} {k['shape']} {k['dtype']} on {k['device']}"
                    f"{' (was a host-to-device copy)' if k['host_to_device'] else ''}"
                    for k in cls["constants"]]
            f = cls["fusion"]
            if f["skipped"] or f["regions"]:
                out.append(f"  fusion      {f['skipped']}" if f["skipped"] else
                           f"  fusion      {f['regions']} regions ({f['kernels']} kernels): "
                           f"{f['fused']} fused, {f['pending']} pending, {len(f['stock'])} stock")
                out += [f"    {name} stock: {reason}" for name, reason in f["stock"][:5]]
            out += [f"  {p['name']:<11} {p['kind']:<5} {p['nodes']} nodes"
                    f"{'  eager: ' + '; '.join(p['reasons']) if p['reasons'] else ''}"
                    for p in cls["pieces"]]
        return "\n".join(out)

    # -- notebook -------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        """Charts, tables and each region's rewrite as code before/after (``report_html``)."""
        from .report_html import render
        return render(self)

    def save_html(self, path) -> None:
        """The report as a standalone HTML page."""
        from .report_html import page
        with open(path, "w", encoding="utf-8") as f:
            f.write(page({"": self}, f"cadence_fx report: {self.c.adapter.name}"))


def _fusion(entry) -> dict:
    """What exact fusion made of a class: its regions and their states (``fusion.py``)."""
    from .fusion import regions
    found = regions(entry.gm)
    record = entry.records.fusion
    return {"skipped": record.skipped if record else None, "regions": len(found),
            "kernels": sum(r.kernels for r in record.regions) if record else 0,
            "fused": sum(r.state == "fused" for r in found),
            "pending": sum(r.state == "pending" for r in found),
            "stock": [(r.region_name, r.reason) for r in found if r.state == "stock"]}
