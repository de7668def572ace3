"""What the class compiler learns by running or reading the stock step: the probationary call
that classifies a class's effects (§3.4 (iii)), the inputs its graph writes, and the backend its
pieces lower to (CUDA graphs when the call or the weights are on CUDA).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from .effects import RngSnapshot, TensorSnapshot
from .errors import ContractError
from .passes.fx_utils import mutated_attributes, written_bases
from .replay import EagerBackend
from .tracing import InputSpec, TracedStep, leaves_with_paths

__all__ = ["probe_effects", "choose_backend", "written_inputs"]


def probe_effects(cs, traced: TracedStep, named) -> Optional[str]:
    """The probationary eager call (§3.4 (iii)): run the stock step once, watching every
    generator, then put back generators and everything the step writes. On the backend's side
    stream, where the warm-ups and captures run: a second stream would hold BLAS workspaces of
    its own for the life of the process."""
    leaves = dict(leaves_with_paths(named)[0])
    written = [cs.tensors.buffers[s.name] if s.kind == "buffer" else leaves[s.name]
               for s in written_inputs(traced.gm, traced.inputs) if s.kind in ("buffer", "arg")]
    written += [c.tensor for c in cs.carries.values()]
    written += mutated_attributes(traced.gm)  # module state in plain tensor attributes
    state, rng = TensorSnapshot(written), RngSnapshot()
    try:
        with torch.no_grad(), getattr(cs.backend, "side_stream", contextlib.nullcontext)():
            cs.fn(**named)
    finally:
        effects = rng.effects()
        state.restore()
        rng.restore()
    _check_declared_randomness(cs, effects, _on_cuda(cs, named))
    return effects.host_reason


def _check_declared_randomness(cs, effects, on_cuda: bool) -> None:
    """A step that draws from its device's torch generator must say so (``Effects(device_rng=
    True)``): a ``SessionPool`` gives each session its own generator state only then. Undeclared,
    its sessions would draw from one shared state, each differing from itself run alone."""
    drew = effects.device if on_cuda else effects.torch_cpu
    if drew and not cs.adapter.effects.device_rng:
        where = "a CUDA generator" if on_cuda else "torch's CPU generator"
        raise ContractError(
            f"adapter {cs.adapter.name!r} declares no device randomness, but its step "
            f"({type(cs.module).__name__}) drew from {where} in its probationary call: declare "
            "effects=Effects(device_rng=True) in the adapter (each session then draws from its "
            "own generator state)")


def _on_cuda(cs, named) -> bool:
    """Whether the call or the weights are on CUDA."""
    return (any(isinstance(v, torch.Tensor) and v.is_cuda for _, v in leaves_with_paths(named)[0])
            or cs.tensors.on_cuda())


def choose_backend(cs, named):
    """CUDA graphs when the call or the weights are on CUDA and graphs are on, else guarded eager."""
    on_cuda = _on_cuda(cs, named)
    if cs.config.graphs and on_cuda:
        from .cudagraphs import CudaGraphBackend
        return CudaGraphBackend(copy_outputs=cs.config.copy_outputs, generator=cs.generator)
    return EagerBackend()


def written_inputs(gm: torch.fx.GraphModule, inputs: List[InputSpec]) -> List[InputSpec]:
    """The inputs (by spec) whose storage the graph writes in place."""
    written = set(written_bases(gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [spec for n, spec in zip(placeholders, inputs) if n in written]
