"""The compiled step: admission, carries, one rewritten graph per signature class, counters.

A call is admitted when every region's extent is in the catalog and its frame width passes the
adapter's admission predicate. Its region inputs are then made to *be* views of their carries
(a foreign tensor -- the first call, a turn reset restoring the prompt state -- is copied in once;
the caller's tensor is never written, which is what makes prompt state copy-on-write). The class's
graph is traced on first sight, rewritten by the pipeline and run; region results come back as views
of the carries, so their address never changes. Anything not admitted runs the stock step, with
the reason recorded (and raised in strict mode).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.utils._pytree as pytree

from .audit import Auditor
from .catalog import Catalog, build_catalog
from .context import Carry, PassContext, RegionBinding
from .contract import Adapter
from .counters import Counters
from .effects import RngSnapshot, TensorSnapshot
from .errors import ContractError, GuardError, TraceError
from .fx_utils import graph_module, mutated_attributes, written_bases
from .pipeline import Options, PassFailed, build_pipeline, run_pipeline
from .replay import EagerBackend
from .tracing import (InputSpec, TracedStep, bind_arguments, global_signature, leaves_with_paths,
                      module_state_tensors, tensor_signature, trace_step)

__all__ = ["compile", "CompiledStep"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ClassEntry:
    key: Tuple
    gm: torch.fx.GraphModule
    inputs: List[InputSpec]
    traced: TracedStep
    records: Dict[str, list]
    out_regions: Dict[str, int]      # region -> graph output index of its new state
    writes: int
    retentions: int


class CompiledStep:
    """What ``cadence_fx.compile`` returns: call it like the stock step."""

    def __init__(self, step: Callable, adapter: Adapter, module: torch.nn.Module, *,
                 verify: bool = False, strict: bool = False, options: Options = Options(),
                 backend=None, tracing_mode: str = "fake",
                 carries: Optional[Dict[str, Carry]] = None, graphs: bool = True,
                 copy_outputs: bool = True, release_envelopes: bool = False,
                 trace_cache: Optional[dict] = None):
        self.step = step
        self.adapter = adapter.validate()
        self.catalog: Catalog = build_catalog(adapter)
        self.module = module
        self.verify = verify
        self.strict = strict
        self.options = options
        self.backend = backend            # chosen at the first class when None
        self.graphs = graphs
        self.copy_outputs = copy_outputs
        self.release_envelopes = release_envelopes
        self.trace_cache = trace_cache    # shared between compiled steps of one module, if given
        self._released: Dict[str, int] = {}   # envelope buffer -> bytes of its freed storage
        self.tracing_mode = tracing_mode
        self.counters = Counters()
        self.auditor = Auditor()
        self.carries: Dict[str, Carry] = {} if carries is None else carries  # may be shared
        self.classes: Dict[Tuple, ClassEntry] = {}
        self._private: Dict[str, torch.Tensor] = {}
        self._rejected: Dict[Tuple, str] = {}   # classes that run the stock step, with the reason
        self._params = dict(module.named_parameters())
        self._buffers = dict(module.named_buffers())
        devices = {p.device for p in self._params.values()}
        self._weights_device = devices.pop() if len(devices) == 1 else None  # checked when one
        dtypes = {p.dtype for p in self._params.values() if p.is_floating_point()}
        self._weights_dtype = dtypes.pop() if len(dtypes) == 1 else None     # likewise
        # (what, path, declared element width or None): checked on every call
        self._placement_checked = [(f"region {r.name!r} state", r.input, r.element_bytes)
                                   for r in adapter.regions]
        if adapter.call_input is not None:
            self._placement_checked.append(("call input", adapter.call_input, None))
        self._extents = {r.name: set(self.catalog.region(r.name).extents) for r in adapter.regions}
        self._classes_ok = {e for e, _ in self.catalog.classes}
        self._pipeline = build_pipeline(options)
        self._excluded = None  # Criterion 3.5: a catalog too wide to specialise runs stock
        wide = [r for r in self.catalog.regions if not r.admissible]
        if wide:
            self._excluded = "; ".join(
                f"region {r.name!r} has K = {r.K} signature classes, over the width limit "
                f"{adapter.width_limit} (Criterion 3.5)" for r in wide) + ": the step runs stock"
            if strict:
                raise GuardError(f"strict mode: {self._excluded}")
            log.warning("%s", self._excluded)
        self._fn = step.forward if isinstance(step, torch.nn.Module) else step
        self._arguments = inspect.signature(self._fn)  # bound on every call: inspect it once
        self._declared = {r.name: [None if i == r.dim else adapter.dim_size(d, r)
                                   for i, d in enumerate(r.shape)] for r in adapter.regions}
        # tensor attributes the adapter declares constant (e.g. HiFT's ``stft_window``)
        self._constant_ids = {id(t) for name, t in module_state_tensors(module).items()
                              if name.rsplit(".", 1)[-1] in adapter.constants}
        self._repeated = _repeated_targets(adapter, module) if options.repeated else []

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self.counters.calls += 1
        self.auditor.call_index = self.counters.calls
        entry, by_path, reason = self._select(args, kwargs)
        if entry is None:
            return self._eager(reason, args, kwargs)
        return self._run(entry, by_path)

    def _select(self, args, kwargs):
        """Admission, absorption into the carries, and the class entry (traced on first sight)."""
        leaves, spec = leaves_with_paths(bind_arguments(self._arguments, args, kwargs))
        by_path = dict(leaves)
        self._check_device_and_dtype(by_path)
        reason = self._admission(by_path)
        if reason is not None:
            return None, by_path, reason
        if self.options.state_rule:
            for r in self.adapter.regions:
                if r.input in by_path and r.fixed_address:
                    by_path[r.input] = self._absorb(r, by_path[r.input])
        key = self._signature(by_path, spec)
        if key in self._rejected:
            return None, by_path, self._rejected[key]
        entry = self.classes.get(key)
        if entry is None:
            named = pytree.tree_unflatten([by_path[p] for p, _ in leaves], spec)
            entry = self._compile_class(key, named)
            if entry is None:
                return None, by_path, self._rejected[key]
        return entry, by_path, None

    def prepare(self, *args, **kwargs) -> bool:
        """Trace and capture the class of this call before traffic arrives, leaving every carry,
        buffer, argument and generator as it was. Returns whether the class is compiled."""
        snapshot = TensorSnapshot([c.tensor for c in self.carries.values()]
                                  + list(self._private.values()))
        rng, counters = RngSnapshot(), copy.deepcopy(self.counters)
        entry = None
        try:
            entry, by_path, _ = self._select(args, kwargs)
            if entry is not None:
                written = TensorSnapshot(
                    [v for v in by_path.values() if isinstance(v, torch.Tensor)]
                    + [c.tensor for c in self.carries.values()] + list(self._private.values()))
                try:
                    self._run(entry, by_path)
                finally:
                    written.restore()
        finally:
            snapshot.restore()
            rng.restore()
            for f in dataclasses.fields(counters):  # preparing is not traffic: counters stay put
                setattr(self.counters, f.name, getattr(counters, f.name))
        return entry is not None

    def capture_catalog(self, *args, **kwargs) -> Dict[Tuple, bool]:
        """Compile every class of the catalog before the first chunk, from one example call.

        The example's region inputs are re-cut to each class's extents (views of the carry) and
        its call input -- with every other tensor argument that shares the call width along
        ``call_dim`` -- is re-made at each declared call width (contiguous, zero-filled). State,
        generators and counters are left as they were. Call it under the same modes as the
        traffic (``inference_mode``/``no_grad``, autocast): they are part of every signature.
        Returns ``{(extents, width): compiled}``.
        """
        named = bind_arguments(self._arguments, args, kwargs)
        by_path = dict(leaves_with_paths(named)[0])
        ad = self.adapter
        x = by_path.get(ad.call_input) if ad.call_input else None
        width = x.shape[ad.call_dim] if isinstance(x, torch.Tensor) else None
        done = {}
        for extents, w in self.catalog.classes:
            synth = dict(by_path)
            for r, e in zip(ad.regions, extents):
                t = by_path.get(r.input)
                if isinstance(t, torch.Tensor):
                    size = list(t.shape)
                    size[r.dim] = e
                    synth[r.input] = torch.zeros(size, dtype=t.dtype, device=t.device)
            if width is not None:
                for path, t in by_path.items():
                    if (isinstance(t, torch.Tensor) and path not in {r.input for r in ad.regions}
                            and t.dim() > (ad.call_dim % t.dim()) and t.shape[ad.call_dim] == width):
                        size = list(t.shape)
                        size[ad.call_dim] = w
                        synth[path] = torch.zeros(size, dtype=t.dtype, device=t.device)
            done[(extents, w)] = self.prepare(**_replace_leaves(named, synth))
        return done

    def _admission(self, by_path) -> Optional[str]:
        if self._excluded:
            return self._excluded
        extents = []
        for r in self.adapter.regions:
            t = by_path.get(r.input)
            if not isinstance(t, torch.Tensor):
                return f"region {r.name!r} has no input state (priming pass): eager by construction"
            self._check_declared_shape(r, t)
            e = t.shape[r.dim]
            if e not in self._extents[r.name]:
                return (f"region {r.name!r} extent {e} is not in the catalog "
                        f"{sorted(self._extents[r.name])} derived from its retention clocks")
            extents.append(e)
        if tuple(extents) not in self._classes_ok:
            return f"region extents {tuple(extents)} never occur together in the catalog"
        if self.adapter.call_input is not None:
            x = by_path.get(self.adapter.call_input)
            if not isinstance(x, torch.Tensor):
                return f"call input {self.adapter.call_input!r} is missing"
            w = x.shape[self.adapter.call_dim]
            if not self.adapter.admits(w):
                bound = (f"admission {self.adapter.admission} = "
                         f"{self.adapter.clocks[self.adapter.admission]}" if self.adapter.admission
                         else "no admission clock")
                return (f"call width {w} is neither a declared call width "
                        f"{list(self.adapter.call_widths())} nor admitted ({bound})")
        return None

    def _check_device_and_dtype(self, by_path) -> None:
        """Region state and the call input must sit where the step's weights are. Floating region
        state whose element width contradicts both the region's declared ``element_bytes`` and the
        dtype every floating weight has is refused too (a float64 cache for float32 weights):
        a carry could never hold it, and the stock step would fail deep inside."""
        device, dtype = self._weights_device, self._weights_dtype
        for what, path, width in self._placement_checked:
            t = by_path.get(path)
            if not isinstance(t, torch.Tensor):
                continue
            if device is not None and t.device != device:
                raise ContractError(
                    f"{what} {path!r} is on {t.device}, but the step's weights are on "
                    f"{device}; move it with .to({str(device)!r})")
            if (width is not None and dtype is not None and t.dtype != dtype
                    and t.is_floating_point() and t.element_size() != width):
                raise ContractError(
                    f"{what} {path!r} is {t.dtype} ({t.element_size()}-byte elements), but the "
                    f"region declares element_bytes={width} and the step's weights are {dtype}; "
                    f"cast it with .to({dtype})")

    def _check_declared_shape(self, r, t: torch.Tensor) -> None:
        """The state must have the declared shape outside the frame dim. Stock code may reserve
        more rows than it ever writes (Token2Wav's 16 solver-step slots for 10 steps): larger dims
        are accepted when the rows beyond the declaration hold zeros; absorption drops them."""
        carry = self.carries.get(r.name)
        if not r.shape or (carry is not None and carry.holds(t)):
            return
        want = self._declared[r.name]
        got = list(t.shape)
        bad = len(got) != len(want) or any(w is not None and w > g for w, g in zip(want, got))
        if not bad:
            for i, (w, g) in enumerate(zip(want, got)):
                if w is not None and g > w and t.narrow(i, w, g - w).any():
                    bad = True
        if bad:
            raise ContractError(
                f"region {r.name!r} of adapter {self.adapter.name!r} declares shape "
                f"{tuple('frames' if w is None else w for w in want)} but the step received "
                f"{tuple(got)} at {r.input!r}; fix the region's shape clocks")

    def _absorb(self, r, t: torch.Tensor) -> torch.Tensor:
        carry = self.carries.get(r.name)
        if carry is None:
            shape = [self.adapter.dim_size(d, r) for d in r.shape] if r.shape else list(t.shape)
            shape[r.dim] = self.catalog.region(r.name).declared_extent
            with torch.no_grad():
                carry = Carry(r, torch.zeros(shape, dtype=t.dtype, device=t.device))
            self.carries[r.name] = carry
        frames = t.shape[r.dim]
        if carry.holds(t):
            return carry.view(frames)
        if t.device != carry.tensor.device or t.dtype != carry.tensor.dtype:
            raise ContractError(f"region {r.name!r}: state arrived as {t.dtype} on {t.device}, but "
                                f"its carry is {carry.tensor.dtype} on {carry.tensor.device}")
        src = t
        for i, size in enumerate(carry.tensor.shape):
            if i != r.dim and src.shape[i] > size:  # undeclared rows, checked to be zero
                src = src.narrow(i, 0, size)
        with torch.no_grad():
            if src.untyped_storage().data_ptr() == carry.tensor.untyped_storage().data_ptr():
                src = src.clone()
            carry.view(frames).copy_(src)
        self.counters.absorptions += 1
        return carry.view(frames)

    def _signature(self, by_path, spec) -> Tuple:
        """Class key (extents, width), then every leaf's signature and the global modes."""
        extents = tuple(by_path[r.input].shape[r.dim] for r in self.adapter.regions)
        width = None
        if self.adapter.call_input is not None:
            width = by_path[self.adapter.call_input].shape[self.adapter.call_dim]
        parts = tuple((path, tensor_signature(v) if isinstance(v, torch.Tensor) else repr(v))
                      for path, v in by_path.items())
        return ((extents, width), parts, global_signature(), str(spec))

    def _input(self, spec: InputSpec, by_path):
        if spec.kind == "param":
            return self._params[spec.name]
        if spec.kind == "buffer":
            return self._private.get(spec.name, self._buffers[spec.name])
        if spec.kind == "carry":
            return self.carries[spec.name].tensor
        return by_path[spec.name]

    def _run(self, entry: ClassEntry, by_path):
        flat = [self._input(spec, by_path) for spec in entry.inputs]
        with torch.no_grad():
            outs = entry.gm(*flat)
        t = entry.traced
        leaves: List[Any] = [None] * len(t.out_paths)
        for i, v in t.out_constants.items():
            leaves[i] = v
        for i, v in zip(t.out_tensor_index, outs):
            leaves[i] = v
        for name, idx in entry.out_regions.items():
            self.counters.addresses[name].add(outs[idx].data_ptr())
        self.counters.compiled_calls += 1
        self.counters.applications += entry.writes
        self.counters.retentions += entry.retentions
        return pytree.tree_unflatten(leaves, t.out_spec)

    def _eager(self, reason: str, args, kwargs):
        if self.strict:
            raise GuardError(f"strict mode: {reason}")
        self.counters.fallback(reason)
        # The stock step writes into its envelopes and may hand out views of them: they get
        # their storage back for good.
        self._restore_envelopes(keep=True)
        # The stock step writes the module's own buffers where compiled calls write private
        # copies: hand it the latest values, and take its writes back, so the two stay one buffer.
        with torch.no_grad():
            for name, private in self._private.items():
                self._buffers[name].copy_(private)
        result = self.step(*args, **kwargs)
        with torch.no_grad():
            for name, private in self._private.items():
                private.copy_(self._buffers[name])
        return result

    # -- compiling one class ----------------------------------------------------------------
    def _compile_class(self, key, named) -> Optional[ClassEntry]:
        """Trace (or reuse a trace), probe, rewrite. Released envelopes get their storage back
        for the whole of it -- the probe runs stock code and the carry pass reads the buffers it
        replaces -- and are released again afterwards, with any this class newly replaced."""
        released = set(self._released)
        self._restore_envelopes(keep=False)
        replaced: set = set()
        try:
            return self._compile_class_body(key, named, replaced)
        finally:
            self._release(sorted(released | replaced))

    def _compile_class_body(self, key, named, replaced: set) -> Optional[ClassEntry]:
        # stock code may register buffers lazily, after ``compile`` (Mimi's codebook cache)
        self._params.update(self.module.named_parameters())
        self._buffers.update(self.module.named_buffers())
        cache_key = (id(self.module), getattr(self._fn, "__func__", self._fn), key)
        cached = None if self.trace_cache is None else self.trace_cache.get(cache_key)
        if cached is not None:
            traced = _copy_traced(cached)
        else:
            rng = RngSnapshot()  # tracing runs the step's Python code: keep its draws invisible
            try:
                traced = trace_step(self.module, self._fn, named, tracing_mode=self.tracing_mode,
                                    repeated=self._repeated)
            except TraceError as e:
                if self.strict:
                    raise
                log.warning("class %s runs the stock step: %s", key[0], e)
                self._rejected[key] = f"could not be traced: {e}"
                return None
            finally:
                rng.restore()
            self.counters.traces += 1
            self.counters.copied_calls += traced.copied_calls
            for method, why in traced.refused.items():
                log.info("class %s: %s traced at every call: %s", key[0], method, why)
            if self.trace_cache is not None:
                self.trace_cache[cache_key] = _copy_traced(traced)
        probe_start = time.perf_counter()
        reason = self._probe_effects(traced, named)
        probe_s = time.perf_counter() - probe_start
        if reason is not None:
            log.warning("class %s rejected: %s", key[0], reason)
            self._rejected[key] = reason
            return None
        if self.backend is None:
            self.backend = self._choose_backend(named)
        gm = traced.gm
        inputs = list(traced.inputs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out_pos = {p: k for k, p in enumerate(traced.out_paths[i] for i in traced.out_tensor_index)}
        bindings = []
        for r in self.adapter.regions:
            ph = next((n for n, s in zip(placeholders, inputs) if s.kind == "arg" and s.name == r.input), None)
            if r.output not in out_pos and r.fixed_address:
                raise ContractError(f"region {r.name!r}: output path {r.output!r} is not a tensor "
                                    f"result of the step (results: {traced.out_paths}); fix `output`")
            if r.fixed_address and self.options.state_rule:
                bindings.append(RegionBinding(r, ph, out_pos.get(r.output), self.carries[r.name]))
        written_before = {spec.name for spec in _written_inputs(gm, inputs) if spec.kind == "buffer"}
        ctx = PassContext(adapter=self.adapter, class_key=key[0], inputs=inputs, regions=bindings,
                          module_buffers=self._buffers, verify=self.verify, auditor=self.auditor,
                          backend=self.backend, counters=self.counters, strict=self.strict,
                          constant_ids=self._constant_ids,
                          alias_state=self.options.alias_state and not self.options.state_rule)
        ctx.records["probe_s"] = probe_s
        try:
            gm = run_pipeline(gm, ctx, self._pipeline)
        except PassFailed as e:
            if self.strict:
                raise
            log.warning("class %s runs the stock step: %s", key[0], e)
            self._rejected[key] = str(e)
            return None
        # Buffers the rewritten step still writes get a private copy: the user's module is never
        # written by the compiled path (envelopes replaced by carries are gone by now).
        if self.release_envelopes:
            replaced |= written_before - {spec.name for spec in ctx.inputs if spec.kind == "buffer"}
        unsplit = ctx.records.get("graph", gm)
        for spec in _written_inputs(unsplit, ctx.inputs):
            if spec.kind == "buffer" and spec.name not in self._private:
                self._private[spec.name] = self._buffers[spec.name].detach().clone()
        # eq. (6), this class: with the regions aliased, only the other tensor arguments are staged
        ctx.records["staging_predicted"] = sum(
            n.meta["val"].numel() * n.meta["val"].element_size()
            for n, spec in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ctx.inputs)
            if spec.kind == "arg" and isinstance(n.meta.get("val"), torch.Tensor))
        writes = [w for w in ctx.records["rewrites"] if w["kind"] in ("retention", "append", "materialize")]
        entry = ClassEntry(
            key=key, gm=gm, inputs=ctx.inputs, traced=traced, records=ctx.records,
            out_regions={b.region.name: b.out_index for b in bindings if b.out_index is not None},
            writes=len(writes), retentions=sum(w["kind"] == "retention" for w in writes))
        self.classes[key] = entry
        log.info("class %s compiled: %d nodes traced in %.2fs", key[0], len(traced.gm.graph.nodes),
                 traced.seconds)
        return entry

    def _probe_effects(self, traced: TracedStep, named) -> Optional[str]:
        """The probationary eager call (§3.4 (iii)): run the stock step once, watching every
        generator, then put back generators and everything the step writes."""
        leaves = dict(leaves_with_paths(named)[0])
        written = [self._buffers[s.name] if s.kind == "buffer" else leaves[s.name]
                   for s in _written_inputs(traced.gm, traced.inputs) if s.kind in ("buffer", "arg")]
        written += [c.tensor for c in self.carries.values()]
        written += mutated_attributes(traced.gm)  # module state in plain tensor attributes
        state, rng = TensorSnapshot(written), RngSnapshot()
        try:
            with torch.no_grad():
                self._fn(**named)
        finally:
            effects = rng.effects()
            state.restore()
            rng.restore()
        return effects.host_reason

    # -- envelopes replaced by carries ---------------------------------------------------
    def _release(self, names) -> None:
        """Free the storage of stock envelope buffers the compiled path no longer touches
        (``release_envelopes=True``). The tensors keep their shape, so later classes still trace;
        any stock code reading them before ``_restore_envelopes`` fails loudly."""
        shared = collections.Counter(t.untyped_storage().data_ptr() for t in
                                     [*self._params.values(), *self._buffers.values()]
                                     if t.untyped_storage().nbytes())
        for name in names:
            buf = self._buffers[name]
            storage = buf.untyped_storage()
            whole = (buf.storage_offset() == 0 and shared[storage.data_ptr()] == 1
                     and storage.nbytes() == buf.numel() * buf.element_size())
            if not whole:   # a view, or storage other tensors use: freeing it would free them
                log.info("stock envelope %s shares its storage; it is kept", name)
                continue
            if storage.nbytes() and name not in self._released:
                self._released[name] = storage.nbytes()
                storage.resize_(0)
                log.debug("released stock envelope %s (%d bytes)", name, self._released[name])
        self.counters.released_bytes = sum(self._released.values())

    def _restore_envelopes(self, keep: bool) -> None:
        """Give released envelopes their storage back, zero-filled as the stock module starts
        them (the stock step overwrites the rows it returns before reading them)."""
        for name, nbytes in list(self._released.items()):
            buf = self._buffers[name]
            buf.untyped_storage().resize_(nbytes)
            with torch.no_grad():
                buf.untyped_storage().fill_(0)
            del self._released[name]
            if keep:
                self.counters.restored_bytes += nbytes
        self.counters.released_bytes = sum(self._released.values())

    def _choose_backend(self, named):
        on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda
                      for _, v in leaves_with_paths(named)[0])
        on_cuda = on_cuda or any(p.is_cuda for p in self._params.values())
        if self.graphs and on_cuda:
            from .cudagraphs import CudaGraphBackend
            return CudaGraphBackend(copy_outputs=self.copy_outputs)
        return EagerBackend()

    def close(self) -> None:
        """Drop every compiled class and its device graphs and give the module back its released
        envelopes (zero-filled); the step can still be called afterwards and recompiles."""
        self._restore_envelopes(keep=False)
        self.classes.clear()
        self._rejected.clear()
        self.backend = None

    # -- inspection -------------------------------------------------------------------------
    def report(self):
        from .report import Report
        return Report(self)

    def _repr_html_(self):
        return self.report()._repr_html_()

    def __repr__(self):
        return (f"CompiledStep(adapter={self.adapter.name!r}, classes={len(self.classes)}, "
                f"counters={self.counters.as_dict()})")


