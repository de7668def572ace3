"""Repeated calls traced once: a method the step calls many times with the same argument shapes
(the CFM estimator, once per Euler step) is traced on its first call of each signature; its later
calls copy those nodes into the graph instead of running the same Python and fake-tensor dispatch
again. Tracing cost is per aten call, so a 10-step solver costs about one step plus the copies.

A copy must be exactly the graph a full trace would have produced, so a copy is made only when the
first call shows that the method is a function of its arguments and the trace's own inputs:

* every tensor the recorded nodes read from outside is an argument of the call or a tensor that
  entered the trace as a placeholder (parameters, buffers, the step's arguments) -- nothing read
  through an attribute the caller may have changed between calls;
* the Python attributes of the method's module tree, its hooks and the host RNGs are the same
  before and after the call, and the attributes are unchanged at every later call;
* no output or written tensor carries a constant value the tracer could fold;
* no argument or trace input changes its shape, strides or offset in place.

Otherwise that signature is traced in full at every call, with the reason logged (``refused``).
What cannot be checked is left to the declaration: Python values the method reads from outside
its module tree (module globals, other objects) must not change between its calls.
Copied nodes get fake values with the first call's geometry and the same storage sharing, rebased
onto the new call's arguments, so the passes' alias analysis sees what a full trace shows.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental import proxy_tensor as pt

from .effects import RngSnapshot
from .signature import global_signature   # grad, inference mode, autocast, deterministic kernels
from .splice_plans import NO_VAL, geometry as _geometry, plans as _plans, storage_key as _skey

__all__ = ["RepeatedCalls"]

log = logging.getLogger(__name__)

_IMMUTABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)

class _Refused(Exception):
    pass


def _module_state(module: torch.nn.Module) -> list:
    """What a module tree's Python behaviour may depend on, compared by identity: per module, its
    attribute names, their values, its parameters and its buffers (tuples built in C: this runs
    at every repeated call, over some 500 modules for the DiT)."""
    out = []
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            raise _Refused(f"{type(m).__name__} has forward hooks (their Python effects would not "
                           f"repeat in a copy)")
        attrs = vars(m)
        out.append((m, tuple(attrs), tuple(attrs.values()), tuple(m._parameters.values()),
                    tuple(m._buffers.values())))
    return out


def _same_state(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        ma is mb and ka == kb and len(va) == len(vb) and all(map(operator.is_, va, vb))
        and len(pa) == len(pb) and all(map(operator.is_, pa, pb))
        and len(ba) == len(bb) and all(map(operator.is_, ba, bb))
        for (ma, ka, va, pa, ba), (mb, kb, vb, pb, bb) in zip(a, b))


class _Record:
    """One signature's first call: the nodes it added and how to rebuild them for a later call."""

    def __init__(self, nodes, ext, mutated, outputs, out_spec, plans, state):
        self.nodes = nodes              # the first call's nodes, in order
        self.ext = ext                  # external node -> ("arg", leaf index) | ("input", tensor)
        self.mutated = mutated          # [(("arg", i) | ("input", t), node in nodes)]
        self.outputs = outputs          # per output leaf: ("node", k) | ("ext", ref) | ("const", v)
        self.out_spec = out_spec
        self.plans = plans              # per node: how to rebuild its fake value
        self.state = state              # the module tree's attributes at the first call


