"""Small helpers over aten-level FX graphs shared by the passes."""
from __future__ import annotations

import contextlib
import operator
from typing import Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

try:  # generates a GraphModule's Python code when it is first called or read (torch >= 2.3)
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - every GraphModule generates its code when built
    _LazyGraphModule = None
    _use_lazy_graph_module = None

__all__ = ["aten", "CATS", "VIEW_OPS", "WRITES", "is_mutating", "mutated_arg", "view_chain",
           "slice_bounds", "attr_value",
           "val", "dead_code_elimination", "SIDE_EFFECTS", "storage_key", "returns_self",
           "mutated_attributes", "written_bases", "graph_module", "code_deferred",
           "generate_code", "step_device", "subgraph", "stride_order", "describe"]

aten = torch.ops.aten
INT_MAX = 2 ** 63 - 1

# Concatenation as traced: pre-dispatch tracing keeps torch.concat / torch.concatenate as ops of
# their own (same arguments as cat)
CATS = frozenset({aten.cat.default, aten.concat.default, aten.concatenate.default})

# View ops the passes follow when asking "which storage does this node read or write?"
VIEW_OPS = {aten.slice.Tensor, aten.select.int, aten.alias.default, aten.detach.default}

# Python callables inserted into graphs that must survive dead-code elimination.
SIDE_EFFECTS: set = set()

# ``node.meta[WRITES]`` of a ``call_module`` node: the positions of the arguments its module
# writes in place (a fused region that writes its result into a buffer). Every question "which
# storage does the graph write?" reads it, as it reads an in-place op's schema.
WRITES = "cadence_writes"


# -- Python code, generated once --------------------------------------------------------------
# A GraphModule generates (and compiles) the Python code of its graph when it is built, and again
# for every GraphModule under it whenever its parent recompiles: about a second each for the
# 13.8k-node CFM chunk. Graphs built during a compile defer it; ``generate_code`` runs it once.

def graph_module(root, graph: Graph, class_name: str = "GraphModule") -> GraphModule:
    """A GraphModule whose code is generated when it is first called, its ``code`` read, or
    ``generate_code`` runs."""
    return (_LazyGraphModule or GraphModule)(root, graph, class_name=class_name)


def code_deferred():
    """Within it, GraphModules built by torch (``make_fx``'s) defer their code the same way."""
    return _use_lazy_graph_module(True) if _use_lazy_graph_module else contextlib.nullcontext()


def generate_code(gm: GraphModule) -> None:
    """Recompile ``gm`` after its graph changed, and generate the code of every GraphModule in it
    (itself included) still deferring it."""
    gm.recompile()
    if _LazyGraphModule is None:
        return
    for m in gm.modules():
        if isinstance(m, _LazyGraphModule):
            m.real_recompile()


def val(node) -> Optional[torch.Tensor]:
    """The (fake) tensor a node produced at trace time, if recorded."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def step_device(gm) -> torch.device:
    """The device a traced step runs on: that of its first value off the CPU, else the CPU."""
    for n in gm.graph.nodes:
        v = val(n)
        if v is not None and v.device.type != "cpu":
            return v.device
    return torch.device("cpu")


def subgraph(nodes: List[Node], inputs: List[Node], outputs: List[Node],
             copy_attrs: bool = False) -> Graph:
    """A graph computing ``outputs`` from ``inputs`` (placeholders, with their metadata) by
    copies of ``nodes``, in their order; ``copy_attrs`` copies the ``get_attr`` nodes they read
    into it (else those must be among ``inputs``)."""
    sub = Graph()
    env: Dict[Node, Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        if copy_attrs:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in env:
                    env[a] = sub.node_copy(a, lambda x: env[x])
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    return sub


def is_mutating(node: Node) -> bool:
    t = node.target
    if node.op == "call_module":
        return bool(node.meta.get(WRITES))
    if node.op != "call_function":
        return False
    if t in SIDE_EFFECTS:
        return True
    schema = getattr(t, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def mutated_arg(node: Node) -> Optional[Node]:
    """The argument an in-place/out op writes (its first mutable tensor argument), or that a
    module call writes (``WRITES``)."""
    if node.op == "call_module":
        written = node.meta.get(WRITES)
        return node.args[written[0]] if written else None
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            return v if isinstance(v, Node) else None
    return None


def returns_self(node: Node) -> bool:
    """An in-place op whose result is its (written) first argument, like ``index_copy_``."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return bool(schema is not None and schema.is_mutable and schema.returns
                and schema.returns[0].alias_info is not None
                and schema.arguments and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write)


