"""Lowering pass: every piece becomes a guarded callable behind one interface.

Case handled::

    before:  piece_0 = GraphModule(...)             # from shape_enumeration
    after:   piece_0 = GuardedPiece(piece_0, kind="graph", backend=EagerBackend())

Eager pieces run as they are and are counted. Capturable pieces ask the backend for a replay at
their exact signature on first use; with the eager backend (CPU, or graphs off) that is the guarded
eager path. Inputs that are top-level placeholders of contract-owned storage (carries, parameters,
buffers) are marked fixed-address: a replay may alias them instead of staging a copy, and the guard
checks their ``data_ptr``. This pass comes last: it is the only one that introduces runtime state.
"""
from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from cadence_fx.context import PassContext
from cadence_fx.replay import EagerBackend, GuardedPiece

__all__ = ["lower_guarded"]

FIXED_KINDS = ("carry", "param", "buffer")


def lower_guarded(gm: GraphModule, ctx: PassContext) -> PassResult:
    placeholders = ctx.placeholders(gm)
    fixed_nodes = {n for n, spec in zip(placeholders, ctx.inputs) if spec.kind in FIXED_KINDS}
    pieces = {p["name"]: p for p in ctx.records["pieces"]}
    backend = ctx.backend or EagerBackend()
    lowered = 0
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in pieces:
            continue
        info = pieces[node.target]
        fixed = [a in fixed_nodes for a in node.args]
        info["inputs"] = len(fixed)
        info["aliased_inputs"] = sum(fixed)
        guarded = GuardedPiece(getattr(gm, node.target), node.target, info["kind"], info["reasons"],
                               fixed, backend, ctx.counters)
        setattr(gm, node.target, guarded)
        lowered += 1
    return PassResult(gm, lowered > 0)
