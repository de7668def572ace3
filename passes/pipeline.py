"""The pass pipeline: an explicit list built from options, run by a small manager.

The order is fixed and stated as checks (``ORDER``: what each pass needs run before it, when both
run; ``NEEDS``: what it cannot run without), as torch.fx's pass manager states its constraints:
constants first (so host work leaves the graph before partitioning), host-side checks on those
constants made once, the carry pass next (it introduces the in-place writes), masked writes as
selects (so they need not split the graph), the four rewrites that prepare fusion
(``passes/fusion_prep.py``), pointwise runs as fused regions (after every rewrite that adds ops,
before the pieces are cut), then the shape-enumeration partition, and the lowering last (its specs
are the pieces' runtime state; the fused regions' are the only other). One flag per pass.

The passes emit specs of the runtime objects a class needs (``specs.py``); the runtime builds
them after ``run_pipeline`` (``cadence_fx/class_compiler.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Tuple

from torch.fx import GraphModule

from cadence_fx.errors import CadenceError

from .context import PassContext
from .fx_utils import generate_code
from .records import PassRun

__all__ = ["Options", "ORDER", "NEEDS", "build_pipeline", "check_order", "run_pipeline", "PassFailed",
           "PipelineOrderError"]

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
    # what prepares fusion (with it only; each changes where values live, never what is computed)
    functional_temporaries: bool = True   # in-place arithmetic on a temporary made functional
    cats_in_place: bool = True            # buffer.copy_(cat(parts)) written part by part
    split_conv_bias: bool = True          # a bias the conv backend adds after it: an op of its own
    contiguous_norm_inputs: bool = True   # a norm's strided input copied as its kernel would
    partition: bool = True     # shape enumeration: capturable vs eager pieces
    lower: bool = True         # guarded pieces (device graphs where the backend has them)
    # Ablation only (the paper's Rc): without the state rule, bind the stock region tensors by
    # address instead of staging them. Stock code hands a new tensor per retention, so the guard
    # sees the address move and the piece is captured again: this is what the carry prevents.
    alias_state: bool = False
    # Trace each signature of an adapter's `repeated` methods once and copy the later calls
    # (node for node what a full trace gives; off: every call is traced).
    repeated: bool = True


FUSION_PREP = ("functional_temporaries", "cats_in_place", "split_conv_bias", "contiguous_norm_inputs")

# pass -> the passes that must run before it where both run
ORDER = {
    "host_checks": ("hoist_constants",),                  # it checks the hoisted constants
    "carry_retention": ("hoist_constants", "host_checks"),
    "mask_writes": ("carry_retention",),                  # selects on the carry's writes
    "functional_temporaries": ("carry_retention", "mask_writes"),
    "cats_in_place": ("carry_retention", "functional_temporaries"),   # as fusion ran them
    "split_conv_bias": ("cats_in_place",),
    "contiguous_norm_inputs": ("split_conv_bias",),       # the split bias's add may make the input
    # fusion after every rewrite that adds ops, before the pieces are cut
    "fuse_exact": ("carry_retention", "mask_writes") + FUSION_PREP,
    "shape_enumeration": ("hoist_constants", "carry_retention", "mask_writes", "fuse_exact"),
    "lower_guarded": ("shape_enumeration", "fuse_exact"),
}
# pass -> the passes it cannot run without
NEEDS = {"host_checks": ("hoist_constants",), "lower_guarded": ("shape_enumeration",)}


class PipelineOrderError(CadenceError):
    """A pipeline whose passes are out of ``ORDER`` or miss what one ``NEEDS``."""


def check_order(pipeline: List[Tuple[str, Callable]]) -> None:
    """Raise ``PipelineOrderError`` naming the pass and what it needs before it."""
    names = [name for name, _ in pipeline]
    for k, name in enumerate(names):
        missing = [n for n in NEEDS.get(name, ()) if n not in names]
        if missing:
            raise PipelineOrderError(f"pass {name} needs {', '.join(missing)} in the pipeline; "
                                     f"switch {name} off too, or {', '.join(missing)} on")
        late = [n for n in ORDER.get(name, ()) if n in names[k + 1:]]
        if late:
            raise PipelineOrderError(f"pass {name} must run after {', '.join(late)}; put "
                                     f"{', '.join(late)} before it (pipeline.ORDER)")


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
        pipeline += [(name, getattr(passes, name)) for name in FUSION_PREP if getattr(options, name)]
        pipeline.append(("fuse_exact", passes.fuse_exact))
    if options.partition:
        pipeline.append(("shape_enumeration", passes.shape_enumeration))
        if options.lower:  # lowering needs pieces; it always comes last
            pipeline.append(("lower_guarded", passes.lower_guarded))
    check_order(pipeline)
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
        ctx.records.add(PassRun(name, result.modified, before, len(gm.graph.nodes),
                                round(seconds, 4)))
        log.debug("%s: modified=%s nodes %d -> %d in %.3fs", name, result.modified, before,
                  len(gm.graph.nodes), seconds)
    if not pipeline:
        generate_code(gm)
    return gm
