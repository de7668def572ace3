"""Shape-enumeration pass: check the graph's signature class against the catalog and partition it
into capturable pieces and pieces that must stay eager, each eager piece with its reason.

Cases that stay eager: host syncs (``.item()``, ``aten._local_scalar_dense``, indexing with a
boolean mask), copies to the host
(``.cpu()``) and host-side work inside a device step, host randomness (a random op on a CPU tensor
while the step runs on an accelerator), data-dependent output shapes (``nonzero``, ``unique``),
ops whose kernels check values on the host (``istft``), and Python callables such as the shadow
auditor. Everything else is capturable. ::

    before:  x -> linear -> item -> mul -> output
    after:   x -> submod_0 (graph: linear) -> submod_1 (eager: item) -> submod_2 (graph: mul)

Pieces are maximal runs of nodes in graph order, so side effects (in-place writes on the carry)
keep their order; the dependency graph (networkx) checks that the pieces form a chain-compatible
DAG and gives each piece its boundary values. Invariant: running the pieces in order computes what
the unsplit graph computed.
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional

import networkx as nx
import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .fx_utils import aten, graph_module, step_device, subgraph, val
from .records import Piece

__all__ = ["shape_enumeration", "eager_reason"]

_HOST_SYNC = {aten._local_scalar_dense.default: "host sync (.item())",
              aten.item.default: "host sync (.item())",
              aten.equal.default: "host sync (torch.equal)",
              aten.is_nonzero.default: "host sync (bool of a tensor)"}
# Host-side switches a pre-dispatch trace records for contexts inside the step; inside a captured
# piece they only steer dispatch while capturing, which is what they do in eager too.
_MODE_SWITCHES = {torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                  torch.amp.autocast_mode._exit_autocast}
_HOST_CHECKED = {aten.istft.default: "istft checks its window on the host (not capturable)"}
# Indexing with a boolean mask turns the mask into indices with ``nonzero`` (a host sync), even when
# the result's shape is static; ``x[mask] = v`` with one value (Moshi's ``LMGen._step``) is made a
# select by the mask_writes pass before this one, so what reaches here has no such form.
_INDEX_OPS = {aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
              aten.index.Tensor}


def eager_reason(node: Node, device: torch.device) -> Optional[str]:
    """Why ``node`` cannot be captured in a device graph, or None if it can."""
    if node.op != "call_function":
        return None
    t = node.target
    if "cadence_eager_reason" in node.meta:
        return node.meta["cadence_eager_reason"]
    if t is operator.getitem or t in _MODE_SWITCHES:
        return None
    if not isinstance(t, torch._ops.OpOverload):
        return f"python callable {getattr(t, '__name__', t)}"
    if t in _HOST_SYNC:
        return _HOST_SYNC[t]
    if t in _HOST_CHECKED:
        return _HOST_CHECKED[t]
    if t in _INDEX_OPS and len(node.args) > 1 and any(
            isinstance(i, Node) and val(i) is not None and val(i).dtype == torch.bool
            for i in (node.args[1] or ())):
        return f"boolean-mask indexing ({t.name()}) syncs with the host through nonzero"
    if torch.Tag.dynamic_output_shape in t.tags or torch.Tag.data_dependent_output in t.tags:
        return f"data-dependent output ({t.name()})"
    v = val(node)
    if device.type != "cpu" and v is not None and v.device.type == "cpu":
        if torch.Tag.nondeterministic_seeded in t.tags:
            return f"host randomness ({t.name()} on the CPU generator)"
        inputs = [val(a) for a in node.all_input_nodes]
        if any(i is not None and i.device.type != "cpu" for i in inputs):
            return f"copy to the host ({t.name()})"
        return f"runs on the host ({t.name()} on a CPU tensor)"
    return None


def shape_enumeration(gm: GraphModule, ctx: PassContext) -> PassResult:
    device = step_device(gm)
    body = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    kinds: Dict[Node, str] = {}
    reasons: Dict[Node, str] = {}
    for n in body:
        if n.target is operator.getitem and n.args[0] in kinds:
            kinds[n] = kinds[n.args[0]]
            continue
        r = eager_reason(n, device)
        kinds[n] = "eager" if r else "graph"
        if r:
            reasons[n] = r
    runs: List[List[Node]] = []
    for n in body:
        if runs and kinds[runs[-1][0]] == kinds[n]:
            runs[-1].append(n)
        else:
            runs.append([n])
    piece_of = {n: i for i, run in enumerate(runs) for n in run}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(runs)))
    for n in body:
        for a in n.all_input_nodes:
            if a in piece_of and piece_of[a] != piece_of[n]:
                dag.add_edge(piece_of[a], piece_of[n], value=a.name)
    assert nx.is_directed_acyclic_graph(dag) and all(u < v for u, v in dag.edges), \
        "pieces taken in graph order must only depend on earlier pieces"
    ctx.records.graph = gm  # the unsplit graph, for inspection
    ctx.records.piece_of = {n.name: piece_of[n] for n in body}
    split = _split(gm, runs, piece_of)
    ctx.records.pieces = [Piece(
        f"piece_{i}", kinds[run[0]], len(run), tuple(sorted({reasons[n] for n in run if n in reasons})),
        tuple(sorted(dag.predecessors(i)))) for i, run in enumerate(runs)]
    ctx.records.catalog_class = ctx.class_key
    return PassResult(split, True)


def _split(gm: GraphModule, runs: List[List[Node]], piece_of: Dict[Node, int]) -> GraphModule:
    """One submodule per run, called in order from a new top-level graph."""
    top = Graph()
    env: Dict[Node, Node] = {}
    output = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = top.node_copy(n, lambda a: env[a])
        elif n.op == "output":
            output = n
    root = torch.nn.Module()
    for i, run in enumerate(runs):
        members = set(run)
        inputs: List[Node] = []
        for n in run:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs and a.op != "get_attr":
                    inputs.append(a)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        sub = subgraph(run, inputs, outputs, copy_attrs=True)
        name = f"piece_{i}"
        setattr(root, name, graph_module(gm, sub, class_name=name))
        call = top.call_module(name, tuple(env[a] if a.op != "get_attr" else _attr(top, env, a)
                                           for a in inputs))
        for k, o in enumerate(outputs):
            env[o] = top.call_function(operator.getitem, (call, k))
            env[o].meta = dict(o.meta)
    top.output(torch.fx.node.map_arg(output.args[0], lambda a: env[a] if a.op != "get_attr"
                                     else _attr(top, env, a)))
    for name, buf in gm.named_buffers():
        root.register_buffer(name, buf, persistent=False)
    return graph_module(root, top, class_name="CadenceStep")


def _attr(top: Graph, env: Dict[Node, Node], a: Node) -> Node:
    if a not in env:
        env[a] = top.get_attr(a.target)
    return env[a]
