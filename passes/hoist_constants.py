"""Device-resident constants: input-independent subgraphs are evaluated once and held on the device.

Case handled -- the DiT timestep frequency table, built on the host and copied over on every call::

    arange = aten.arange.start(0, 128, device=cpu)          # before
    freqs = aten._to_copy(aten.exp(arange * c / 128), device=cuda)
    args = aten.mul(t, freqs)

    args = aten.mul(t, self._cadence_const_0)               # after: computed once, on the device

A host-to-device copy cannot be captured in a CUDA graph, so hoisting it is what makes the rest of
the chunk capturable. The constant is computed by running the very same aten ops once, so its
value is the stock value bit for bit.

Sources: factories (``arange``), literals (``torch.tensor([...])``) and tensor attributes the adapter
declares constant (``Adapter.constants``, e.g. HiFT's ``stft_window``, copied to the device on
every stock call). Not hoisted: anything reading a placeholder (parameters and buffers included:
the user may update them) or undeclared module state in tensor attributes, random draws, mutated tensors and their views, values returned by the step (the caller may
mutate them), and constants over ``max_bytes``. Invariant: outputs unchanged; fewer nodes per call.
"""
from __future__ import annotations

import operator
from typing import Dict, Set

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .records import HoistedConstant
from .fx_utils import (SIDE_EFFECTS, attr_value, dead_code_elimination, is_mutating,
                                 mutated_arg, storage_key)

__all__ = ["hoist_constants"]

MAX_BYTES = 64 << 20


def hoist_constants(gm: GraphModule, ctx: PassContext, max_bytes: int = MAX_BYTES) -> PassResult:
    # Storages that are written in place, or handed to the caller, are never constant: a shared
    # hoisted tensor would carry the writes over to the next call, or to the caller.
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    unsafe = {storage_key(n) for n in output.all_input_nodes}
    unsafe.update(storage_key(mutated_arg(n)) for n in gm.graph.nodes
                  if is_mutating(n) and not _metadata_only(n) and mutated_arg(n) is not None)
    unsafe.discard(None)
    const: Set[Node] = set()
    mode_depth = 0  # inside an autocast block of the step: evaluating it later would lose the mode
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            mode_depth += 1
        elif n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast:
            mode_depth -= 1
        elif n.op == "get_attr" and (_literal(n) or id(attr_value(gm, n.target)) in ctx.constant_ids):
            const.add(n)
        elif (n.op == "call_function" and mode_depth == 0 and _pure(n)
              and storage_key(n) not in unsafe and all(a in const for a in n.all_input_nodes)):
            const.add(n)
    frontier = [n for n in gm.graph.nodes if n in const and n.op == "call_function"
                and any(u not in const for u in n.users)]
    if not frontier:
        return PassResult(gm, False)
    values: Dict[Node, object] = {}
    for n in gm.graph.nodes:  # evaluate, in graph order, only what the frontier needs
        if n in const and n.op == "get_attr":
            values[n] = attr_value(gm, n.target)
        elif n in const:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: values[a])
            values[n] = n.target(*args, **kwargs)
    hoisted = 0
    for n in frontier:
        v = values[n]
        if not isinstance(v, torch.Tensor) or v.numel() * v.element_size() > max_bytes:
            continue
        name = f"_cadence_const_{len(ctx.records.constants)}"
        gm.register_buffer(name, v.detach(), persistent=False)
        with gm.graph.inserting_before(n):
            attr = gm.graph.get_attr(name)
        attr.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(attr)
        ctx.records.add(HoistedConstant(name, tuple(v.shape), str(v.dtype), str(v.device),
                                        _crosses_devices(n), n.name))
        hoisted += 1
    dead_code_elimination(gm.graph)
    return PassResult(gm, hoisted > 0)


def _literal(n: Node) -> bool:
    """A tensor written in the step's code (``torch.tensor([...])``), which the trace copies fresh
    on every call, or a constant this pass made. Other attributes are module state: the step or
    its owner may change them between calls, so nothing computed from them is constant."""
    if n.target.startswith("_cadence_const_"):
        return True
    return bool(n.users) and all(u.target is torch.ops.aten.lift_fresh_copy.default for u in n.users)


def _pure(n: Node) -> bool:
    t = n.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t in SIDE_EFFECTS:
        return False
    if is_mutating(n) and not _metadata_only(n):
        return False
    tags = t.tags
    return not (torch.Tag.nondeterministic_seeded in tags or torch.Tag.dynamic_output_shape in tags
                or torch.Tag.data_dependent_output in tags)


def _metadata_only(n: Node) -> bool:
    """In-place view ops (``detach_``, ``t_``) change a tensor's metadata, not its data; a
    pre-dispatch trace of ``torch.tensor([...])`` ends in one."""
    return torch.Tag.inplace_view in getattr(n.target, "tags", ())


def _crosses_devices(node: Node) -> bool:
    """Does the subgraph behind ``node`` copy a host tensor to another device?"""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v, src = n.meta.get("val"), [a.meta.get("val") for a in n.all_input_nodes]
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.Tensor) and s.device != v.device
                                               for s in src):
            return True
        stack.extend(n.all_input_nodes)
    return False
