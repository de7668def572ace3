"""The class compiler: what happens the first time a call of a new signature class arrives.

Trace the step at the class's exact shapes (or copy a shared trace), run the probationary stock
call that classifies its effects (§3.4 (iii), ``class_probe.py``), bind the regions to the graph, run the pass
pipeline, and record the class entry the call path runs from then on. A class that cannot be
traced, fails a pass or draws host randomness is *rejected*: its calls run the stock step with the
reason (``strict`` raises instead).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from . import fusion, progress, replay, stored_class
from .passes.context import PassContext, RegionBinding
from .class_probe import choose_backend, probe_effects, written_inputs
from .contract import Adapter
from .effects import RngSnapshot
from .errors import ContractError, TraceError
from .passes.fx_utils import graph_module
from .passes.pipeline import PassFailed, run_pipeline
from .passes.records import Records
from .stored_class import carry_like
from .tracing import InputSpec, TracedStep, trace_step

__all__ = ["ClassEntry", "compile_class", "method_targets"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ClassEntry:
    key: Tuple
    gm: torch.fx.GraphModule
    inputs: List[InputSpec]
    traced: TracedStep
    records: Records                 # what the passes did (``passes/records.py``)
    out_regions: Dict[str, int]      # region -> graph output index of its new state
    writes: int
    retentions: int
    traced_nodes: int = 0            # nodes of the graph as traced, before the passes
    materializations: int = 0        # carry writes copying the whole new state, per call
    # region -> op reading its layout (None: the carry pass did not look), built once: every
    # call checks the states that arrive against it
    layout_reads: Optional[Dict[str, str]] = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        self.layout_reads = self.records.layout_reads


def compile_class(cs, key, named) -> Optional[ClassEntry]:
    """Compile the class ``key`` of the compiled step ``cs`` (a ``runtime.CompiledStep``, whose
    class store it fills) from the call ``named``; None when it is rejected (the
    reason is ``cs.store.verdict(key)``). Released envelopes get their storage back for the whole of it
    and are released again afterwards, with any this class newly replaced."""
    with cs.envelopes.held_back() as replaced:
        return _compile(cs, key, named, replaced)


def _compile(cs, key, named, replaced: set) -> Optional[ClassEntry]:
    cs.tensors.refresh()   # stock code may register buffers lazily (Mimi's codebook cache)
    label = _label(cs, key)
    progress.note("%s: compiling ...", label, running=True)
    entry = _load_compiled(cs, key, named, replaced, label)
    if entry is not None:
        return entry
    traced = _trace(cs, key, named)
    if traced is None:
        progress.note("%s: runs the stock step (%s)", label, cs.store.verdict(key) or "not traced")
        return None
    if cs.backend is None:
        cs.backend = choose_backend(cs, named)
    probe_start = time.perf_counter()
    reason = probe_effects(cs, traced, named)
    probe_s = time.perf_counter() - probe_start
    cs.tensors.refresh()   # the stock call may have registered module state lazily
    if reason is not None:
        return _reject(cs, key, label, f"class {key[0]} rejected: {reason}", reason)
    bindings = _bind_regions(cs, traced)
    written_before = {spec.name for spec in written_inputs(traced.gm, traced.inputs)
                      if spec.kind == "buffer"}
    ctx = PassContext(adapter=cs.adapter, class_key=key[0], inputs=list(traced.inputs),
                      regions=bindings, module_buffers=cs.tensors.buffers,
                      verify=cs.config.verify, auditor=cs.auditor, backend=cs.backend,
                      counters=cs.counters, strict=cs.config.strict,
                      constant_ids=cs.tensors.constant_ids,
                      alias_state=cs.config.options.alias_state and not cs.config.options.state_rule)
    ctx.records.probe_s = probe_s
    try:
        gm = run_pipeline(traced.gm, ctx, cs.pipeline)
    except PassFailed as e:
        if cs.config.strict:
            raise
        return _reject(cs, key, label, f"class {key[0]} runs the stock step: {e}", str(e))
    fusion.make_regions(gm, ctx)   # the runtime objects of the passes' specs
    replay.guard_pieces(gm, ctx)
    # fused regions take the code and verdicts an earlier class or process stored
    fusion.resolve_regions(gm, getattr(cs, "kernel_store", None))
    return _enter(cs, key, label, traced, gm, ctx, bindings, replaced, written_before)


def _reject(cs, key, label: str, logged: str, reason: str) -> None:
    """The class runs the stock step, with ``reason``; its trace is kept for the compile cache."""
    log.warning("%s", logged)
    cs.store.reject(key, reason)
    _store_trace(cs, key)
    progress.note("%s: runs the stock step (%s)", label, reason)
    return None


def _enter(cs, key, label: str, traced, gm, ctx, bindings, replaced: set,
           written_before: set) -> ClassEntry:
    """The class entry of a rewritten graph: its buffers kept private, its staging predicted,
    its carry writes counted; recorded in ``cs.store`` and the compile cache."""
    # Buffers the rewritten step still writes get a private copy: the user's module is never
    # written by the compiled path (envelopes replaced by carries are gone by now).
    newly_replaced = written_before - {spec.name for spec in ctx.inputs if spec.kind == "buffer"}
    private = [spec.name for spec in written_inputs(ctx.records.graph or gm, ctx.inputs)
               if spec.kind == "buffer"]
    _keep_buffers(cs, key, ctx.records, replaced, newly_replaced, private)
    # eq. (6), this class: with the regions aliased, only the other tensor arguments are staged
    ctx.records.staging_predicted = sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n, spec in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ctx.inputs)
        if spec.kind == "arg" and isinstance(n.meta.get("val"), torch.Tensor))
    writes = [w for w in ctx.records.rewrites if w.kind in ("retention", "append", "materialize")]
    entry = ClassEntry(
        key=key, gm=gm, inputs=ctx.inputs, traced=traced, records=ctx.records,
        out_regions={b.region.name: b.out_index for b in bindings if b.out_index is not None},
        writes=len(writes), retentions=sum(w.kind == "retention" for w in writes),
        materializations=sum(w.kind == "materialize" for w in writes),
        traced_nodes=len(traced.gm.graph.nodes))
    cs.store.add(entry)
    _warn_room(cs, key, writes)
    if cs.compile_cache is not None or cs.store.shares_classes():
        _store_compiled(cs, entry, private, newly_replaced,
                        {b.region.name: carry_like(b.carry.tensor) for b in bindings})
    log.info("class %s compiled: %d nodes traced in %.2fs", key[0], len(traced.gm.graph.nodes),
             traced.seconds)
    progress.note("%s: %s (%d nodes), probe %.1f s, passes %.1f s", label,
                  "loaded from the compile cache" if traced.loaded else f"traced {traced.seconds:.1f} s",
                  len(traced.gm.graph.nodes), ctx.records.probe_s,
                  sum(p.seconds for p in ctx.records.passes))
    return entry


def _warn_room(cs, key, writes) -> None:
    """A region copied whole in a class where more room would have kept it in place: warned
    once per region, with the class and the room it needs."""
    for w in writes:
        if w.kind == "materialize" and "give the region `room`" in w.detail \
                and cs.store.warn_once(("room", w.region)):
            log.warning("region %r is copied whole on every call of class %s (materialized) where "
                        "room would keep it in place: %s", w.region, key[0],
                        w.detail.split("because ", 1)[-1])


def _keep_buffers(cs, key, records: Records, replaced: set, newly_replaced, private) -> None:
    """Envelopes this class replaced are released with the others (``release_envelopes``); the
    buffers its graph still writes get a private copy: the compiled path never writes the user's
    module."""
    if cs.config.release_envelopes:
        replaced |= set(newly_replaced)
        for miss in records.near_misses:   # a declared envelope kept: say so, once
            if miss.detail.startswith("envelope ") and cs.store.warn_once(miss.detail):
                log.warning("release_envelopes=True, but region %s keeps its stock envelope in "
                            "class %s: %s", miss.region, key[0], miss.detail)
    for name in private:
        cs.tensors.keep_private(name)


def _load_compiled(cs, key, named, replaced: set, label: str) -> Optional[ClassEntry]:
    """The class as another lane of the pool froze it, or as the persistent compile cache stored
    it after its passes (``stored_class``): no trace, no passes, no probationary call. None when
    it is not there or cannot be used."""
    if cs.config.verify:
        return None
    frozen = cs.store.shared_class(key)
    if frozen is not None:
        payload = pickle.loads(frozen)   # a copy of its own: constants are per step
    elif cs.compile_cache is not None:
        payload = cs.compile_cache.load_class(key)
    else:
        return None
    if payload is None:
        return None
    missing = stored_class.missing_state(cs, payload)
    if missing:   # stock code registers it on its first call: compile, with the probe
        log.info("class %s: the cached class reads module state the module does not have yet "
                 "(%s); compiling it", key[0], ", ".join(missing[:3]))
        return None
    start = time.perf_counter()
    if cs.backend is None:
        cs.backend = choose_backend(cs, named)
    regions = {r.name: r for r in cs.adapter.regions}
    for name, like in payload["carries"].items():   # a priming pass makes the carries
        if name not in cs.carries and like is not None:
            shape, dtype, device = like
            cs.admission.allocate(regions[name], SimpleNamespace(
                shape=shape, dtype=dtype, device=torch.device(device)), cs.carries)
    try:
        entry = ClassEntry(key=key, **stored_class.thaw(cs, payload, label))
    except Exception as e:  # noqa: BLE001 - a stored class must never break a compile
        why = f"not loadable here ({type(e).__name__}: {e})"
        if frozen is None:
            cs.compile_cache.unusable(cs.compile_cache.path(key, "class"), why)
        else:
            log.warning("class %s: another lane's compiled class is %s; compiling it", key[0], why)
            cs.store.unshare_class(key)
        return None
    _keep_buffers(cs, key, entry.records, replaced, payload["replaced"], payload["private"])
    entry.records.load_s = time.perf_counter() - start
    cs.store.add(entry)
    _warn_room(cs, key, entry.records.rewrites)
    if frozen is not None:
        cs.counters.lane_loads += 1
    else:
        cs.counters.cache_loads += 1
        cs.counters.compiled_loads += 1
    found = fusion.regions(entry.gm)
    progress.note("%s: loaded compiled from %s in %.2f s (%d nodes traced when stored; %d of %d "
                  "fused regions' code and verdicts loaded)", label, "another lane" if frozen
                  else "the compile cache", entry.records.load_s, entry.traced_nodes,
                  sum(r.loaded for r in found), len(found))
    return entry


def _store_compiled(cs, entry: ClassEntry, private, newly_replaced, carries) -> None:
    try:   # frozen for the compile cache and for the pool's other lanes
        payload = stored_class.freeze(cs, entry, private=private, replaced=list(newly_replaced),
                                      carries=carries)
    except stored_class.Unstorable as e:
        log.info("class %s is not stored compiled: %s", entry.key[0], e)
        _store_trace(cs, entry.key)
        return
    if cs.store.shares_classes():
        try:
            cs.store.share_class(entry.key, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # noqa: BLE001 - the other lanes then compile it themselves
            log.info("class %s is not shared with the other lanes: %s: %s", entry.key[0],
                     type(e).__name__, e)
    if cs.compile_cache is not None:
        cs.compile_cache.store_class(entry.key, payload)
        cs.store.take_unstored(entry.key)


def _store_trace(cs, key) -> None:
    """Cache the trace of a class traced in this process and not stored compiled: one that
    cannot be, or one that runs the stock step (a restart then skips its trace)."""
    traced = cs.store.take_unstored(key)
    if traced is not None and cs.compile_cache is not None:
        cs.compile_cache.store(key, traced)


def _label(cs, key) -> str:
    """``class 3/6 ((24, 24, 4), 8)``: the class and its place in the catalog (a class outside
    it, such as a priming pass, has none)."""
    classes = list(getattr(cs.catalog, "classes", ()))
    where = f" {classes.index(key[0]) + 1}/{len(classes)}" if key[0] in classes else ""
    return f"class{where} {key[0]}"


def _trace(cs, key, named) -> Optional[TracedStep]:
    """The class's aten graph: a copy of a shared trace, the persistent compile cache's, or a
    fresh make_fx trace (then shared, and kept for the compile cache: ``_store_trace``)."""
    cached = cs.store.shared_trace(key)
    if cached is not None:
        cs.counters.trace_copies += 1
        return copy_traced(cached)
    if cs.compile_cache is not None:
        loaded = cs.compile_cache.load(key)
        if loaded is not None:
            cs.counters.cache_loads += 1
            _keep(cs, key, loaded)
            return loaded
    rng = RngSnapshot()  # tracing runs the step's Python code: keep its draws invisible
    try:
        traced = trace_step(cs.module, cs.fn, named, tracing_mode=cs.config.tracing_mode,
                            repeated=cs.repeated)
    except TraceError as e:
        if cs.config.strict:
            raise
        log.warning("class %s runs the stock step: %s", key[0], e)
        cs.store.reject(key, f"could not be traced: {e}")
        return None
    finally:
        rng.restore()
    cs.counters.traces += 1
    cs.counters.copied_calls += traced.copied_calls
    for method, why in traced.refused.items():
        log.info("class %s: %s traced at every call: %s", key[0], method, why)
    kept = _keep(cs, key, traced)
    if cs.compile_cache is not None:
        # stored once the class is compiled, and only if the class itself cannot be (pickling
        # the fake values costs about as much as tracing): a copy the passes leave untouched
        cs.store.hold_unstored(key, kept or copy_traced(traced))
    return traced


def _keep(cs, key, traced: TracedStep) -> Optional[TracedStep]:
    """Keep a copy of the trace the passes are about to rewrite: shared, or for the report.
    Returns the copy kept, if any."""
    if not cs.store.keeps_traces():
        return None
    kept = copy_traced(traced)
    cs.store.keep_trace(key, kept)
    return kept


def _bind_regions(cs, traced: TracedStep) -> List[RegionBinding]:
    """Each fixed-address region's input placeholder, its new state among the outputs, its carry."""
    placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    out_pos = {p: k for k, p in enumerate(traced.out_paths[i] for i in traced.out_tensor_index)}
    bindings = []
    for r in cs.adapter.regions:
        ph = next((n for n, s in zip(placeholders, traced.inputs)
                   if s.kind == "arg" and s.name == r.input), None)
        if r.output not in out_pos and r.fixed_address:
            raise ContractError(f"region {r.name!r}: output path {r.output!r} is not a tensor "
                                f"result of the step (results: {traced.out_paths}); fix `output`")
        if r.fixed_address and cs.config.options.state_rule:
            if r.name not in cs.carries:   # the priming pass: the carry is made for its result
                like = traced.gm.graph.output_node().args[0][out_pos[r.output]].meta["val"]
                cs.admission.allocate(r, like, cs.carries)
            bindings.append(RegionBinding(r, ph, out_pos.get(r.output), cs.carries[r.name]))
    return bindings