def view_chain(node: Node) -> Tuple[Node, List[Node]]:
    """Follow view ops (and in-place ops returning ``self``) back to the base node:
    ``(base, [view nodes, base-most first])``."""
    chain = []
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in VIEW_OPS:
            chain.append(node)
        elif not returns_self(node):
            break
        node = node.args[0]
    return node, chain[::-1]


def storage_key(node) -> Optional[object]:
    """Identity of the (fake) storage a node's value lives in: aliasing survives every view op,
    transposes and reshapes included, because fake tensors share storage as real ones do."""
    v = val(node)
    if v is None:
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except (NotImplementedError, RuntimeError):  # pragma: no cover - tensors without storage
        return None


def slice_bounds(node: Node, size: int) -> Optional[Tuple[int, int, int]]:
    """``(dim, start, stop)`` of an ``aten.slice`` normalized against ``size``; None if strided."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, dim, start, stop, step = args[:5]
    dim = node.kwargs.get("dim", dim if dim is not None else 0)
    start = 0 if start is None else start
    stop = INT_MAX if stop is None else stop
    if (step or 1) != 1:
        return None
    if start < 0:
        start += size
    if stop < 0:
        stop += size
    return dim, max(0, min(start, size)), max(0, min(stop, size))


def dead_code_elimination(graph: Graph) -> int:
    """Remove unused pure nodes; keep mutations, inserted side effects, placeholders and outputs."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users:
            continue
        if is_mutating(node) or (node.op == "call_function" and node.target in SIDE_EFFECTS):
            continue
        if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload) \
                and node.target is not operator.getitem:
            continue  # a Python callable (an autocast switch, a hook) may act by side effect
        if node.op == "call_function" and node.target is not operator.getitem:
            tags = getattr(node.target, "tags", ())
            if torch.Tag.nondeterministic_seeded in tags:
                continue  # drawing random numbers advances the generator: an effect
        graph.erase_node(node)
        removed += 1
    return removed



def written_bases(graph: Graph) -> List[Node]:
    """The nodes whose storage the graph writes in place (through any view), in graph order."""
    found: dict = {}
    for n in graph.nodes:
        target = mutated_arg(n) if is_mutating(n) else None
        if target is not None:
            found.setdefault(view_chain(target)[0], None)
    return list(found)


def mutated_attributes(gm) -> List[torch.Tensor]:
    """Tensors a graph module holds as attributes (module state) that its graph writes in place.
    A module loaded from the compile cache has no graph; it lists them (``written_attributes``)."""
    if not isinstance(gm, GraphModule):
        return [attr_value(gm, target) for target in gm.written_attributes]
    return [attr_value(gm, b.target) for b in written_bases(gm.graph) if b.op == "get_attr"]


def attr_value(gm, target: str):
    """What a ``get_attr`` node of ``gm`` reads (a dotted attribute path)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# -- layouts ----------------------------------------------------------------------------------
# The rule that decides by them is ``cadence_fx/layouts.py``; the carry pass applies it too.

def stride_order(t) -> Tuple[int, ...]:
    """The dims of ``t`` of size > 1, outermost first: the order a kernel walks it in."""
    return tuple(sorted((i for i in range(t.dim()) if t.shape[i] > 1),
                        key=lambda i: (-t.stride(i), i)))


def describe(t) -> str:
    """``strides (192, 1, 16), dims outermost first (0, 2, 1)``."""
    return f"strides {tuple(t.stride())}, dims outermost first {stride_order(t)}"
