"""The report as HTML: a notebook's ``compiled.report()`` and ``cadence-fx report --html``.

Summaries first, details folded: the regions (stock vs declared bytes), memory and capture,
counters and fallback reasons, a table of the classes; then, per compiled class in a
``<details>``, its regions at the class's extents, the strip of its pieces in graph order, the
rewrite of each region as code before and after the passes, the passes, and the rewritten graph.
Every text is escaped; the charts come from ``report_charts`` (tables alone without matplotlib).
"""
from __future__ import annotations

import html
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from . import report_charts as charts
from .catalog import format_bytes as _b
from .report_rewrites import region_rewrites

__all__ = ["render", "page", "catalog_page", "STYLE"]

STYLE = """
.cfx{font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;max-width:1380px}
.cfx h2{font-size:18px;margin:14px 0 4px}.cfx h3{font-size:15px;margin:14px 0 4px}
.cfx h4{font-size:13px;margin:10px 0 4px}
.cfx table{border-collapse:collapse;margin:4px 0}
.cfx th,.cfx td{border:1px solid #ddd;padding:2px 7px;text-align:left;vertical-align:top}
.cfx th{background:#f4f4f4}.cfx td.n{text-align:right;font-variant-numeric:tabular-nums}
.cfx .sum{margin:2px 0 6px;color:#444}.cfx .bad{color:#b00020;font-weight:600}
.cfx .ok{color:#1b7f3b}.cfx .note{color:#666;font-style:italic}
.cfx details{margin:6px 0;padding-left:10px;border-left:3px solid #e4e4e4}
.cfx summary{cursor:pointer;padding:2px 0}.cfx summary b{font-weight:600}
.cfx .diff{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:6px 8px;margin:4px 0 10px}
.cfx .code{font:11px/1.35 ui-monospace,Menlo,Consolas,monospace;white-space:pre;overflow-x:auto;
 background:#fbfbfb;border:1px solid #e8e8e8;padding:3px 0}
.cfx .code div{padding:0 6px}.cfx .col{font-weight:600;margin:2px 0}
.cfx .del{background:#ffe1e1}.cfx .add{background:#dcf5dc}.cfx .write{background:#ffe08a}
.cfx .kept{background:#fff4cc}
.cfx .audit{background:#dde4ff}.cfx .ctx{color:#555}.cfx .other{color:#aaa}
.cfx .gap{color:#888;font-style:italic}.cfx .eager{color:#b00020}
.cfx svg{max-width:100%;height:auto}
"""

_MARK = {"del": "- ", "add": "+ ", "write": "+ ", "audit": "+ ", "ctx": "  ", "other": "  ",
         "gap": "  ", "kept": "  "}


class _Raw(str):
    """Markup built here, inserted as it is (everything else is escaped)."""


def _e(x) -> str:
    return x if isinstance(x, _Raw) else html.escape(str(x), quote=True)


def _n(k: int, one: str, many: Optional[str] = None) -> str:
    return f"{k} {one if k == 1 else many or one + 's'}"


