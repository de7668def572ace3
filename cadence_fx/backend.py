"""``torch.compile(m, backend="cadence", dynamic=False, options={"adapter": ...})``.

Dynamo hands the backend a torch-level FX graph per shape specialization, with parameters and
buffers lifted to inputs (their sources name them). The backend wraps that graph in a module,
maps the adapter's paths onto its placeholders (``cache.att`` is the input whose source is
``L['cache']['att']``) and outputs, and runs the same pipeline as ``cadence_fx.compile`` on it: the
graph is re-traced to aten level by make_fx, so the kernels stay those of stock eager.

Limits: dynamo flattens the step's results, so a region's output is found by elimination: the one
result with the declared shape, an extent the region can hold, and the region's input among its
ancestors; when that is ambiguous, or the step updates the state in place and returns its input
(dynamo hands that back outside the graph), the region is left out and the log says so. One
compiled model serves one stream: its graphs share one set of carries.

``dynamic`` may be False, None or True. With None (dynamo's default) the graphs after the first
recompile are symbolic, with True all are; either way the backend's step is traced again at each
exact shape the stream reaches (one class per catalog signature), so the kernels and guards stay
exact-shape; ``dynamic=False`` only saves dynamo's own recompiles of the symbolic graph.
``report()`` shows what the backend compiled in this process (``compiled_steps()``).
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import re
import sys
import weakref
from typing import Dict, List, Optional

import torch

from .catalog import build_catalog
from .contract import Adapter
from .errors import ContractError

__all__ = ["cadence_backend", "compiled_steps", "report"]

_SHARED_CARRIES: Dict[tuple, dict] = {}
_STEPS: List[weakref.ref] = []   # every step the backend compiled, for report()

log = logging.getLogger(__name__)


# ``L['self']._modules['flow']._buffers['att_cache_buffer']`` -> flow, att_cache_buffer
_SOURCE_KEY = re.compile(r"\._(?:modules|buffers)\['([^']+)'\]")


def _source_name(path: str) -> str:
    keys = "".join(f"[{int(k)}]" if k.isdigit() else f"[{k!r}]" for k in path.split("."))
    return f"L{keys}"


class _DynamoStep(torch.nn.Module):
    """A dynamo graph as a step module: lifted parameters and buffers become its own again."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs):
        super().__init__()
        self.gm = gm
        self.order: List[str] = []
        self.args: List[str] = []
        self.stock_buffer_names: List[str] = []   # the lifted buffers' names in the user's model
        for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
            source = node.meta.get("grapharg")
            source = source.source.name if source is not None else ""
            source = source() if callable(source) else source
            self.order.append(node.name)
            if "._parameters[" in source and isinstance(value, torch.nn.Parameter):
                self.register_parameter(node.name, value)
            elif "._buffers[" in source and isinstance(value, torch.Tensor):
                self.register_buffer(node.name, value, persistent=False)
                self.stock_buffer_names.append(".".join(_SOURCE_KEY.findall(source)))
            else:
                self.args.append(node.name)

    def forward(self, **kwargs):
        state = dict(self.named_parameters(recurse=False))
        state.update(self.named_buffers(recurse=False))
        return self.gm(*[kwargs[n] if n in kwargs else state[n] for n in self.order])


def _map_adapter(adapter: Adapter, gm: torch.fx.GraphModule, step: _DynamoStep) -> Adapter:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_source = {}
    for n in placeholders:
        ga = n.meta.get("grapharg")
        if ga is not None:
            name = ga.source.name
            by_source[name() if callable(name) else name] = n.name
    outputs = list(gm.graph.output_node().args[0]) if hasattr(gm.graph, "output_node") else \
        list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    catalog = build_catalog(adapter)
    regions = []
    for r in adapter.regions:
        src = _source_name(r.input)
        if src not in by_source:
            log.warning("region %s: no graph input has source %s; left out", r.name, src)
            continue
        want = [None if i == r.dim else adapter.dim_size(d, r) for i, d in enumerate(r.shape)]
        # the new state: the result with the declared shape and an extent the region can hold
        region_input = next(n for n in placeholders if n.name == by_source[src])
        if _written_in_place(gm, region_input):
            log.warning("region %s: the step writes its state in place and returns it; dynamo "
                        "hands that back outside the graph, so the region is left out -- "
                        "cadence_fx.compile handles that case", r.name)
            continue
        cat = catalog.region(r.name)
        hits = [i for i, o in enumerate(outputs) if isinstance(o, torch.fx.Node)
                and _matches(o.meta.get("example_value"), want, r.dim)
                and cat.lower <= o.meta["example_value"].shape[r.dim] <= cat.declared_extent]
        if len(hits) > 1:  # the result moved out of the input (cat, slices) breaks ties
            moved = [i for i in hits if _reaches(outputs[i], region_input, _moves)]
            hits = moved or [i for i in hits if _reaches(outputs[i], region_input)]
        if len(hits) != 1:
            log.warning("region %s: %d graph results can be its new state (a step that updates "
                        "the state in place and returns its input hands it back outside the "
                        "graph); left out -- cadence_fx.compile handles that case", r.name, len(hits))
            continue
        regions.append(dataclasses.replace(r, input=by_source[src], output=str(hits[0])))
    if not regions:
        raise ContractError(f"adapter {adapter.name!r}: no region maps onto this dynamo graph "
                            "(an input whose source matches the region's input path, and exactly "
                            "one result that can be its new state); see the log, or use "
                            "cadence_fx.compile on the step directly")
    call_input = adapter.call_input
    if call_input is not None:
        call_input = by_source.get(_source_name(call_input))
        if call_input is None:
            raise ContractError(f"adapter {adapter.name!r}: no graph input has the source of "
                                f"call_input {adapter.call_input!r}; fix call_input")
    return dataclasses.replace(adapter, regions=tuple(regions), call_input=call_input)


