"""What an adapter implies, walked through for a newcomer (``cadence-fx explain``).

Every number comes from ``build_catalog`` (extents, K, the declared extent, bytes, the joint
classes in the order the stream reaches them); this module only says *why* each number is what it
is, from the clocks the adapter declares: where a region's extent starts, how far one call
advances it, and where retention caps it (§3.3-3.5). Nothing runs a model.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .catalog import Catalog, RegionCatalog, build_catalog, format_bytes as _b, region_room
from .contract import PREPEND, Adapter, PromptRetained, Region, Ring

__all__ = ["explain", "explain_text"]


def _clock(adapter: Adapter, name: Optional[str]) -> Optional[dict]:
    return None if name is None else {"clock": name, "frames": adapter.clocks[name]}


def _retention(adapter: Adapter, r: Region) -> dict:
    pol, c = r.retention, adapter.clocks
    if isinstance(pol, PromptRetained):
        return {"kind": "prompt_retained", "prompt": _clock(adapter, pol.prompt),
                "retained": _clock(adapter, pol.retained),
                "says": f"keep the first {pol.prompt} = {c[pol.prompt]} frames and the last "
                        f"{pol.retained} = {c[pol.retained]}"}
    if isinstance(pol, Ring):
        return {"kind": "ring", "window": _clock(adapter, pol.window),
                "says": f"a ring of {pol.window} = {c[pol.window]} frames written in place: "
                        "the extent never changes"}
    kept = (f"keep the first {pol.window} = {c[pol.window]} frames, the newest: new frames are "
            "prepended at index 0" if r.ordering == PREPEND else
            f"keep the last {pol.window} = {c[pol.window]} frames, the newest: new frames are "
            "appended at the end")
    return {"kind": "sliding_window", "window": _clock(adapter, pol.window),
            "start": _clock(adapter, pol.start), "says": kept}


def _why(adapter: Adapter, r: Region, rc: RegionCatalog) -> dict:
    """Start, advance and cap of the extent, each with the clock it comes from."""
    pol, c = r.retention, adapter.clocks
    advance = _clock(adapter, r.advance)
    if isinstance(pol, PromptRetained):
        start = dict(_clock(adapter, pol.prompt), says="the first call attends the prompt, "
                     "written by the priming pass (a call with no state: a class of its own, "
                     "keyed by the prompt's shapes, compiled like the others)")
        cap = {"clock": f"{pol.prompt} + {pol.retained}", "frames": c[pol.prompt] + c[pol.retained],
               "says": "retention keeps the prompt and the last retained frames"}
    elif isinstance(pol, Ring):
        start = dict(_clock(adapter, pol.window), says="the ring is full size from the first call")
        cap = dict(_clock(adapter, pol.window), says="the ring's size")
        advance = dict(advance, says="written in place at a moving offset; the extent stays")
    else:
        start = (dict(_clock(adapter, pol.start), says="full context from the first call")
                 if pol.start else {"clock": None, "frames": 0, "says": "empty on the first call"})
        cap = dict(_clock(adapter, pol.window), says="the window keeps the last frames")
    advance.setdefault("says", "each call adds this many frames")
    return {"start": start, "advance": advance, "cap": cap}


def _declared(adapter: Adapter, r: Region, rc: RegionCatalog) -> dict:
    room, source = region_room(adapter, r)
    d = {"frames": rc.declared_extent, "bound": rc.bound, "room": room, "room_from": source}
    if room <= 0:
        d["room_clock"] = None
        d["says"] = "the carry holds exactly the largest extent"
        return d
    d["room_clock"] = {"room": r.room, "advance": r.advance}.get(source)
    if r.envelope:
        why = f"stock code writes the pre-retention state into its envelope {r.envelope!r}"
    elif isinstance(r.retention, PromptRetained):
        why = "the cache grows by a call's frames before retention cuts it"
    else:
        why = "a call's frames are appended before old ones drop"
    if source == "room":
        amount = f"is the declared `room` ({r.room} = {room})"
    elif source == "calls":
        admitted = [adapter.admission] if adapter.admission else []
        clocks = dict.fromkeys([*adapter.call_frames, *admitted])
        amount = ("is the widest call the adapter admits ("
                  + ", ".join(f"{c} = {adapter.clocks[c]}" for c in clocks) + ")")
    else:
        amount = (f"is one advance ({r.advance} = {room}): the call widths count other units than "
                  "this region's frames; declare `room` if one call adds more")
    d["says"] = f"{why}; the room {amount}"
    return d


def _shape(adapter: Adapter, r: Region, dims, frames: Optional[int]) -> Optional[List[int]]:
    if not dims:
        return None
    return [frames if i == r.dim and d is None else adapter.dim_size(d, r) for i, d in enumerate(dims)]


def _stream(adapter: Adapter, catalog: Catalog) -> dict:
    """The classes in the order a stream reaches them: first call, growing extents, steady
    state, then a turn's last call (the flush width) at any extent reached."""
    joint = list(dict.fromkeys(e for e, _ in catalog.classes))
    names = [r.name for r in adapter.regions]
    widths = [adapter.clocks[c] for c in adapter.call_frames] or list(catalog.call_widths)
    steady = widths[0]
    phases = []
    for i, ext in enumerate(joint):
        last = i == len(joint) - 1
        phase = ("first call, steady state" if last and i == 0 else "first call" if i == 0
                 else "steady state" if last else "growing extents")
        phases.append({"phase": phase, "calls": f"{i + 1}+" if last else str(i + 1),
                       "extents": dict(zip(names, ext)), "width": steady,
                       "class": [list(ext), steady]})
    flush = sorted(set(widths[1:]) - {steady})
    partial = None
    if adapter.admission is not None:
        partial = {"clock": adapter.admission, "max_frames": adapter.clocks[adapter.admission],
                   "says": "a shorter last call is admitted; each new width is a class of its "
                           "own, traced the first time it arrives"}
    return {"steady_width": steady, "phases": phases,
            "flush": {"widths": flush,
                      "clocks": [c for c in adapter.call_frames[1:] if adapter.clocks[c] in flush],
                      "classes": [[list(e), w] for w in flush for e in joint],
                      "partial": partial},
            "turn_reset": "a new turn hands in its starting state (the prompt's, or none), "
                          "copied into the carry: the stream goes back to the first call's class"}


