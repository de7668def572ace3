"""Lowering pass: every piece becomes a guarded callable behind one interface.

Case handled::

    before:  piece_0 = GraphModule(...)             # from shape_enumeration
    after:   piece_0 = GraphModule(...)             # the same, and its spec:
             PieceSpec("piece_0", kind="graph", fixed=["param w", None], ...)
             # the runtime makes it GuardedPiece(piece_0, ...) (``cadence_fx.replay.guard_pieces``)

The pass says what each piece is; the runtime builds the ``GuardedPiece`` from that. Eager pieces
run as they are and are counted. Capturable pieces ask the backend for a replay at their exact
signature on first use; with the eager backend (CPU, or graphs off) that is the guarded eager
path. Inputs that are top-level placeholders of contract-owned storage (carries, parameters,
buffers) are marked fixed-address: a replay may alias them instead of staging a copy, and the guard
checks their ``data_ptr``. Needs the pieces of ``shape_enumeration``. This pass comes last: its
specs are the only runtime state besides the fused regions'.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import List

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .fx_utils import storage_key, written_bases
from .specs import PieceSpec

__all__ = ["lower_guarded"]

FIXED_KINDS = ("carry", "param", "buffer")


def lower_guarded(gm: GraphModule, ctx: PassContext) -> PassResult:
    placeholders = ctx.placeholders(gm)
    fixed_nodes = {n: f"{spec.kind} {spec.name}" for n, spec in zip(placeholders, ctx.inputs)
                   if spec.kind in FIXED_KINDS}
    if ctx.alias_state:  # ablation Rc: stock-sized region state bound by address
        region_inputs = {r.input: r.name for r in ctx.adapter.regions}
        fixed_nodes.update({n: f"stock state {region_inputs[spec.name]}"
                            for n, spec in zip(placeholders, ctx.inputs)
                            if spec.kind == "arg" and spec.name in region_inputs})
    # a view of contract-owned storage made by an earlier piece is just as fixed: same address
    # every call of the class (the guard checks it), and writes through it must reach the owner
    by_storage = {storage_key(n): name for n, name in fixed_nodes.items() if storage_key(n)}
    for b in ctx.regions:  # the carry pass knows every fake storage that stands for a carry
        by_storage.update({key: f"carry {b.region.name}" for key in b.storages})
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in fixed_nodes:
            name = by_storage.get(storage_key(node))
            if name is not None:
                fixed_nodes[node] = f"view of {name}"
    pieces = {p.name: i for i, p in enumerate(ctx.records.pieces)}
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaving = set(output.all_input_nodes)
    lowered = 0
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in pieces:
            continue
        info = ctx.records.pieces[pieces[node.target]]
        sub = getattr(gm, node.target)
        fixed = [fixed_nodes.get(a) for a in node.args]
        outs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        escaping = [any(u.target is operator.getitem and u.args[1] == k and u in leaving
                        for u in node.users) for k in range(len(outs))]
        ctx.records.pieces[pieces[node.target]] = dataclasses.replace(
            info, inputs=len(fixed), aliased_inputs=sum(f is not None for f in fixed))
        ctx.specs.pieces.append(PieceSpec(node.target, info.kind, list(info.reasons), fixed,
                                          _mutated_inputs(sub), escaping))
        lowered += 1
    return PassResult(gm, lowered > 0)


def _mutated_inputs(sub: GraphModule) -> List[bool]:
    written = set(written_bases(sub.graph))
    return [n in written for n in sub.graph.nodes if n.op == "placeholder"]