def _written_in_place(gm: torch.fx.GraphModule, target: torch.fx.Node) -> bool:
    for n in gm.graph.nodes:
        if not n.args or n.args[0] is not target:
            continue
        if (n.op == "call_method" and n.target.endswith("_")) or n.target is operator.setitem:
            return True
    return False


# torch-level ops that move data without computing on it: a region's new state reaches its own
# input through these (a window of a concatenation), another layer's only through compute
_MOVES = {torch.cat, torch.concat, torch.narrow, torch.split, torch.chunk, torch.clone,
          operator.getitem}
_MOVE_METHODS = {"narrow", "split", "chunk", "clone", "detach", "contiguous", "view", "reshape",
                 "transpose", "permute", "unsqueeze", "squeeze", "flatten"}


def _moves(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _MOVES) or \
        (n.op == "call_method" and n.target in _MOVE_METHODS)


def _reaches(node: torch.fx.Node, source: torch.fx.Node, through=lambda n: True) -> bool:
    """Is ``source`` an ancestor of ``node`` along nodes ``through`` accepts?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        if through(n):
            stack.extend(n.all_input_nodes)
    return False


def _matches(v, want, dim) -> bool:
    if not isinstance(v, torch.Tensor) or v.dim() != len(want):
        return False
    return all(w is None or w == s for w, s in zip(want, v.shape))


def _is_priming_graph(adapter: Adapter, gm: torch.fx.GraphModule) -> bool:
    sources = set()
    for n in gm.graph.nodes:
        ga = n.meta.get("grapharg") if n.op == "placeholder" else None
        if ga is not None:
            name = ga.source.name
            sources.add(name() if callable(name) else name)
    return not any(_source_name(r.input) in sources for r in adapter.regions)


def _raise_recompile_limit(catalog_size: int) -> None:
    """Dynamo compiles one graph per catalog class (and one for the priming pass): its default
    recompile limit (8) would send the rest of the catalog to plain eager with a warning."""
    need = catalog_size + 2
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        have = getattr(config, name, None)
        if isinstance(have, int) and have < need:
            setattr(config, name, need)
            log.info("torch._dynamo.config.%s raised from %d to %d: the catalog has %d classes",
                     name, have, need, catalog_size)


def cadence_backend(gm: torch.fx.GraphModule, example_inputs, *, options: Optional[Dict] = None,
                    **_):
    """The torch.compile backend. ``options``: ``adapter`` (an Adapter or a registered name) plus
    any keyword of ``cadence_fx.compile`` (``verify``, ``strict``, ``graphs``, ...)."""
    from .runtime import compile as cadence_compile
    options = dict(options or {})
    adapter = options.pop("adapter", None)
    if adapter is None:
        raise ContractError('backend "cadence" needs the adapter declaring the model\'s clocks '
                            'and regions; pass torch.compile(..., options={"adapter": ADAPTER}) '
                            "with an Adapter or a registered name")
    if any(isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
           for s in t.shape):   # dynamo hands real examples; a symbolic one cannot be traced exactly
        raise ContractError('backend "cadence" was handed symbolic example inputs; call '
                            "torch.compile(..., dynamic=False)")
    if isinstance(adapter, str):
        from cadence_fx import adapters
        adapter = adapters.get(adapter)
    _raise_recompile_limit(build_catalog(adapter).size)
    if _is_priming_graph(adapter, gm):
        log.info("adapter %s: this graph receives no region state (the priming pass); it runs "
                 "eagerly, as dynamo traced it", adapter.name)
        return gm.forward
    step = _DynamoStep(gm, example_inputs)
    # Dynamo compiles one graph per shape; all graphs of one model and adapter share the carries,
    # so the stream's state keeps one address across catalog classes.
    weights = tuple(sorted(p.data_ptr() for p in step.parameters()))
    carries = _SHARED_CARRIES.setdefault((id(adapter), adapter.name, weights), {})
    compiled = cadence_compile(step, _map_adapter(adapter, gm, step), carries=carries, **options)
    names = step.order

    def run(*args):
        return compiled(**{n: a for n, a in zip(names, args) if n in step.args})

    run.cadence = compiled  # for inspection: torch.compile hides the backend's object otherwise
    _STEPS[:] = [r for r in _STEPS if r() is not None] + [weakref.ref(compiled)]
    return run


def compiled_steps() -> List:
    """The steps the backend compiled in this process and that are still alive (one per dynamo
    graph that receives region state), oldest first."""
    return [s for s in (r() for r in _STEPS) if s is not None]


def report(show: Optional[bool] = None) -> "BackendReport":
    """What ``torch.compile(..., backend="cadence")`` compiled: each step's report (catalog,
    rewrites, pieces, counters). On a line of its own it shows itself, as text in a script and
    as HTML in a notebook; ``show`` as for ``CompiledStep.report``."""
    from .report import shown
    return shown(BackendReport(compiled_steps()), sys._getframe(1), show)


class BackendReport:
    def __init__(self, steps):
        self.steps = steps

    def _names(self):
        return [f"dynamo graph {i} ({s.adapter.name})" for i, s in enumerate(self.steps)]

    def __repr__(self):
        return str(self)

    def __str__(self):
        if not self.steps:
            return "the cadence backend has compiled no step in this process"
        return "\n\n".join(f"== {n}\n{s.report()}" for n, s in zip(self._names(), self.steps))

    def _repr_html_(self):
        from .report_html import render
        if not self.steps:
            return "<p>the cadence backend has compiled no step in this process</p>"
        return "".join(render(s.report(), n) for n, s in zip(self._names(), self.steps))
