"""The compiled step: what happens on one call, in the order it happens.

1. Admission (``admission.py``): region extents in the catalog, call width admitted; otherwise the
   stock step runs, with the reason recorded (raised in strict mode).
2. Absorption: region inputs are made to *be* views of their carries (a foreign tensor -- the first
   call, a turn reset restoring the prompt state -- is copied in once; the caller's tensor is never
   written, which is what makes prompt state copy-on-write).
3. Signature: the class key and the full signature of the call.
4. On a class's first call, the class compiler (``class_compiler.py``) traces, probes and rewrites.
5. Run: the rewritten graph's pieces replay or run guarded; region results come back as views of
   the carries, so their address never changes.

Envelope memory lives in ``envelopes.py``, ahead-of-traffic preparation in ``prepare.py``, what
the step knows of each class in ``class_store.py``, its options in ``config.py`` (one frozen
``CompileConfig``) and the module's tensors as it reads them in ``module_tensors.py``.
"""
from __future__ import annotations

import inspect
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.utils._pytree as pytree

from . import layouts
from . import prepare as _prepare
from . import priming as _priming
from .admission import Admission, check_envelopes, check_paths
from .audit import Auditor
from .catalog import Catalog, build_catalog
from .class_compiler import ClassEntry, compile_class, method_targets
from .class_store import ClassStore
from .compile_cache import CompileCache
from .config import CompileConfig
from .passes.context import Carry
from .contract import Adapter
from .counters import Counters
from .cudagraphs import GLOBAL_STATE
from .envelopes import Envelopes
from .errors import GuardError
from .module_tensors import ModuleTensors
from .passes.pipeline import Options, build_pipeline
from .region_kernels import KernelStore
from .signature import global_signature, tensor_signature
from .tracing import InputSpec, bind_arguments, leaves_with_paths

__all__ = ["compile", "CompiledStep"]

log = logging.getLogger(__name__)