def _repeated_targets(adapter: Adapter, module: torch.nn.Module) -> List[Tuple[torch.nn.Module, str]]:
    """The ``(submodule, method)`` pairs an adapter's ``repeated`` declarations name."""
    targets = []
    for decl in adapter.repeated:
        owner, _, method = decl.rpartition(".")
        found = [sub for path, sub in module.named_modules() if path.rsplit(".", 1)[-1] == owner]
        if not found:
            raise ContractError(f"adapter {adapter.name!r}: repeated call {decl!r} names no "
                                f"submodule called {owner!r} in {type(module).__name__}; fix "
                                f"`repeated` or leave it out")
        for sub in found:
            if not callable(getattr(sub, method, None)):
                raise ContractError(f"adapter {adapter.name!r}: repeated call {decl!r}: "
                                    f"{type(sub).__name__} has no method {method!r}; fix `repeated`")
            targets.append((sub, method))
    return targets


def _copy_traced(traced: TracedStep) -> TracedStep:
    """A traced step the passes may rewrite without touching ``traced``: a fresh graph (nodes
    and their meta dicts copied; fake values and module attributes shared, never mutated)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(traced.gm.graph, {})
    graph.output(out)
    gm = graph_module(traced.gm, graph)
    return dataclasses.replace(traced, gm=gm, inputs=list(traced.inputs), seconds=0.0)


def _replace_leaves(named, by_path):
    leaves, spec = leaves_with_paths(named)
    return pytree.tree_unflatten([by_path.get(p, v) for p, v in leaves], spec)


def _written_inputs(gm: torch.fx.GraphModule, inputs: List[InputSpec]) -> List[InputSpec]:
    """The inputs (by spec) whose storage the graph writes in place."""
    written = set(written_bases(gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [spec for n, spec in zip(placeholders, inputs) if n in written]


def compile(step: Union[torch.nn.Module, Callable], adapter: Union[Adapter, str], *,
            module: Optional[torch.nn.Module] = None, verify: bool = False, strict: bool = False,
            graphs: Optional[bool] = None, state_rule: bool = True, constants: bool = True,
            backend=None, tracing_mode: str = "fake",
            carries: Optional[Dict[str, Carry]] = None, copy_outputs: bool = True,
            options: Optional[Options] = None, release_envelopes: bool = False,
            trace_cache: Optional[dict] = None) -> CompiledStep:
    """Compile a streaming step against an adapter.

    ``step`` is a module (its ``forward`` is the step) or a callable; a plain callable names the
    module holding its weights with ``module=`` (a bound method's module is found by itself).
    ``verify`` turns on the shadow auditor; ``strict`` raises instead of falling back to eager;
    ``state_rule``/``constants`` switch passes off; ``graphs=False`` (or the environment variable
    ``CADENCE_FX_DISABLE_GRAPHS=1``) keeps every piece on the guarded eager path. ``carries``
    shares the carry store of another compiled step of the same stream. ``copy_outputs=False``
    hands out replayed results in place (overwritten by the next replay) instead of cloning them.
    ``options`` (a ``pipeline.Options``) replaces ``state_rule``/``constants`` for ablations.
    ``release_envelopes=True`` frees the storage of the module's stock envelope buffers once the
    carries have replaced them (the memory the state rule saves); it comes back, zero-filled,
    whenever the stock step has to run (a fallback, the probationary call).
    ``trace_cache``, a dict shared between compiled steps of the same module and step function,
    lets a later step reuse the traces of an earlier one (each gets its own copy to rewrite).
    Share it only between steps whose Python behaviour is the same: a trace bakes in every host
    value the step reads.
    """
    if tracing_mode != "fake":
        raise ValueError(f"tracing_mode {tracing_mode!r}: cadence_fx traces exact shapes with fake "
                         "tensors, one graph per catalog signature (a 'real' trace would run the "
                         "step and write the user's module); use 'fake'")
    if isinstance(adapter, str):
        from cadence_fx import adapters
        adapter = adapters.get(adapter)
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an Adapter or a registered name, got {type(adapter).__name__}")
    if module is None:
        module = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError("cannot tell which module holds the step's weights; pass module=")
    if graphs is None:
        graphs = os.environ.get("CADENCE_FX_DISABLE_GRAPHS", "0") in ("", "0")
    if options is None:
        options = Options(constants=constants, state_rule=state_rule)
    return CompiledStep(step, adapter, module, verify=verify, strict=strict, options=options,
                        backend=backend, tracing_mode=tracing_mode, carries=carries,
                        graphs=graphs, copy_outputs=copy_outputs,
                        release_envelopes=release_envelopes, trace_cache=trace_cache)
