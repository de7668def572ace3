"""The pass pipeline: an explicit list built from options, run by a small manager.

Order matters and is fixed: constants first (so host work leaves the graph before partitioning),
host-side checks on those constants made once, the carry pass next (it introduces the in-place
writes), masked writes as selects (so they need not split the graph), pointwise runs as fused
regions (after every rewrite that adds ops, before the pieces are cut), then the shape-enumeration
partition, and the lowering last (it adds the pieces' runtime state; the fused regions hold the
only other). One flag per pass.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Tuple

from torch.fx import GraphModule

from .context import PassContext
from .errors import CadenceError
from .fx_utils import generate_code

__all__ = ["Options", "build_pipeline", "run_pipeline", "PassFailed"]

log = logging.getLogger(__name__)


class PassFailed(CadenceError):
    """A pass raised or produced a graph that does not lint; names the pass."""


@dataclasses.dataclass(frozen=True)
class Options:
    constants: bool = True     # hoist input-independent subgraphs (device-resident constants)
    host_checks: bool = True   # host-side checks on constants made once (istft's window check)
    state_rule: bool = True    # the carry pass: retention as in-place writes on fixed storage
    mask_writes: bool = True   # x[mask] = v as a select on the device, not nonzero on the host
    fuse_exact: bool = True    # pointwise runs fused, each admitted only if bit-exact (device steps)
    partition: bool = True     # shape enumeration: capturable vs eager pieces
    lower: bool = True         # guarded pieces (device graphs where the backend has them)
    # Ablation only (the paper's Rc): without the state rule, bind the stock region tensors by
    # address instead of staging them. Stock code hands a new tensor per retention, so the guard
    # sees the address move and the piece is captured again: this is what the carry prevents.
    alias_state: bool = False
    # Trace each signature of an adapter's `repeated` methods once and copy the later calls
    # (node for node what a full trace gives; off: every call is traced).
    repeated: bool = True


def build_pipeline(options: Options) -> List[Tuple[str, Callable]]:
    from cadence_fx import passes  # passes/ is installed as cadence_fx.passes
    pipeline = []
    if options.constants:
        pipeline.append(("hoist_constants", passes.hoist_constants))
        if options.host_checks:   # reads the constants hoisted
            pipeline.append(("host_checks", passes.host_checks))
    if options.state_rule:
        pipeline.append(("carry_retention", passes.carry_retention))
    if options.mask_writes:
        pipeline.append(("mask_writes", passes.mask_writes))
    if options.fuse_exact:
        pipeline.append(("fuse_exact", passes.fuse_exact))
    if options.partition:
        pipeline.append(("shape_enumeration", passes.shape_enumeration))
        if options.lower:  # lowering needs pieces; it always comes last
            pipeline.append(("lower_guarded", passes.lower_guarded))
    return pipeline


def run_pipeline(gm: GraphModule, ctx: PassContext, pipeline) -> GraphModule:
    """Passes work on graphs and never run the module, so its Python code (and that of every piece)
    is generated once, after the last pass (about a second per pass for the 13.8k-node CFM chunk);
    the trace and the pieces defer theirs (``fx_utils.graph_module``)."""
    for k, (name, fn) in enumerate(pipeline):
        start = time.perf_counter()
        before = len(gm.graph.nodes)
        try:
            result = fn(gm, ctx)
            gm = result.graph_module
            gm.graph.lint()
            if k == len(pipeline) - 1:
                generate_code(gm)
        except CadenceError:
            raise
        except Exception as e:  # noqa: BLE001 - name the pass that failed
            raise PassFailed(f"pass {name} failed on class {ctx.class_key}: {type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        ctx.records["passes"].append({"name": name, "modified": result.modified,
                                      "nodes_before": before, "nodes_after": len(gm.graph.nodes),
                                      "seconds": round(seconds, 4)})
        log.debug("%s: modified=%s nodes %d -> %d in %.3fs", name, result.modified, before,
                  len(gm.graph.nodes), seconds)
    if not pipeline:
        generate_code(gm)
    return gm