def _table(head: Optional[Sequence[str]], rows: Iterable[Sequence],
           numeric: Sequence[int] = ()) -> _Raw:
    th = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>" if head else ""
    body = "".join("<tr>" + "".join(f"<td{' class=n' if i in numeric else ''}>{_e(c)}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return _Raw(f"<table>{th}{body}</table>")


def _details(summary: str, body: str, open_: bool = False) -> _Raw:
    return _Raw(f"<details{' open' if open_ else ''}><summary>{_e(summary)}</summary>{body}</details>")


def _chart(svg: Optional[str]) -> str:
    return f"<div class=chart>{svg}</div>" if svg else ""


# -- the catalog --------------------------------------------------------------------------------

def _regions(catalog) -> str:
    rows = [(r.name, r.stock_bytes, r.declared_bytes, None) for r in catalog.regions]
    table = _table(
        ["region", "extents", "K", "admissible", "carry frames (A+)", "stock", "declared", "rho"],
        [(r.name, _short(r.extents), r.K, "yes" if r.admissible else _Raw("<span class=bad>no</span>"),
          r.declared_extent, _b(r.stock_bytes), _b(r.declared_bytes),
          f"{r.rho:.2f}x" if r.rho else "-") for r in catalog.regions], numeric=(2, 4, 5, 6, 7))
    return (f"<h3>Regions: stock vs declared bytes</h3>{_chart(charts.bytes_chart(rows))}{table}")


def _short(extents) -> str:
    e = list(extents)
    return ", ".join(map(str, e)) if len(e) <= 8 else f"{e[0]}, {e[1]}, ..., {e[-1]} ({len(e)})"


def catalog_page(adapter) -> str:
    """A page for an adapter alone: its catalog, what it implies, no model run."""
    from .catalog import build_catalog
    from .explain import explain, explain_text
    catalog = build_catalog(adapter)
    body = (f"<div class=cfx><h2>cadence_fx: adapter {_e(adapter.name)}</h2>"
            f"<p class=sum>{_e(adapter.description)}</p>{_regions(catalog)}"
            f"<h3>What it implies</h3><div class=code>{_e(explain_text(explain(adapter)))}</div></div>")
    return _document(f"cadence_fx: {adapter.name}", body)


# -- one compiled step --------------------------------------------------------------------------

def render(report, name: Optional[str] = None, style: bool = True, expand: bool = False) -> str:
    """The HTML of one compiled step's report (a notebook cell's output; ``style=False``
    inside a page that carries the style once). ``expand`` unfolds the first class that writes
    a carry, and its rewrites, as an example."""
    c, d = report.c, report.as_dict()
    cat, counters = d["catalog"], d["counters"]
    title = f"cadence_fx: {name + ': ' if name else ''}adapter {d['adapter']}"
    verdict = "admissible" if cat["admissible"] else "NOT admissible"
    summary = (f"catalog {cat['catalog_size']} classes ({verdict}), {len(c.classes)} compiled, "
               f"{len(c.store.verdicts)} running stock; {counters['calls']} calls, "
               f"{counters['compiled_calls']} compiled, {counters['fallbacks']} fallbacks; "
               f"carry addresses per region: {counters['carry_addresses']}")
    parts = [f"<style>{STYLE}</style>" if style else "",
             f"<div class=cfx><h2>{_e(title)}</h2><p class=sum>{_e(summary)}</p>",
             _regions(c.catalog), _memory(report, d), _counters(d), _classes(c, d)]
    example = next((i for i, r in enumerate(d["classes"]) if _writes(r)), None) if expand else None
    for i, (key, entry) in enumerate(c.classes.items()):
        parts.append(_class(report, c, entry, d["classes"][i], i, open_=i == example))
    parts.append("</div>")
    return "".join(parts)


def page(reports: Dict[str, object], title: str, notes: Optional[dict] = None) -> str:
    """A whole HTML document: one section per compiled step (``{name: Report}``)."""
    head = f"<div class=cfx><h1 style='font-size:20px'>{_e(title)}</h1>"
    if notes:
        head += "<p class=sum>" + _e(" · ".join(f"{k} {v}" for k, v in notes.items())) + "</p>"
    head += "</div>"
    return _document(title, head + "".join(render(r, name, style=False, expand=True)
                                         for name, r in reports.items()))


def _document(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def _memory(report, d) -> str:
    m, backend = d["memory"], report.c.backend
    name = getattr(backend, "name", None) or "none yet"
    rows = [("stock envelopes the carries replace", _b(m["stock_envelope_bytes"])),
            ("carries", _b(m["carry_bytes"])), ("private buffer copies", _b(m["private_buffer_bytes"])),
            ("device graphs: held / reserved",
             f"{_b(m['graph_allocated_bytes'])} / {_b(m['graph_reserved_bytes'])}"),
            ("captures", f"{getattr(backend, 'captured', 0)} in {m['capture_seconds']} s "
                         f"(warm-up {round(getattr(backend, 'warmup_seconds', 0.0), 3)} s)"),
            ("backend", name if name != "eager" else "eager: guarded eager pieces, no device graphs")]
    return f"<h3>Memory and capture</h3>{_table(None, rows)}"


def _counters(d) -> str:
    cnt = {k: v for k, v in d["counters"].items() if k != "reasons"}
    keys, per_row = list(cnt), 3
    rows = [sum(((k, cnt[k]) for k in keys[i:i + per_row]), ()) for i in range(0, len(keys), per_row)]
    rows[-1] += ("", "") * (per_row - len(rows[-1]) // 2)
    out = f"<h3>Counters</h3>{_table(None, rows, numeric=(1, 3, 5))}"
    if d["audited"]:
        out += _table(["region", "audited carry writes"], d["audited"].items(), numeric=(1,))
    reasons = d["counters"]["reasons"]
    if reasons:
        out += "<h4>Fallback reasons</h4>" + _table(["calls", "reason"],
                                                     [(n, r) for r, n in reasons.items()], numeric=(0,))
    else:
        out += "<p class=ok>No fallbacks.</p>"
    return out


def _classes(c, d) -> str:
    """Every class of the catalog, in the order the stream reaches it, and any other seen."""
    seen = {key[0]: e for key, e in c.classes.items()}
    rejected = {key[0]: why for key, why in c.store.verdicts.items()}
    by_key = {(tuple(r["extents"]), r["width"]): r for r in d["classes"]}
    rows = []
    keys = [(tuple(x["extents"]), x["width"]) for x in d["catalog"]["classes"]]
    keys += [k for k in list(seen) + list(rejected) if k not in keys]
    for k in keys:
        r = by_key.get(k)
        if r is not None:
            kinds = sorted({w["kind"] for w in r["rewrites"]})
            graph = sum(p["kind"] == "graph" for p in r["pieces"])
            rows.append((list(k[0]), k[1], "compiled", r["traced_nodes"], r["trace_seconds"],
                         round(seen[k].records.probe_s or 0.0, 3),
                         round(sum(p["seconds"] for p in r["passes"]), 3),
                         f"{graph} capturable, {len(r['pieces']) - graph} eager", ", ".join(kinds)))
        elif k in rejected:
            rows.append((list(k[0]), k[1], _Raw(f"<span class=bad>stock: {_e(rejected[k])}</span>"),
                         "", "", "", "", "", ""))
        else:
            rows.append((list(k[0]), k[1], _Raw("<span class=note>not reached</span>"),
                         "", "", "", "", "", ""))
    return "<h3>Classes</h3>" + _table(
        ["extents", "width", "status", "traced nodes", "trace s", "probe s", "passes s", "pieces",
         "rewrites"], rows, numeric=(3, 4, 5, 6))


def _writes(row) -> List[dict]:
    return [w for w in row["rewrites"] if w["kind"] in ("retention", "append", "materialize")]


def _class(report, c, entry, row, index: int, open_: bool = False) -> str:
    extents, width = entry.key[0]
    pieces = row["pieces"]
    graph = sum(p["kind"] == "graph" for p in pieces)
    rewrites = ", ".join(dict.fromkeys(f"{w['kind']} {w['region']}" for w in row["rewrites"]))
    head = (f"class extents={list(extents)} width={width}: {row['traced_nodes']} nodes traced in "
            f"{row['trace_seconds']} s; {_n(len(pieces), 'piece')} ({graph} capturable, "
            f"{len(pieces) - graph} eager); rewrites: {rewrites or 'none'}; "
            f"{_n(len(row['near_misses']), 'near miss', 'near misses')}")
    body = [_class_regions(c, extents), _pieces(entry, index), _rewrites(c, entry, open_),
            "<h4>Passes</h4>" + _table(
                ["pass", "modified", "nodes before", "nodes after", "seconds"],
                [(p["name"], p["modified"], p["nodes_before"], p["nodes_after"], p["seconds"])
                 for p in row["passes"]], numeric=(2, 3, 4)),
            f"<p class=sum>staging {_b(row['staging_bytes'])} (eq. 6 predicts "
            f"{_b(row['staging_predicted'])} with the regions aliased)</p>"]
    if row["constants"]:
        body.append(_details(f"{len(row['constants'])} hoisted constants", _table(
            ["name", "shape", "dtype", "device", "was a host-to-device copy"],
            [(k["name"], k["shape"], k["dtype"], k["device"], k["host_to_device"])
             for k in row["constants"]])))
    lines = report.graph_lines(index)
    code = "".join(f"<div class={_graph_line_class(l)}>{_e(l)}</div>" for l in lines)
    body.append(_details(f"the rewritten graph ({len(lines)} lines, pieces marked)",
                         f"<div class=code>{code}</div>"))
    return _details(head, "".join(body), open_)


def _graph_line_class(line: str) -> str:
    return "write" if line.endswith("<- carry write") else "eager" if " eager] " in line else "ctx"


def _class_regions(c, extents) -> str:
    rows, table = [], []
    for r, e in zip(c.catalog.regions, extents):
        known = e is not None and r.declared_bytes and r.declared_extent  # None: no state yet
        at = r.declared_bytes * e // r.declared_extent if known else None
        rows.append((r.name, r.stock_bytes, r.declared_bytes, at))
        table.append((r.name, "no state" if e is None else e, r.declared_extent, _b(at),
                      _b(r.declared_bytes), _b(r.stock_bytes)))
    return ("<h4>Regions at this class</h4>" + _chart(charts.bytes_chart(rows, salt=f"cls{extents}"))
            + _table(["region", "extent", "carry frames", "bytes at this extent", "declared", "stock"],
                     table, numeric=(1, 2, 3, 4, 5)))


def _or_dash(n) -> str:
    return "-" if n is None else str(n)


def _piece_state(entry, p) -> str:
    piece = getattr(entry.gm, p.name, None)
    if p.kind == "eager":
        return "eager: " + "; ".join(p.reasons)
    if piece is None or getattr(piece, "signature", None) is None:
        return "not run yet"
    if getattr(piece, "replay", None) is not None:
        return "captured, replays"
    if getattr(piece, "eager_reason", None):
        return f"eager: {piece.eager_reason}"
    return "guarded eager (no device graphs on this backend)"


def _pieces(entry, index: int) -> str:
    pieces = entry.records.pieces
    table = _table(["piece", "kind", "nodes", "state", "inputs (aliased)", "depends on"],
                   [(p.name, p.kind, p.nodes, _piece_state(entry, p),
                     f"{_or_dash(p.inputs)} ({_or_dash(p.aliased_inputs)})",
                     ", ".join(f"piece_{i}" for i in p.depends_on))
                    for p in pieces], numeric=(2,))
    strip = charts.pieces_strip([p.as_dict() for p in pieces], salt=f"pieces{index}")
    return f"<h4>Pieces in graph order</h4>{_chart(strip)}{table}"


def _rewrites(c, entry, open_: bool) -> str:
    out = ["<h4>Rewrites, per region</h4>"]
    if entry.records.graph is None and not isinstance(entry.gm, torch.fx.GraphModule):
        # loaded compiled from the compile cache: the graph is code, the records are kept
        out.append("<p class=note>Loaded from the compile cache, where the class is kept as "
                   "code: the rewrites are listed without their lines. Compile it without the "
                   "cache (or after <code>cadence-fx cache clear</code>) to see them.</p>")
        regions = [r.name for r in c.adapter.regions]
        for name in regions + [None]:
            mine = [w for w in entry.records.rewrites if (w.region == name if name
                                                          else w.region not in regions)]
            if name is None and not mine:
                continue
            kinds = ", ".join(dict.fromkeys(w.kind for w in mine)) or "unchanged"
            body = "<ul>" + "".join(f"<li>{_e(w.kind)}: {_e(w.detail)}</li>"
                                    for w in mine) + "</ul>" if mine else ""
            label = f"region {name}" if name else "other changes"
            out.append(_details(f"{label}: {kinds}", body, open_ and bool(mine)))
        return "".join(out)
    groups = region_rewrites(c, entry)
    if groups and not groups[0]["before_kept"]:
        out.append("<p class=note>The trace before the passes was not kept (compiled with "
                   "keep_before=False): the lines below are the graph after the passes "
                   "that touch each carry.</p>")
    for g in groups:
        kinds = ", ".join(dict.fromkeys(w["kind"] for w in g["records"])) or "unchanged"
        label = f"region {g['region']}: {kinds}" if g["region"] else "other changes"
        summary = (f"{label}: -{g['removed']} +{g['added']} lines, {_n(g['writes'], 'write')} "
                   f"into the carry ({g['new_writes']} new)"
                   + (f", {_n(g['audits'], 'audit')}" if g["audits"] else "")
                   + (f", {g['more_hunks']} more hunks not shown" if g["more_hunks"] else ""))
        body = ""
        if g["records"]:
            body += "<ul>" + "".join(f"<li>{_e(w['kind'])}: {_e(w['detail'])}</li>"
                                     for w in g["records"]) + "</ul>"
        if g["hunks"] and g["hunks"][0]["before"] is not None:
            body += ("<div class=diff><div class=col>before the passes</div><div class=col>after"
                     "</div>" + "".join(_code(h["before"]) + _code(h["after"]) for h in g["hunks"])
                     + "</div>")
        elif g["hunks"]:
            body += ("<div><div class=col>after the passes</div>"
                     + "".join(_code(h["after"]) for h in g["hunks"]) + "</div>")
        out.append(_details(summary, body, open_ and g["writes"] > 0))
    return "".join(out)


def _code(lines) -> str:
    return "<div class=code>" + "".join(
        f"<div class={m}>{_e(_MARK.get(m, '  ') + text)}</div>" for m, text in lines) + "</div>"
