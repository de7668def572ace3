"""The rewrite of one class as code: before/after snippets of the graph's own Python, per region.

The graph before the passes is the copy of the class's trace the step keeps (``keep_before``,
on by default) or its trace cache holds (the passes rewrite the trace in place, so a class entry
alone holds only the graph after them). Both graphs are turned into one line of generated code per node and aligned by
node name (a pass keeps the names of the nodes it leaves, and new nodes get fresh ones). Lines
that differ are given to the region they belong to: starting from the region's own nodes (its
input, its envelope, its new state before; its carry and audit nodes after), changed lines that
read or feed one another join it. What no region claims (hoisted constants, copies of results)
is grouped as ``None``. Without the trace, the snippets show the lines after the passes that touch
each carry.
"""
from __future__ import annotations

import bisect
import re
from typing import Dict, List, Optional, Sequence, Tuple

from torch.fx import GraphModule, Node

from .passes.fx_utils import CATS, aten, view_chain
from .passes.specs import check_carry_write

__all__ = ["before_graph", "region_rewrites"]

CONTEXT = 2          # unchanged lines shown around a change
MAX_HUNKS = 6        # hunks shown per region; the rest are counted
MAX_HUNK_ROWS = 48   # rows shown per hunk; the middle of a longer one is elided

_FREES = re.compile(r";  (?:\w+ = )+None$")
_ASSIGN = re.compile(r"^    (\w+) = ")

Row = Tuple[str, Optional[int], Optional[int]]   # ("eq" | "del" | "add", before index, after index)


def before_graph(compiled, entry):
    """``(graph module, input specs)`` of the class's trace before the passes, or None when the
    step kept neither that copy (``keep_before=False``) nor a trace cache."""
    kept = compiled.store.trace_before(entry.key)
    return None if kept is None else (kept.gm, kept.inputs)


def code_lines(gm: GraphModule, inputs: Sequence) -> List[Tuple[Node, str]]:
    """One line of the graph's generated code per node, the ``x = None`` frees left out;
    placeholders as a comment naming the input each one is."""
    lines, ret = {}, "return"
    for line in gm.graph.python_code("self").src.splitlines():
        m = _ASSIGN.match(line)
        if m:
            lines.setdefault(m.group(1), _FREES.sub("", line.strip()))
        elif line.strip().startswith("return"):
            ret = line.strip()
    specs = iter(inputs)
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            spec = next(specs, None)
            what = f"{spec.kind} {spec.name}" if spec is not None else "input"
            out.append((n, f"# {n.name}: {what}"))
        elif n.op == "output":
            out.append((n, ret))
        else:
            out.append((n, lines.get(n.name) or n.format_node()))
    return out