class CompiledStep:
    """What ``cadence_fx.compile`` returns: call it like the stock step.

    ``config`` is what it was asked for (``config.CompileConfig``); ``store`` what it knows of
    each class (``class_store.ClassStore``); ``tensors`` the module's tensors as it reads them
    (``module_tensors.ModuleTensors``). ``carries``, ``trace_cache`` and ``envelopes``, given,
    are shared with another compiled step (a stream's other step, a lane); ``class_cache``, with
    a lane of the same step (``ClassStore.share_classes``)."""

    def __init__(self, step: Callable, adapter: Adapter, module: torch.nn.Module,
                 config: CompileConfig = CompileConfig(), *, backend=None,
                 carries: Optional[Dict[str, Carry]] = None, trace_cache: Optional[dict] = None,
                 envelopes: Optional[Envelopes] = None, class_cache: Optional[dict] = None):
        self.step = step
        self.adapter = adapter.validate()
        self.catalog: Catalog = build_catalog(adapter)
        self.module = module
        self.config = config
        self.backend = backend            # chosen at the first class when None
        self.generator = None             # a lane's own device generator state (lanes.py)
        self.counters = Counters()
        self.auditor = Auditor()
        self.carries: Dict[str, Carry] = {} if carries is None else carries  # may be shared
        self.fn = step.forward if isinstance(step, torch.nn.Module) else step
        self.store = ClassStore(module, self.fn, trace_cache=trace_cache,
                                keep_before=config.keep_before, class_cache=class_cache)
        self.tensors = ModuleTensors(module, adapter.constants)
        self.admission = Admission(adapter, self.catalog, self.tensors.params, strict=config.strict)
        self.pipeline = build_pipeline(config.options)
        self.compile_cache = None if config.cache_dir is None else CompileCache(config.cache_dir, self)
        # fused regions' compiled code and verdicts, shared by every step under one directory
        self.kernel_store = None if config.cache_dir is None else KernelStore.at(config.cache_dir)
        self.arguments = inspect.signature(self.fn)  # bound on every call: inspect it once
        check_paths(self.adapter, self.arguments)
        # (a dynamo graph's step registers lifted buffers under its own names: it lists the
        # module's names too)
        check_envelopes(self.adapter, [*self.tensors.buffers,
                                       *getattr(module, "stock_buffer_names", ())])
        self.repeated = method_targets(adapter, module) if config.options.repeated else []
        if envelopes is not None:   # another step's (a lane's first step), guarded there
            self.envelopes = envelopes
        else:
            self.envelopes = Envelopes(self.tensors.params, self.tensors.buffers, self.counters)
            if config.release_envelopes:   # stock methods that read released envelopes
                self.envelopes.guard(module, adapter, method_targets(adapter, module, "priming"))
        # one call at a time: a priming class compiling in the background holds it too
        self.lock = threading.RLock()
        self.background = _priming.Background(self)
        # stock results copied before another stock call can overwrite them (set by a pool)
        self.keep_stock_results = False

    @property
    def classes(self):
        """The compiled classes, ``{class key: ClassEntry}`` (``store.entries``)."""
        return self.store.entries

    @property
    def before(self):
        """Each class's graph as traced, before the passes, when kept (``store.before``)."""
        return self.store.before

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        with self.lock:
            self.counters.calls += 1
            self.auditor.call_index = self.counters.calls
            entry, by_path, reason = self.select(args, kwargs)
            if reason is not None:   # (an entry with a reason: this call's state, not the class)
                # the module itself runs and writes its own buffers, which every lane shares:
                # alone in the process (``cudagraphs.GLOBAL_STATE``), and what it returns is
                # copied while so when a pool keeps it (``keep_stock_results``)
                with GLOBAL_STATE.exclusive():
                    result = self._eager(reason, args, kwargs,
                                         priming=_priming.is_priming(self, by_path))
                    if self.keep_stock_results:
                        result = pytree.tree_map(
                            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, result)
                    return result
            return self.run(entry, by_path)

    def select(self, args, kwargs, donate: Optional[bool] = None):
        """The call's first half: admission, absorption into the carries, and the class entry
        (traced on first sight). Returns ``(entry, by_path, reason)``: with a reason, the call
        runs stock; the entry is still given when only this call's state keeps it from running
        (its layout). ``donate`` (default ``config.donate_state``): whether a first state may
        become its carry (``prepare`` passes False: an example is not the stream's state)."""
        donate = self.config.donate_state if donate is None else donate
        leaves, spec = leaves_with_paths(bind_arguments(self.arguments, args, kwargs))
        by_path = dict(leaves)
        self.admission.check_placement(by_path)
        reason = self.admission.reason(by_path, self.carries)
        if reason is not None:
            return None, by_path, reason
        arrived, saved = self._absorb(by_path, donate)
        entry, reason = self._entry(by_path, leaves, spec, arrived)
        if reason is not None:   # stock reads what the caller passed, the carry's old values
            with torch.no_grad():
                for t, values in saved:
                    t.copy_(values)
        return entry, by_path, reason

    def _entry(self, by_path, leaves, spec, arrived):
        """The class entry (traced on first sight) and why this call cannot run it, if so."""
        key = self._signature(by_path, spec)
        verdict = self.store.verdict(key)
        if verdict is not None:
            return None, verdict
        entry = self.store.entry(key)
        if entry is None:
            named = pytree.tree_unflatten([by_path[p] for p, _ in leaves], spec)
            reason = self.background.reason(key, named)   # a priming class not compiled yet
            if reason is not None:
                return None, reason
            known = layouts.known_reads(e.records for e in self.store.entries.values())
            reason = self._arrival_reason(known, arrived)   # not compiled only to run stock
            if reason is not None:
                return None, reason
            with GLOBAL_STATE.exclusive():   # tracing swaps fakes into the module: alone
                entry = compile_class(self, key, named)
            if entry is None:
                return None, self.store.verdict(key)
        reads = entry.layout_reads
        if reads is None:   # not compiled by the carry pass: any read may depend on the layout
            reads = {name: "ops not analysed" for name in arrived}
        return entry, self._arrival_reason(reads, arrived)

    def _absorb(self, by_path, donate: bool):
        """Region inputs made views of their carries (``Admission.absorb``). Returns the states
        that arrived as other tensors, by region (for the layout check), and ``(state, values)``
        for each that lives in its carry's storage (a transposed view of it), which absorbing
        overwrites: a call that then runs stock puts the values back first."""
        arrived, saved = {}, []
        if not self.config.options.state_rule:
            return arrived, saved
        for r in self.adapter.regions:
            t = by_path.get(r.input)
            if isinstance(t, torch.Tensor) and r.fixed_address:
                carry = self.carries.get(r.name)
                if carry is None or not carry.holds(t):
                    arrived[r.name] = t
                if carry is not None and not carry.holds(t) and (
                        t.untyped_storage().data_ptr() == carry.tensor.untyped_storage().data_ptr()):
                    saved.append((t, t.clone()))
                by_path[r.input] = self.admission.absorb(r, t, self.carries, self.counters,
                                                         adopt=donate)
        return arrived, saved

    def _arrival_reason(self, reads: Dict[str, str], arrived) -> Optional[str]:
        """A state that arrived in another layout than its carry, read by an op whose bits
        depend on the layout (``reads``: region -> op), runs the stock step: the class reads the
        carry's layout (``layouts.py``)."""
        for name, t in arrived.items():
            if name in self.carries:
                view = self.carries[name].view(t.shape[self.carries[name].dim])
                reason = layouts.arrival_reason(name, t, view, reads)
                if reason is not None:
                    return reason
        return None

    def _signature(self, by_path, spec) -> Tuple:
        """Class key (extents, width), then every leaf's signature and the global modes."""
        extents = tuple(by_path[r.input].shape[r.dim] if isinstance(by_path.get(r.input), torch.Tensor)
                        else None for r in self.adapter.regions)   # all None: the priming pass
        width = None
        if self.adapter.call_input is not None:
            width = by_path[self.adapter.call_input].shape[self.adapter.call_dim]
        parts = tuple((path, tensor_signature(v) if isinstance(v, torch.Tensor) else repr(v))
                      for path, v in by_path.items())
        return ((extents, width), parts, global_signature(), str(spec))

    def _input(self, spec: InputSpec, by_path):
        if spec.kind == "param":
            return self.tensors.params[spec.name]
        if spec.kind == "buffer":
            return self.tensors.buffer(spec.name)
        if spec.kind == "carry":
            return self.carries[spec.name].tensor
        return by_path[spec.name]

    def run(self, entry: ClassEntry, by_path):
        """The call's second half: the class entry run on the call's inputs (``select``)."""
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
            carry = self.carries.get(name)
            if carry is None or not carry.holds(outs[idx]):
                continue   # handed back as stock computed it (a layout or shape near miss)
            self.counters.addresses[name].add(outs[idx].data_ptr())
            leaves[t.out_tensor_index[idx]] = carry.hand_out(outs[idx])
        self.counters.compiled_calls += 1
        self.counters.applications += entry.writes
        self.counters.retentions += entry.retentions
        self.counters.materializations += entry.materializations
        return pytree.tree_unflatten(leaves, t.out_spec)

    def _eager(self, reason: str, args, kwargs, priming: bool = False):
        if self.config.strict:
            raise GuardError(f"strict mode: {reason}")
        self.counters.fallback(reason)
        # The stock step writes into its envelopes and may hand out views of them: they get
        # their storage back for good -- except for a priming pass through the adapter's
        # declared priming methods, which borrow them for the call (``Envelopes.guard``).
        if not (priming and self.adapter.priming):
            self.envelopes.restore(keep=True)
        # The stock step writes the module's own buffers where compiled calls write private
        # copies: hand it the latest values, and take its writes back, so the two stay one buffer.
        with self.tensors.lent_to_stock():
            return self.step(*args, **kwargs)

    # -- ahead of traffic --------------------------------------------------------------------
    def prepare(self, *args, **kwargs) -> bool:
        """Trace and capture the class of this call before traffic arrives, leaving every carry,
        buffer, argument and generator as it was. Returns whether the class is compiled."""
        with self.lock:
            return _prepare.prepare(self, args, kwargs)

    def wait_background(self, timeout: Optional[float] = None) -> bool:
        """Wait for the priming classes compiling in the background; whether none is left."""
        return self.background.wait(timeout)

    def capture_catalog(self, *args, priming_example=None, **kwargs) -> "_prepare.Preparation":
        """Compile every class of the catalog before the first chunk, from one example call.

        The example's region inputs are re-cut to each class's extents (views of the carry) and
        its call input -- with every other tensor argument that shares the call width along
        ``call_dim`` -- is re-made at each declared call width (contiguous, zero-filled). State,
        generators and counters are left as they were. Call it under the same modes as the
        traffic (``inference_mode``/``no_grad``, autocast): they are part of every signature.
        Returns a ``prepare.Preparation``: ``{(extents, width): compiled}``, with per class how it
        came (traced, loaded from the compile cache, compiled before) and the graphs it captured
        (``rows``), the compile counters it moved (``work``: the step's counters are left as they
        were, preparing is not traffic), and what the adapter admits that one example cannot
        prepare (``not_prepared``: partial flushes, an undeclared priming pass), with how to;
        ``print`` it. The adapter's ``prompt_lengths`` are prepared too, as priming classes: from
        ``priming_example(length) -> (args, kwargs)``, a priming call of that prompt length, when
        given; else the example is re-cut (region state None, the call input at each length).
        """
        with self.lock:
            return _prepare.capture_catalog(self, args, kwargs, priming_example)

    def close(self) -> None:
        """Drop every compiled class and its device graphs and give the module back its released
        envelopes (zero-filled); the step can still be called afterwards and recompiles."""
        self.envelopes.restore(keep=False)
        self.store.clear()
        self.backend = None

    # -- inspection -------------------------------------------------------------------------
    def report(self, show: Optional[bool] = None):
        """What the step compiled: catalog, memory, counters, rewrites, pieces (``report.py``).
        On a line of its own it shows itself, as text in a script and as HTML in a notebook;
        ``show=True`` always shows it, ``show=False`` never (a REPL echoes its text anyway)."""
        from .report import Report, shown
        return shown(Report(self), sys._getframe(1), show)

    def _repr_html_(self):
        return self.report()._repr_html_()

    def __repr__(self):
        return (f"CompiledStep(adapter={self.adapter.name!r}, classes={len(self.classes)}, "
                f"counters={self.counters.as_dict()})")


