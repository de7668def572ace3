"""Tracing front end: one exact-shape aten-level FX graph per catalog signature, via make_fx.

Why make_fx with ``pre_dispatch=True``: it records the aten calls as eager code makes them, before
composite ops (``aten.linear``, ``aten.scaled_dot_product_attention``, ``aten.layer_norm``) are
decomposed, so running the graph goes through the very C++ implementations stock eager goes
through -- same kernels, same bits. (A post-dispatch trace decomposes composites with the Python
decompositions instead; on CUDA, ``linear`` on a transposed input then becomes ``expand + bmm``
where eager calls ``mm``, and results drift by ~2e-6.) Python control flow on shapes (retention firing, cache present or not) is resolved
at trace time, which is exactly what one graph per signature wants. Parameters and buffers are
lifted to placeholders, so passes can see which buffer the step writes (an over-sized envelope)
and substitute contract-owned storage for it without touching the user's module.

Placeholders of a traced step, in order: parameters, buffers, then the tensor leaves of the step's
arguments (``InputSpec`` says which is which). Non-tensor leaves (ints, bools, None) are baked in and
belong to the signature.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .effects import TensorSnapshot
from .errors import TraceError
from .passes.context import InputSpec
from .passes.fx_utils import code_deferred
from .signature import global_signature, tensor_signature  # noqa: F401 (re-exported)
from .splice import RepeatedCalls

__all__ = ["InputSpec", "TracedStep", "bind_arguments", "leaves_with_paths", "trace_step",
           "tensor_signature", "global_signature"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TracedStep:
    gm: torch.fx.GraphModule
    inputs: List[InputSpec]                  # one per placeholder, in order
    out_spec: pytree.TreeSpec                # structure of the step's result
    out_paths: List[str]                     # path of every result leaf
    out_constants: Dict[int, Any]            # result leaves that are not tensors, by leaf index
    out_tensor_index: List[int]              # leaf index of each graph output
    seconds: float
    copied_calls: int = 0                    # repeated calls copied instead of traced
    refused: Dict[str, str] = dataclasses.field(default_factory=dict)  # method -> why traced in full
    loaded: bool = False                     # read from the persistent compile cache, not traced


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaves_with_paths(tree) -> Tuple[List[Tuple[str, Any]], pytree.TreeSpec]:
    """Flatten a pytree into ``(path, leaf)`` pairs with paths like ``"cache.att"`` or ``"1"``."""
    flat, spec = pytree.tree_flatten_with_path(tree)
    return [(".".join(_key_str(k) for k in path), leaf) for path, leaf in flat], spec


def module_state_tensors(module: torch.nn.Module, depth: int = 3) -> Dict[str, torch.Tensor]:
    """Tensors a module keeps outside its parameters and buffers, by attribute path: plain
    attributes, and those inside containers and dataclasses held by attributes (streaming
    state), ``depth`` levels deep."""
    found: Dict[str, torch.Tensor] = {}
    seen = set()

    def visit(path, value, level):
        if isinstance(value, torch.Tensor):
            if not isinstance(value, torch.nn.Parameter) and id(value) not in seen:
                seen.add(id(value))
                found[path] = value
        elif level < depth:
            if isinstance(value, dict):
                items = value.items()
            elif isinstance(value, (list, tuple)):
                items = enumerate(value)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                # its fields, and what ``__post_init__`` sets (Moshi's ``State.exec_mask``)
                items = (list(vars(value).items()) if hasattr(value, "__dict__")
                         else [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)])
            else:
                return
            for key, item in items:
                visit(f"{path}.{key}", item, level + 1)

    for prefix, sub in module.named_modules():
        buffers = {id(b) for b in sub._buffers.values() if b is not None}
        for name, value in vars(sub).items():
            if name in ("_parameters", "_buffers", "_modules") or id(value) in buffers:
                continue
            visit(f"{prefix}.{name}" if prefix else name, value, 0)
    return found


def bind_arguments(fn, args: Sequence, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Name every argument of a call (``fn``: a callable or its ``inspect.Signature``) the way
    region paths name them."""
    sig = fn if isinstance(fn, inspect.Signature) else inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    out = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_POSITIONAL and name in out:
            out[name] = tuple(out[name])
        elif p.kind is inspect.Parameter.VAR_KEYWORD and name in out:
            out.update(out.pop(name))  # **kwargs: each keyword is an argument of its own
    return out


class _StepModule(torch.nn.Module):
    """Lets ``torch.func.functional_call`` swap the parameters of any step function's module."""

    def __init__(self, inner: torch.nn.Module, fn: Callable):
        super().__init__()
        self.inner = inner
        self._fn = fn

    def forward(self, **kwargs):
        return self._fn(**kwargs)


