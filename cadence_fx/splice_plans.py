"""Fake values for the nodes of a copied repeated call (``splice.py``).

A copy must show the passes what a full trace would: every node's fake value with the first
call's geometry and the same storage sharing, rebased onto the new call's arguments. A *plan*,
made once from the first call, says per node where each tensor's storage comes from (an argument,
a trace input, or a storage the call itself created) and at which offset; ``Plans.build`` makes
the values for a later call straight on the meta tensors under the fakes.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental import proxy_tensor as pt
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Plans", "plans", "NO_VAL", "storage_key", "geometry"]

NO_VAL = object()   # a node without a fake value (``get_attr``, or none recorded)
_VIEW_BY_OFFSET = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
                   torch.ops.aten.set_.source_Storage_storage_offset}


def storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


class Plans:
    """How to rebuild every node's fake value for a later call: a view of an argument's or trace
    input's storage is rebased onto the new call's tensor; a storage the call created is made
    afresh, once, with its full size."""

    def __init__(self, steps, arg_offsets, pinned, pinned_by, fake_mode):
        self.steps = steps
        self.arg_offsets = arg_offsets  # argument index -> storage offset at the first call
        self.pinned = pinned            # arguments a copy needs at their first-call offset
        self.pinned_by = pinned_by      # why ("by explicit offset", "through a trace input too")
        self.fake_mode = fake_mode

    def build(self, leaves) -> list:
        # Straight on the meta tensors under the fakes, then wrapped as fakes: what fake mode does
        # for a view or an empty op, without a trip through its dispatch (most of a copy's cost).
        mode = self.fake_mode
        metas: List[Any] = []
        made: Dict[int, torch.Tensor] = {}
        with pt.disable_proxy_modes_tracing(), torch._C.DisableTorchFunction(), \
                in_kernel_invocation_manager(mode):
            for step in self.steps:
                if step is None or step[0] == "value":
                    metas.append(step)
                    continue
                _, spec, parts = step
                tensors = []
                for how, src, geom, dtype, device, nbytes in parts:
                    size, stride, offset = geom
                    if how == "fresh":
                        base = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="meta")
                        made[src] = base
                        view = base.as_strided(size, stride, offset)
                    elif how == "made":
                        view = made[src].as_strided(size, stride, offset)
                    else:  # "arg" / "input": rebased on the tensor's own offset
                        t = leaves[src[0]] if how == "arg" else src[0]
                        view = t.as_strided(size, stride, t.storage_offset() + offset)
                    tensors.append((view, device))
                metas.append((spec, tensors))
            out = []
            for m in metas:
                if m is None:
                    out.append(NO_VAL)
                elif m[0] == "value":
                    out.append(m[2])
                else:
                    spec, tensors = m
                    out.append(pytree.tree_unflatten([FakeTensor(mode, v, d) for v, d in tensors],
                                                     spec))
        return out


def plans(nodes, leaves, ext, refuse) -> Plans:
    # storage -> (kind, where, offset of the source at the first call, dtype)
    sources: Dict[Any, tuple] = {}
    arg_offsets = {}
    fake_mode = None
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            arg_offsets[i] = x.storage_offset()
            sources.setdefault(storage_key(x), ("arg", (i,), x.storage_offset(), x.dtype))
            fake_mode = fake_mode or getattr(x, "fake_mode", None)
    for a, ref in ext.items():
        if ref[0] == "input":
            t = ref[1]
            sources.setdefault(storage_key(t), ("input", (t,), t.storage_offset(), t.dtype))
            fake_mode = fake_mode or getattr(t, "fake_mode", None)
    # a view placed by explicit offset pins every argument; an argument whose storage the call
    # also reads through a trace input pins that argument (its views could come from either)
    if any(n.target in _VIEW_BY_OFFSET for n in nodes):
        pinned, pinned_by = list(arg_offsets), "by explicit offset"
    else:
        ext_inputs = {storage_key(ref[1]) for ref in ext.values() if ref[0] == "input"}
        pinned = [i for i in arg_offsets if storage_key(leaves[i]) in ext_inputs]
        pinned_by = "through a trace input too"
    steps = []
    created = 0
    for n in nodes:
        if n.op == "get_attr" or "val" not in n.meta:
            steps.append(None)
            continue
        val = n.meta["val"]
        flat, spec = pytree.tree_flatten(val)
        if not any(isinstance(v, torch.Tensor) for v in flat):
            steps.append(("value", spec, val))
            continue
        parts = []
        for v in flat:
            if not isinstance(v, torch.Tensor):
                raise refuse(f"node {n.name} mixes tensors and other values in its result")
            fake_mode = fake_mode or getattr(v, "fake_mode", None)
            s = storage_key(v)
            geom = geometry(v)
            src = sources.get(s)
            if src is None:
                sources[s] = ("made", created, 0, v.dtype)
                parts.append(("fresh", created, geom, v.dtype, v.device,
                              v.untyped_storage().nbytes()))
                created += 1
                continue
            how, where, base_offset, dtype = src
            if dtype != v.dtype:
                raise refuse(f"node {n.name} views a storage as another dtype")
            if how == "made":
                parts.append(("made", where, geom, v.dtype, v.device, 0))
            else:
                size, stride, offset = geom
                parts.append((how, where, (size, stride, offset - base_offset), v.dtype, v.device, 0))
        steps.append(("tensors", spec, parts))
    if fake_mode is None:
        raise refuse("no fake tensor among the call's values")
    return Plans(steps, arg_offsets, pinned, pinned_by, fake_mode)