def explain(adapter: Adapter) -> dict:
    """Everything ``cadence-fx explain`` says, as data."""
    catalog = build_catalog(adapter)
    regions = []
    for r in adapter.regions:
        rc = catalog.region(r.name)
        regions.append({
            "name": r.name, "input": r.input, "output": r.output, "dim": r.dim,
            "ordering": r.ordering, "retention": _retention(adapter, r),
            "extents": list(rc.extents), "why": _why(adapter, r, rc),
            "K": rc.K, "width_limit": adapter.width_limit, "admissible": rc.admissible,
            "declared_extent": _declared(adapter, r, rc),
            "stock_shape": _shape(adapter, r, r.stock_shape, None),
            "declared_shape": _shape(adapter, r, r.shape, rc.declared_extent),
            "envelope": r.envelope, "stock_bytes": rc.stock_bytes,
            "declared_bytes": rc.declared_bytes, "rho": rc.rho,
            "fixed_address": r.fixed_address})
    return {"adapter": adapter.name, "description": adapter.description,
            "clocks": dict(adapter.clocks), "catalog_size": catalog.size,
            "admissible": catalog.admissible, "width_limit": adapter.width_limit,
            "call_widths": list(catalog.call_widths), "regions": regions,
            "stream": _stream(adapter, catalog)}


# -- text ---------------------------------------------------------------------------------------


def _c(x: Optional[dict]) -> str:
    if x is None or x.get("clock") is None:
        return str(0 if x is None else x["frames"])
    return f"{x['clock']} = {x['frames']}"


def _ext(ext: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in ext.items())


def explain_text(d: dict) -> str:
    out = [f"adapter {d['adapter']}" + (f": {d['description']}" if d["description"] else ""),
           "clocks: " + ", ".join(f"{k}={v}" for k, v in d["clocks"].items()), ""]
    for r in d["regions"]:
        w, dec = r["why"], r["declared_extent"]
        extents = r["extents"] if len(r["extents"]) <= 8 else \
            r["extents"][:3] + ["..."] + r["extents"][-2:]
        out += [f"region {r['name']}  ({r['input']} -> {r['output']}, frame dim {r['dim']}, "
                f"{r['ordering']})",
                f"  retention   {r['retention']['kind'].replace('_', ' ')}: {r['retention']['says']}",
                f"  extents     {', '.join(map(str, extents))}",
                f"    start     {_c(w['start'])}: {w['start']['says']}",
                f"    advance   {_c(w['advance'])}: {w['advance']['says']}",
                f"    cap       {_c(w['cap'])}: {w['cap']['says']}",
                f"  K           {r['K']} (eq. 7) {'<=' if r['admissible'] else '>'} width limit "
                f"{r['width_limit']}: " + ("admissible (Criterion 3.5)" if r["admissible"] else
                                           "NOT admissible (Criterion 3.5): every call runs stock"),
                "  carry       A+ = " + (f"{dec['bound']} + {dec['room']} = " if dec["room"] else "")
                + f"{dec['frames']} frames: {dec['says']}"]
        stock = (f"stock {tuple(r['stock_shape'])} {_b(r['stock_bytes'])}" if r["stock_shape"]
                 else "stock: no envelope declared")
        declared = (f"declared {tuple(r['declared_shape'])} {_b(r['declared_bytes'])}"
                    if r["declared_shape"] else "declared: no shape declared")
        rho = f" (rho {r['rho']:.2f}x)" if r["rho"] else ""
        out += [f"  bytes       {stock} -> {declared}{rho}", ""]
    s = d["stream"]
    verdict = "admissible" if d["admissible"] else "NOT admissible: the step runs stock"
    n = d["catalog_size"]
    out.append(f"stream: {n} class{'es' if n != 1 else ''} in the catalog ({verdict}); "
               f"steady call width {s['steady_width']}")
    phases = s["phases"]
    if len(phases) > 8:  # a wide catalog: the first calls and the last, not every one
        phases = phases[:3] + [None] + phases[-2:]
    for p in phases:
        out.append("  ..." if p is None else f"  call {p['calls']:<5} {p['phase']:<25} "
                   f"width {p['width']}: {_ext(p['extents'])}")
    f = s["flush"]
    for w, clock in zip(f["widths"], f["clocks"]):
        out.append(f"  last call  flush width {w} ({clock}): one class per extent reached "
                   f"({len(s['phases'])})")
    if f["partial"]:
        p = f["partial"]
        out.append(f"  partial    1..{p['max_frames']} frames ({p['clock']}): {p['says']}")
    out.append(f"  turn reset {s['turn_reset']}")
    return "\n".join(out)