def method_targets(adapter: Adapter, module: torch.nn.Module,
                   field: str = "repeated") -> List[Tuple[torch.nn.Module, str]]:
    """The ``(submodule, method)`` pairs an adapter's ``repeated`` (or ``priming``) names."""
    targets = []
    for decl in getattr(adapter, field):
        owner, _, method = decl.rpartition(".")
        found = [sub for path, sub in module.named_modules() if path.rsplit(".", 1)[-1] == owner]
        if not found:
            raise ContractError(f"adapter {adapter.name!r}: {field} call {decl!r} names no "
                                f"submodule called {owner!r} in {type(module).__name__}; fix "
                                f"`{field}` or leave it out")
        for sub in found:
            if not callable(getattr(sub, method, None)):
                raise ContractError(f"adapter {adapter.name!r}: {field} call {decl!r}: "
                                    f"{type(sub).__name__} has no method {method!r}; fix `{field}`")
            targets.append((sub, method))
    return targets


def copy_traced(traced: TracedStep) -> TracedStep:
    """A traced step the passes may rewrite without touching ``traced``: a fresh graph (nodes
    and their meta dicts copied; fake values and module attributes shared, never mutated)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(traced.gm.graph, {})
    graph.output(out)
    gm = graph_module(traced.gm, graph)
    return dataclasses.replace(traced, gm=gm, inputs=list(traced.inputs), seconds=0.0)