def _increasing(pairs: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The longest run of ``pairs`` (taken in after order) whose before indices increase."""
    tails, tail_at, back = [], [], [None] * len(pairs)
    for k, (b, _) in enumerate(pairs):
        i = bisect.bisect_left(tails, b)
        back[k] = tail_at[i - 1] if i else None
        if i == len(tails):
            tails.append(b)
            tail_at.append(k)
        else:
            tails[i], tail_at[i] = b, k
    out, k = [], tail_at[-1] if tail_at else None
    while k is not None:
        out.append(pairs[k])
        k = back[k]
    return out[::-1]


def align(before: List[Tuple[Node, str]], after: List[Tuple[Node, str]]) -> List[Row]:
    """Rows of a diff: lines equal on both sides (same node name, same code) as anchors."""
    at = {n.name: i for i, (n, _) in enumerate(before)}
    same = [(at[n.name], j) for j, (n, line) in enumerate(after)
            if n.name in at and before[at[n.name]][1] == line]
    rows: List[Row] = []
    i = j = 0
    for b, a in _increasing(same) + [(len(before), len(after))]:
        rows += [("del", k, None) for k in range(i, b)] + [("add", None, k) for k in range(j, a)]
        if b < len(before):
            rows.append(("eq", b, a))
        i, j = b + 1, a + 1
    return rows


def _seeds(entry, region, before, after, before_inputs) -> set:
    """The region's own nodes: carry and audits after; input, envelope and new state before."""
    seeds = set()
    for (n, _), spec in zip([x for x in after if x[0].op == "placeholder"], entry.inputs):
        if spec.kind == "carry" and spec.name == region.name:
            seeds.add(("a", n.name))
    seeds |= {("a", n.name) for n, _ in after if _audits(n) == region.name}
    if before is not None:
        wanted = {("arg", region.input), ("buffer", region.envelope)}
        for (n, _), spec in zip([x for x in before if x[0].op == "placeholder"], before_inputs):
            if (spec.kind, spec.name) in wanted:
                seeds.add(("b", n.name))
        idx = entry.out_regions.get(region.name)
        out = before[-1][0]
        if idx is not None and out.op == "output" and idx < len(out.args[0]):
            state = out.args[0][idx]
            if isinstance(state, Node):
                seeds.add(("b", state.name))
    return seeds


def _audits(n: Node) -> Optional[str]:
    if n.op == "call_function" and n.target is check_carry_write:
        return n.args[1]
    return None


def _carry_write(n: Node, carries: Dict[str, str]) -> Optional[str]:
    """The region whose carry ``n`` writes (an in-place copy into a view of it), or None."""
    if n.op == "call_function" and n.target is aten.copy_.default:
        return carries.get(view_chain(n.args[0])[0].name)
    return None


def _claim(rows, before, after, seeds_by_region) -> Dict[Tuple[str, str], object]:
    """Each changed line's owner: the region whose own nodes are nearest to it through changed
    lines (ties go to the region declared first)."""
    changed = {("b", before[b][0].name) for kind, b, _ in rows if kind == "del"}
    changed |= {("a", after[a][0].name) for kind, _, a in rows if kind == "add"}
    nodes = {("b", n.name): n for n, _ in before or ()}
    nodes.update({("a", n.name): n for n, _ in after})

    def neighbours(key):
        side, name = key
        n = nodes[key]
        near = [x.name for x in list(n.all_input_nodes) + list(n.users)]
        other = "a" if side == "b" else "b"
        return [(side, m) for m in near] + [(other, name)]

    # one breadth-first walk from every region's seeds at once: a line goes to the nearest region
    owner, frontier = {}, []
    for region, seeds in seeds_by_region.items():
        for key in sorted(seeds):
            if key in nodes and key not in owner:
                owner[key] = region
                frontier.append(key)
    while frontier:
        nxt_frontier = []
        for key in frontier:
            for nxt in neighbours(key):
                if nxt in changed and nxt not in owner:
                    owner[nxt] = owner[key]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return owner


def region_rewrites(compiled, entry) -> List[dict]:
    """Per region (and ``None`` for the rest): its records and the before/after hunks."""
    graph = entry.records.graph or entry.gm
    after = code_lines(graph, entry.inputs)
    kept = before_graph(compiled, entry)
    before = code_lines(*kept) if kept is not None else None
    carries = {n.name: s.name for (n, _), s in zip(
        [x for x in after if x[0].op == "placeholder"], entry.inputs) if s.kind == "carry"}
    regions = compiled.adapter.regions
    seeds = {r.name: _seeds(entry, r, before, after, kept[1] if kept else ()) for r in regions}
    if before is not None:
        rows = align(before, after)
        owner = _claim(rows, before, after, seeds)
    else:  # no trace kept: the lines after the passes that touch a carry
        rows, owner = [], {}
        for j, (n, _) in enumerate(after):
            hit = (_audits(n) or _carry_write(n, carries) or carries.get(n.name)
                   or next((carries[a.name] for a in n.all_input_nodes if a.name in carries), None))
            rows.append(("add" if hit else "eq", None, j))
            if hit:
                owner[("a", n.name)] = hit
    out = []
    for name in [r.name for r in regions] + [None]:
        mine = [k for k, row in enumerate(rows) if _row_owner(row, before, after, owner) == name
                and row[0] != "eq"]
        if name is not None or mine:
            out.append(_region_entry(name, entry, rows, mine, before, after, owner, carries))
    return out


def _row_owner(row: Row, before, after, owner):
    kind, b, a = row
    if kind == "del":
        return owner.get(("b", before[b][0].name))
    if kind == "add":
        return owner.get(("a", after[a][0].name))
    return "eq"


def _region_entry(name, entry, rows, mine, before, after, owner, carries) -> dict:
    writes = sum(_carry_write(n, carries) == name for n, _ in after) if name else 0
    new = sum(rows[k][0] == "add" and _carry_write(after[rows[k][2]][0], carries) == name
              for k in mine) if name else 0
    audits = sum(_audits(after[rows[k][2]][0]) is not None for k in mine if rows[k][0] == "add")
    windows: List[List[int]] = []
    for k in mine:
        lo, hi = max(0, k - CONTEXT), min(len(rows) - 1, k + CONTEXT)
        if windows and lo <= windows[-1][1] + 1:
            windows[-1][1] = hi
        else:
            windows.append([lo, hi])
    # the hunks that say what the rewrite is come first, in graph order: new carry writes,
    # audits, the stock concatenations that went, the outputs; then the others
    key = [not any(_essential(r, before, after, carries) for r in rows[lo:hi + 1]) for lo, hi in windows]
    shown = sorted(range(len(windows)), key=lambda i: key[i])[:MAX_HUNKS]
    hunks = [_hunk(rows[windows[i][0]:windows[i][1] + 1], name, before, after, owner, carries)
             for i in shown]
    return {"region": name,
            "records": [w.as_dict() for w in entry.records.rewrites + entry.records.near_misses
                        if w.region == name] if name is not None else [],
            "removed": sum(rows[k][0] == "del" for k in mine),
            "added": sum(rows[k][0] == "add" for k in mine),
            "writes": writes, "new_writes": new, "audits": audits, "before_kept": before is not None,
            "hunks": hunks, "more_hunks": max(0, len(windows) - MAX_HUNKS)}


def _essential(row: Row, before, after, carries) -> bool:
    kind, b, a = row
    if kind == "add":
        n = after[a][0]
        return n.op == "output" or _audits(n) is not None or _carry_write(n, carries) is not None
    if kind == "del":
        n = before[b][0]
        return n.op == "output" or n.target in CATS
    return False


def _hunk(rows: List[Row], name, before, after, owner, carries) -> dict:
    """Two columns of ``(class, text)``: ``ctx``, ``del``/``add`` (this region's), ``other``
    (another region's change), ``write`` (a new carry write), ``kept`` (a stock write that now
    lands in the carry), ``audit`` (a shadow comparison)."""
    left, right = [], []
    for row in rows:
        kind, b, a = row
        mark = kind if _row_owner(row, before, after, owner) == name else "other"
        if kind == "eq":
            mark = "ctx"
        if b is not None:
            left.append((mark, before[b][1]))
        if a is not None:
            n = after[a][0]
            if mark == "add" and _audits(n) is not None:
                mark = "audit"
            elif mark in ("add", "ctx") and name is not None and _carry_write(n, carries) == name:
                # unchanged too ("kept"): the stock code's own copy now lands in the carry
                mark = "write" if mark == "add" else "kept"
            right.append((mark, after[a][1]))
    return {"before": _elide(left) if before is not None else None, "after": _elide(right)}


def _elide(lines: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    if len(lines) <= MAX_HUNK_ROWS:
        return lines
    half = MAX_HUNK_ROWS // 2
    return lines[:half] + [("gap", f"... {len(lines) - 2 * half} more lines ...")] + lines[-half:]