class RepeatedCalls:
    """Patches ``method`` of each ``(module, method)`` target for the duration of one trace."""

    def __init__(self, targets: Sequence[Tuple[torch.nn.Module, str]], placeholders: Callable[[], list]):
        self.targets = list(targets)
        self._placeholders = placeholders   # the trace inputs' fake tensors (once tracing started)
        self.records: Dict[tuple, _Record] = {}
        self.refused: Dict[str, str] = {}
        self.copies = 0
        self.traced = 0
        self._failed: set = set()       # signatures whose calls are traced in full
        self._by_storage = None         # trace input storage -> ids of the inputs on it
        self._saved: List[Tuple[torch.nn.Module, str, Any]] = []

    def __enter__(self):
        for module, name in self.targets:
            orig = getattr(module, name)
            self._saved.append((module, name, module.__dict__.get(name, _MISSING)))
            setattr(module, name, self._wrap(module, name, orig))
        return self

    def __exit__(self, *exc):
        for module, name, before in reversed(self._saved):
            if before is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, before)
        self._saved.clear()

    # -- the patched method ------------------------------------------------------------------
    def _wrap(self, module, name, orig):
        label = f"{type(module).__name__}.{name}"

        def call(*args, **kwargs):
            mode = pt.get_proxy_mode()
            if mode is None:
                return orig(*args, **kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            try:
                key = (id(module), name, spec, _leaf_key(leaves), self._sharing(leaves))
            except _Refused as e:
                self.refused.setdefault(label, str(e))
                return orig(*args, **kwargs)
            rec = self.records.get(key)
            if rec is not None:
                try:
                    out = self._copy(rec, mode.tracer, module, leaves)
                    self.copies += 1
                    return out
                except _Refused as e:
                    self.refused.setdefault(label, str(e))
                    return orig(*args, **kwargs)
            if key in self._failed:
                return orig(*args, **kwargs)
            try:
                state = _module_state(module)
            except _Refused as e:
                self._failed.add(key)
                self.refused.setdefault(label, str(e))
                return orig(*args, **kwargs)
            out, rec = self._record(mode.tracer, module, orig, args, kwargs, leaves, state)
            if isinstance(rec, str):
                self._failed.add(key)
                self.refused.setdefault(label, rec)
                log.info("%s is traced at every call with these arguments: %s", label, rec)
            else:
                self.traced += 1
                self.records[key] = rec
            return out

        return call

    def _sharing(self, leaves) -> tuple:
        """Which trace inputs each tensor argument shares its storage with (part of the key)."""
        if self._by_storage is None:
            self._by_storage = {}
            for t in self._placeholders():
                if isinstance(t, torch.Tensor):
                    self._by_storage.setdefault(_skey(t), set()).add(id(t))
        return tuple(frozenset(self._by_storage.get(_skey(x), ())) if isinstance(x, torch.Tensor)
                     else None for x in leaves)

    # -- the first call ----------------------------------------------------------------------
    def _record(self, tracer, module, orig, args, kwargs, leaves, state):
        """Run the call (traced as usual); return its result and its record, or the reason why
        later calls cannot be copies."""
        rng = RngSnapshot()
        graph = tracer.graph
        last = graph._root.prev
        inputs = [t for t in self._placeholders() if isinstance(t, torch.Tensor)]
        watched = [t for t in leaves if isinstance(t, torch.Tensor)] + inputs
        before = {id(t): (_slot(tracer, t), _geometry(t)) for t in watched}
        out = orig(*args, **kwargs)
        try:
            return out, self._examine(tracer, module, leaves, out, state, rng, last, inputs, before)
        except _Refused as e:
            return out, str(e)
        except Exception as e:  # noqa: BLE001 - tracer internals of another torch: trace in full
            return out, f"could not record the call ({type(e).__name__}: {e})"

    def _examine(self, tracer, module, leaves, out, state, rng, last, inputs, before):
        refuse = _Refused
        graph = tracer.graph
        nodes = []
        n = last.next
        while n is not graph._root:
            nodes.append(n)
            n = n.next
        if not _same_state(state, _module_state(module)) or rng.effects().host:
            raise refuse("the call changed its module's Python attributes or drew host random numbers")
        enters = sum(getattr(n.target, "__name__", "") == "_enter_autocast" for n in nodes)
        exits = sum(getattr(n.target, "__name__", "") == "_exit_autocast" for n in nodes)
        if enters != exits:
            raise refuse("an autocast region opens or closes across the call's boundary")
        ext = _external_reads(nodes, leaves, inputs, before)
        # writes to arguments and trace inputs: which node the tensor's proxy moved to
        inside = set(nodes)
        mutated = []
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                mutated += self._moved(tracer, t, before, inside, ("arg", i), refuse)
        for t in inputs:
            mutated += self._moved(tracer, t, before, inside, ("input", t), refuse)
        out_leaves, out_spec = pytree.tree_flatten(out)
        outputs = _results(tracer, out_leaves, nodes, ext)
        return _Record(nodes, ext, mutated, outputs, out_spec, _plans(nodes, leaves, ext, refuse), state)

    @staticmethod
    def _moved(tracer, t, before, inside, ref, refuse):
        node0, geometry = before[id(t)]
        slot = pt.get_proxy_slot(t, tracer, None)
        node1 = None if slot is None else slot.proxy.node
        if _geometry(t) != geometry:
            raise refuse("the call changed the shape or strides of a tensor in place")
        if node1 is node0:
            return []
        if node1 not in inside:
            raise refuse("a tensor's proxy moved outside the call")
        if slot.constant is not None:
            raise refuse("a written tensor carries a constant value")
        return [(ref, node1)]

    # -- a later call ------------------------------------------------------------------------
    def _copy(self, rec: _Record, tracer, module, leaves):
        if not _same_state(rec.state, _module_state(module)):
            raise _Refused("the module's Python attributes changed since the first call")
        for i in rec.plans.pinned:
            if leaves[i].storage_offset() != rec.plans.arg_offsets[i]:
                raise _Refused(f"argument {i} sits at another storage offset than at the first "
                               f"call, and the call reads its storage {rec.plans.pinned_by}")

        def tensor_of(ref):
            kind, what = ref
            return leaves[what] if kind == "arg" else what

        mapping = {}
        for a, ref in rec.ext.items():
            if ref[0] == "same":
                mapping[a] = a
            else:
                slot = pt.get_proxy_slot(tensor_of(ref), tracer, None)
                if slot is None:
                    raise _Refused("an input of the call is no longer tracked")
                mapping[a] = slot.proxy.node
        try:   # nothing is in the graph yet: a failure here leaves a full trace of this call
            vals = rec.plans.build(leaves)
        except Exception as e:  # noqa: BLE001 - fake tensor internals of another torch
            raise _Refused(f"could not rebuild the copy's fake values ({type(e).__name__}: {e})")
        graph = tracer.graph
        made = []
        for k, n in enumerate(rec.nodes):
            if n.op == "get_attr":
                mapping[n] = n      # a full trace reuses the constant's node as well
                made.append(n)
                continue
            new = graph.node_copy(n, lambda m: mapping[m])
            if vals[k] is not NO_VAL:
                new.meta["val"] = vals[k]
            mapping[n] = new
            made.append(new)
        for ref, node in rec.mutated:
            pt.track_tensor_tree(tensor_of(ref), torch.fx.Proxy(mapping[node], tracer),
                                 constant=None, tracer=tracer)
        out = []
        for kind, what in rec.outputs:
            if kind == "node":
                v = vals[what]
                pt.track_tensor_tree(v, torch.fx.Proxy(made[what], tracer), constant=None,
                                     tracer=tracer)
                out.append(v)
            elif kind == "ext":
                out.append(tensor_of(what))
            else:
                out.append(what)
        return pytree.tree_unflatten(out, rec.out_spec)


_MISSING = object()


def _slot(tracer, t):
    slot = pt.get_proxy_slot(t, tracer, None)
    return None if slot is None else slot.proxy.node


def _leaf_key(leaves) -> tuple:
    """What a copy depends on: tensor geometry (not the offset: views are rebased), the storage
    sharing between arguments, and the value of every other argument."""
    key, first = [], {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            s = _skey(x)
            j = first.setdefault(s, i)
            key.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad, j,
                        x.storage_offset() - leaves[j].storage_offset()))
        elif isinstance(x, _IMMUTABLE):
            key.append((type(x), x))
        else:
            raise _Refused(f"argument {i} of type {type(x).__name__} is not a tensor or a constant")
    return tuple(key) + global_signature()