def compile(step: Union[torch.nn.Module, Callable], adapter: Union[Adapter, str], *,
            module: Optional[torch.nn.Module] = None, verify: bool = False, strict: bool = False,
            graphs: Optional[bool] = None, state_rule: Optional[bool] = None,
            constants: Optional[bool] = None, fuse: Optional[bool] = None, backend=None,
            tracing_mode: str = "fake",
            carries: Optional[Dict[str, Carry]] = None, copy_outputs: bool = True,
            options: Optional[Options] = None, release_envelopes: bool = False,
            trace_cache: Optional[dict] = None, keep_before: bool = True,
            cache_dir=None, donate_state: bool = False) -> CompiledStep:
    """Compile a streaming step against an adapter.

    ``step`` is a module (its ``forward`` is the step) or a callable; a plain callable names the
    module holding its weights with ``module=`` (a bound method's module is found by itself).
    ``verify`` turns on the shadow auditor; ``strict`` raises instead of falling back to eager;
    ``state_rule``/``constants``/``fuse`` (exact fusion, ``passes/fuse_exact.py``) switch passes
    off; ``graphs=False`` (or the environment variable ``CADENCE_FX_DISABLE_GRAPHS=1``) keeps
    every piece on the guarded eager path. ``carries``
    shares the carry store of another compiled step of the same stream. ``copy_outputs=False``
    hands out replayed results in place (overwritten by the next replay) instead of cloning them.
    ``options`` (a ``pipeline.Options``) switches any pass for ablations; ``state_rule``,
    ``constants`` or ``fuse`` given beside it must agree with it (``ValueError`` otherwise).
    ``release_envelopes=True`` frees the storage of the module's stock envelope buffers once the
    carries have replaced them (the memory the state rule saves); it comes back, zero-filled,
    whenever the stock step has to run (a fallback, the probationary call).
    ``trace_cache``, a dict shared between compiled steps of the same module and step function,
    lets a later step reuse the traces of an earlier one (each gets its own copy to rewrite).
    Share it only between steps whose Python behaviour is the same: a trace bakes in every host
    value the step reads. ``keep_before`` keeps a copy of each class's graph as traced, before the
    passes rewrite it, for the report's before/after view (``report()``); ``False`` skips the copy
    (a graph copy per class at compile time) and the report shows the graph after the passes only.
    ``cache_dir`` (default: ``CADENCE_FX_CACHE_DIR`` when set) keeps each compiled class on disk,
    so a restarted process loads it instead of tracing (``compile_cache.py``; ``cadence-fx cache
    ls|clear``); only the capture runs again (a class stored as its trace runs the passes too).
    ``donate_state=True`` gives the state a stream starts with to the compiled step: a region
    tensor that arrives before its carry exists and already has the carry's layout (the declared
    extent, contiguous, owning its storage) becomes the carry instead of being copied into a new
    one, so the state is held once, not twice (``counters.adoptions``). The caller's tensor is
    written from then on, as the stock step of a model that updates its state in place (Moshi's
    ring caches) writes it; keep a clone of any state to be reused (a speaker's prompt). Without
    it a state passed in is never written.

    The keywords become one frozen ``config.CompileConfig`` (``CompiledStep.config``), checked
    once: a value of the wrong kind is a ``ValueError`` naming the option and the fix.
    """
    config = CompileConfig.of(options, verify=verify, strict=strict, graphs=graphs,
                              state_rule=state_rule, constants=constants, fuse=fuse,
                              tracing_mode=tracing_mode, copy_outputs=copy_outputs,
                              release_envelopes=release_envelopes, keep_before=keep_before,
                              cache_dir=cache_dir, donate_state=donate_state)
    adapter = _adapter(adapter)
    if module is None:
        module = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError("cannot tell which module holds the step's weights; pass module=")
    return CompiledStep(step, adapter, module, config, backend=backend, carries=carries,
                        trace_cache=trace_cache)


def _adapter(adapter: Union[Adapter, str]) -> Adapter:
    """An adapter, or the registered adapter of that name."""
    if isinstance(adapter, str):
        from cadence_fx import adapters
        adapter = adapters.get(adapter)
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an Adapter or a registered name, got {type(adapter).__name__}")
    return adapter