def trace_step(module: torch.nn.Module, fn: Callable, named_args: Dict[str, Any], *,
               tracing_mode: str = "fake",
               repeated: Sequence[Tuple[torch.nn.Module, str]] = ()) -> TracedStep:
    """Trace ``fn(**named_args)`` with ``module``'s parameters and buffers lifted to placeholders.
    ``repeated``: ``(submodule, method)`` pairs the step calls many times with the same argument
    shapes; each signature is traced once and later calls copy its nodes (``cadence_fx.splice``)."""
    # one placeholder per tensor: a module registered under two names shares its weights, and
    # ``functional_call`` ties the other names to the one passed
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    leaves, in_spec = leaves_with_paths(named_args)
    arg_tensors = [(p, v) for p, v in leaves if isinstance(v, torch.Tensor)]
    inputs = ([InputSpec("param", n) for n in params] + [InputSpec("buffer", n) for n in buffers]
              + [InputSpec("arg", p) for p, _ in arg_tensors])
    n_state = len(params) + len(buffers)
    state_names = list(params) + list(buffers)
    holder: Dict[str, Any] = {}
    wrapper = _StepModule(module, fn)

    def flat_step(*flat):
        holder["flat"] = flat
        state = dict(zip(state_names, flat[:n_state]))
        it = iter(flat[n_state:])
        values = [next(it) if isinstance(v, torch.Tensor) else v for _, v in leaves]
        kwargs = pytree.tree_unflatten(values, in_spec)
        result = torch.func.functional_call(wrapper, {f"inner.{k}": v for k, v in state.items()},
                                            (), kwargs, tie_weights=True, strict=False)
        out_leaves, out_spec = leaves_with_paths(result)
        holder["out"] = (out_leaves, out_spec)
        return [v for _, v in out_leaves if isinstance(v, torch.Tensor)]

    example = list(params.values()) + list(buffers.values()) + [v for _, v in arg_tensors]
    start = time.perf_counter()
    splicer = RepeatedCalls(repeated, lambda: holder.get("flat", ()))
    try:
        gm = _make_fx_without_effects(module, flat_step, example, tracing_mode, splicer)
    except Exception as e:  # noqa: BLE001 - re-raised with the signature that failed
        shapes = ", ".join(f"{p}: {tuple(v.shape)}" for p, v in arg_tensors[:6])
        if len(arg_tensors) > 6:
            shapes += f", ... ({len(arg_tensors)} tensor arguments)"
        raise TraceError(f"make_fx could not trace the step at argument shapes {{{shapes}}}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    out_leaves, out_spec = holder["out"]
    tensor_idx = [i for i, (_, v) in enumerate(out_leaves) if isinstance(v, torch.Tensor)]
    constants = {i: v for i, (_, v) in enumerate(out_leaves) if not isinstance(v, torch.Tensor)}
    seconds = time.perf_counter() - start
    log.debug("traced %d nodes in %.2fs", len(gm.graph.nodes), seconds)
    if splicer.copies or splicer.refused:
        log.debug("repeated calls: %d traced, %d copied; traced in full: %s", splicer.traced,
                  splicer.copies, splicer.refused or "none")
    return TracedStep(gm=gm, inputs=inputs, out_spec=out_spec, out_paths=[p for p, _ in out_leaves],
                      out_constants=constants, out_tensor_index=tensor_idx, seconds=seconds,
                      copied_calls=splicer.copies, refused=dict(splicer.refused))


def _make_fx_without_effects(module, flat_step, example, tracing_mode, splicer):
    """``make_fx(flat_step)`` with the module left as it was found. Tensors held in plain
    attributes (module state such as a step counter or a streaming cache) enter the trace as
    real constants, and ops on them run for real while tracing: they are put back afterwards, so
    that a trace has no effects. Every parameter and buffer slot is put back by identity too:
    stock code may register a buffer lazily (Mimi's codebook ``_embedding``), which would keep a
    fake tensor, and ``functional_call`` restores a module registered under two names in an
    order that can leave the fake behind."""
    state_tensors = TensorSnapshot(module_state_tensors(module).values())
    slots = [(d, dict(d)) for m in module.modules(remove_duplicate=True)
             for d in (m._parameters, m._buffers)]
    try:
        # (code_deferred: the passes generate the code, once)
        with torch.no_grad(), splicer, code_deferred(), _quiet_fake_tensor_log():
            return make_fx(flat_step, tracing_mode=tracing_mode, pre_dispatch=True,
                           _allow_non_fake_inputs=True)(*example)
    finally:
        state_tensors.restore()
        for live, saved in slots:
            if live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items()):
                live.clear()
                live.update(saved)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Fake tensors log the full traceback of an op that fails on them (a wrong-shaped call) at
    ERROR; the failure reaches the caller as a TraceError carrying torch's message instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
