"""Ahead of traffic: compile (and on CUDA capture) classes before the first chunk arrives.

``prepare`` compiles the class of one example call; ``capture_catalog`` re-cuts one example to every
class of the catalog and prepares each (each class's time goes to ``cadence_fx.progress``).
Neither is traffic: carries, private buffers, arguments, generators and counters are left exactly
as they were. What they did is returned instead: ``capture_catalog`` gives a ``Preparation``, per
class how it came (traced, loaded from the compile cache, or compiled before) and the graphs it
captured, the compile work in counters' terms, and what the adapter admits that it did not prepare.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from . import progress
from .cudagraphs import GLOBAL_STATE
from .effects import RngSnapshot, TensorSnapshot
from .tracing import bind_arguments, leaves_with_paths

__all__ = ["Preparation", "prepare", "capture_catalog"]

# the counters a compile moves (the others count traffic): reported by ``capture_catalog``
WORK = ("traces", "cache_loads", "compiled_loads", "lane_loads", "trace_copies", "copied_calls",
        "fused_regions", "fusions_refused", "fusions_loaded")


def prepare(cs, args, kwargs, work: Optional[Dict[str, int]] = None) -> bool:
    """Trace and capture the class of this call to the compiled step ``cs``, leaving every carry,
    buffer, argument, generator and counter as it was. Returns whether the class is compiled;
    ``work``, when given, gets the compile counters' increments (``WORK``) and ``graphs``, the
    device graphs captured. It holds ``cudagraphs.GLOBAL_STATE`` alone: it puts the generators
    back at the end, which would undo another thread's draws meanwhile (a background priming
    compile with traffic on other lanes)."""
    with GLOBAL_STATE.exclusive():
        return _prepare(cs, args, kwargs, work)


def _prepare(cs, args, kwargs, work: Optional[Dict[str, int]]) -> bool:
    graphs = getattr(cs.backend, "captured", 0)
    snapshot = TensorSnapshot([c.tensor for c in cs.carries.values()]
                              + list(cs.tensors.private.values()))
    rng, counters = RngSnapshot(), copy.deepcopy(cs.counters)
    handed_out = {name: c.handed_out for name, c in cs.carries.items()}
    entry = None
    try:
        with cs.background.inline():   # a priming class is compiled here, not in a thread
            # an example is not the stream's state: copied into the carries, never taken over
            entry, by_path, _ = cs.select(args, kwargs, donate=False)
        if entry is not None:
            written = TensorSnapshot(
                [v for v in by_path.values() if isinstance(v, torch.Tensor)]
                + [c.tensor for c in cs.carries.values()] + list(cs.tensors.private.values()))
            try:
                cs.run(entry, by_path)
            finally:
                written.restore()
    finally:
        snapshot.restore()
        rng.restore()
        if work is not None:
            for f in WORK:
                work[f] = work.get(f, 0) + getattr(cs.counters, f) - getattr(counters, f)
            work["graphs"] = work.get("graphs", 0) + getattr(cs.backend, "captured", 0) - graphs
        for f in dataclasses.fields(counters):  # preparing is not traffic: counters stay put
            setattr(cs.counters, f.name, getattr(counters, f.name))
        for name, c in cs.carries.items():      # nor is what it handed out
            c.handed_out = handed_out.get(name)
    return entry is not None


class Preparation(dict):
    """What ``capture_catalog`` did. As a dict, ``{(extents, width): compiled}``. ``rows``: per
    class, ``how`` it came (``traced``, ``loaded`` compiled from the compile cache, ``loaded from
    another lane`` of the pool, ``compiled from another lane's trace``, ``loaded trace`` then its
    passes, ``compiled before``, or ``stock: <reason>``), the device ``graphs``
    captured and the ``seconds``. ``work``: the compile counters it moved (``WORK``; the step's
    own counters are left as they were, since preparing is not traffic). ``not_prepared``: what
    the adapter admits that it did not prepare, each with why and how to."""

    rows: List[dict]
    work: Dict[str, int]
    not_prepared: List[str]

    def __str__(self) -> str:
        work = ", ".join(f"{k} {v}" for k, v in self.work.items() if v)
        lines = [f"{len(self)} classes, {sum(self.values())} compiled" + (f"; {work}" if work else "")]
        lines += [f"  {r['class']}: {r['how']}, {r['graphs']} graphs, {r['seconds']:.2f} s"
                  for r in self.rows]
        lines += [f"  not prepared: {why}" for why in self.not_prepared]
        return "\n".join(lines)


def capture_catalog(cs, args, kwargs, priming_example=None) -> Preparation:
    """Compile every class of the catalog from one example call, then the priming class of each
    declared prompt length (see ``CompiledStep.capture_catalog``). Returns a ``Preparation``:
    ``{(extents, width): compiled}`` with what it did."""
    named = bind_arguments(cs.arguments, args, kwargs)
    done = Preparation()
    done.rows, done.work, done.not_prepared = [], {}, _not_prepared(cs.adapter)
    if cs.admission.excluded:   # Criterion 3.5: every class runs stock, none is prepared (re-cut
        done.update(dict.fromkeys(cs.catalog.classes, False))   # examples span the whole window)
        done.rows = [{"class": c, "how": f"stock: {cs.admission.excluded}", "graphs": 0,
                      "seconds": 0.0} for c in cs.catalog.classes]
        return done
    by_path = dict(leaves_with_paths(named)[0])
    ad = cs.adapter
    x = by_path.get(ad.call_input) if ad.call_input else None
    width = x.shape[ad.call_dim] if isinstance(x, torch.Tensor) else None
    regions = {r.input for r in ad.regions}
    for i, (extents, w) in enumerate(cs.catalog.classes):
        start = time.perf_counter()
        synth = dict(by_path)
        for r, e in zip(ad.regions, extents):
            t = by_path.get(r.input)
            if isinstance(t, torch.Tensor):
                size = list(t.shape)
                size[r.dim] = e
                synth[r.input] = torch.zeros(size, dtype=t.dtype, device=t.device)
        if width is not None:
            for path, t in by_path.items():
                if (isinstance(t, torch.Tensor) and path not in regions
                        and -t.dim() <= ad.call_dim < t.dim() and t.shape[ad.call_dim] == width):
                    size = list(t.shape)
                    size[ad.call_dim] = w
                    synth[path] = torch.zeros(size, dtype=t.dtype, device=t.device)
        _prepare_row(cs, done, (extents, w), _replace_leaves(named, synth), start,
                     f"class {i + 1}/{len(cs.catalog.classes)}")
    for length in ad.prompt_widths():
        start, cls = time.perf_counter(), (tuple(None for _ in ad.regions), length)
        row = _prepare_row(cs, done, cls, _priming_call(cs, named, by_path, length, priming_example),
                           start, f"priming class, prompt length {length}:")
        if not done[cls] and priming_example is None:   # the re-cut is no priming call here
            del done[cls]
            done.rows.remove(row)
            done.not_prepared.append(
                f"the priming pass at prompt length {length}: the example re-cut to a priming "
                f"call ran {row['how']}; pass capture_catalog(..., priming_example=lambda "
                "length: (args, kwargs)) with a priming call of that length")
    return done


def _prepare_row(cs, done: Preparation, cls: Tuple, call: dict, start: float, label: str) -> dict:
    """Prepare one class from ``call`` and record its row and work in ``done``; returns the row."""
    work: Dict[str, int] = dict.fromkeys((*WORK, "graphs"), 0)
    try:
        done[cls] = prepare(cs, (), call, work)
        how = _how(cs, cls, done[cls], work)
    except Exception as e:  # noqa: BLE001 - an example the step refuses: the class is not prepared
        if cs.config.strict:
            raise
        done[cls] = False
        how = (f"stock: its example failed ({type(e).__name__}: {e}); pass "
               "priming_example=lambda length: (args, kwargs)")
    row = {"class": cls, "how": how, "graphs": work["graphs"],
           "seconds": time.perf_counter() - start}
    done.rows.append(row)
    for k, v in work.items():
        done.work[k] = done.work.get(k, 0) + v
    progress.note("%s %s: %s, %d graphs, in %.1f s", label, cls, row["how"], row["graphs"],
                  row["seconds"])
    return row


def _priming_call(cs, named, by_path, length: int, priming_example) -> dict:
    """A priming call of ``length``: the caller's ``priming_example(length)``, or the example
    re-cut (every region's argument None, the call input and the tensors sharing its width
    re-made at ``length``)."""
    if priming_example is not None:
        args, kwargs = priming_example(length)
        return bind_arguments(cs.arguments, args, kwargs)
    ad = cs.adapter
    heads = {r.input.split(".", 1)[0] for r in ad.regions}
    x = by_path.get(ad.call_input)
    width = x.shape[ad.call_dim] if isinstance(x, torch.Tensor) else None
    synth = {}
    for path, t in by_path.items():
        if (isinstance(t, torch.Tensor) and path.split(".", 1)[0] not in heads and width is not None
                and -t.dim() <= ad.call_dim < t.dim() and t.shape[ad.call_dim] == width):
            size = list(t.shape)
            size[ad.call_dim] = length
            synth[path] = torch.zeros(size, dtype=t.dtype, device=t.device)
    call = _replace_leaves(named, synth)
    return {k: (None if k in heads else v) for k, v in call.items()}


def _how(cs, cls: Tuple, compiled: bool, work: Dict[str, int]) -> str:
    """How the class came: made here (traced, loaded), compiled before, or left stock (why)."""
    if not compiled:
        reason = next((r for k, r in cs.store.verdicts.items() if k[0] == cls), None)
        return f"stock: {reason}" if reason else "stock"
    if work["traces"]:
        return "traced"
    if work["compiled_loads"]:
        return "loaded"
    if work["lane_loads"]:
        return "loaded from another lane"
    if work["trace_copies"]:
        return "compiled from another lane's trace"
    if work["cache_loads"]:
        return "loaded trace"
    return "compiled before"


def _not_prepared(adapter) -> List[str]:
    """What the adapter admits beyond the catalog's classes, which one example cannot make."""
    out = []
    if adapter.regions and not adapter.prompt_lengths:
        out.append("the priming pass (a call without region state): a class of its own, keyed by "
                   "the prompt's length, which the adapter does not declare; declare the lengths "
                   "a server accepts in the adapter's `prompt_lengths`, or call "
                   "`prepare(prompt, ...)` with a prompt example and no region state")
    if adapter.admission is not None:
        bound = adapter.clock(adapter.admission)
        widths = set(adapter.call_widths())
        partial = [f for f in range(1, bound + 1) if f not in widths]
        if partial:
            out.append(f"partial flushes of {partial[0]}..{partial[-1]} frames admitted by "
                       f"`frames <= {adapter.admission}` ({bound}) but not among the call widths "
                       f"{sorted(widths)}: each width is a class of its own; call `prepare` with an "
                       "example of each width the server sends")
    return out


def _replace_leaves(named, by_path):
    leaves, spec = leaves_with_paths(named)
    return pytree.tree_unflatten([by_path.get(p, v) for p, v in leaves], spec)