def _external_reads(nodes, leaves, inputs, before) -> dict:
    """Which tensor each node outside the call that it reads stands for: ``("arg", i)``,
    ``("input", t)`` (a trace input) or ``("same", node)`` (an attribute); refused otherwise."""
    inside = set(nodes)
    leaf_at = {}      # arguments first, then the trace's inputs
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor):
            node = before[id(t)][0]
            if node is None:
                raise _Refused(f"argument {i} is a tensor the tracer does not track (a constant)")
            leaf_at.setdefault(node, ("arg", i))
    for t in inputs:
        node = before[id(t)][0]
        if node is not None:
            leaf_at.setdefault(node, ("input", t))
    ext = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a in ext:
                continue
            if a.op == "get_attr":
                ext[a] = ("same", a)
            elif a in leaf_at:
                ext[a] = leaf_at[a]
            else:
                raise _Refused(f"node {n.name} reads {a.name}, a value that is neither an argument "
                               f"of the call nor an input of the trace (read through an attribute?)")
    return ext


def _results(tracer, out_leaves, nodes, ext) -> list:
    """Where each result of the call comes from: a node of the call, a value it read, or a
    constant; refused otherwise."""
    index = {n: k for k, n in enumerate(nodes)}
    outputs = []
    for o in out_leaves:
        if isinstance(o, torch.Tensor):
            slot = pt.get_proxy_slot(o, tracer, None)
            if slot is None:
                raise _Refused("a result tensor is not tracked (a constant)")
            if slot.constant is not None:
                raise _Refused("a result carries a constant value the tracer may fold later")
            node = slot.proxy.node
            if node in index:
                outputs.append(("node", index[node]))
            elif node in ext and ext[node][0] != "same":
                outputs.append(("ext", ext[node]))
            else:
                raise _Refused("a result is a tensor from outside the call that it did not read")
        elif isinstance(o, _IMMUTABLE):
            outputs.append(("const", o))
        else:
            raise _Refused(f"a result of type {type(o).__name__} is not a tensor or a constant")
    return outputs
