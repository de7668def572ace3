"""Ahead of traffic: compile (and on CUDA capture) classes before the first chunk arrives.

``prepare`` compiles the class of one example call; ``capture_catalog`` re-cuts one example to every
class of the catalog and prepares each (each class's time goes to ``cadence_fx.progress``).
Neither is traffic: carries, private buffers, arguments, generators and counters are left exactly
as they were.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Dict, Tuple

import torch
import torch.utils._pytree as pytree

from . import progress
from .effects import RngSnapshot, TensorSnapshot
from .tracing import bind_arguments, leaves_with_paths

__all__ = ["prepare", "capture_catalog"]


def prepare(cs, args, kwargs) -> bool:
    """Trace and capture the class of this call to the compiled step ``cs``, leaving every carry, buffer, argument and
    generator as it was. Returns whether the class is compiled."""
    snapshot = TensorSnapshot([c.tensor for c in cs.carries.values()] + list(cs._private.values()))
    rng, counters = RngSnapshot(), copy.deepcopy(cs.counters)
    handed_out = {name: c.handed_out for name, c in cs.carries.items()}
    entry = None
    # an example is not the stream's state: it is copied into the carries, never taken over
    donate, cs.donate_state = cs.donate_state, False
    try:
        entry, by_path, _ = cs._select(args, kwargs)
        if entry is not None:
            written = TensorSnapshot(
                [v for v in by_path.values() if isinstance(v, torch.Tensor)]
                + [c.tensor for c in cs.carries.values()] + list(cs._private.values()))
            try:
                cs._run(entry, by_path)
            finally:
                written.restore()
    finally:
        cs.donate_state = donate
        snapshot.restore()
        rng.restore()
        for f in dataclasses.fields(counters):  # preparing is not traffic: counters stay put
            setattr(cs.counters, f.name, getattr(counters, f.name))
        for name, c in cs.carries.items():      # nor is what it handed out
            c.handed_out = handed_out.get(name)
    return entry is not None


def capture_catalog(cs, args, kwargs) -> Dict[Tuple, bool]:
    """Compile every class of the catalog from one example call (see
    ``CompiledStep.capture_catalog``). Returns ``{(extents, width): compiled}``."""
    named = bind_arguments(cs._arguments, args, kwargs)
    if cs.admission.excluded:   # Criterion 3.5: every class runs stock, none is prepared (re-cut
        return dict.fromkeys(cs.catalog.classes, False)   # examples would span the whole window)
    by_path = dict(leaves_with_paths(named)[0])
    ad = cs.adapter
    x = by_path.get(ad.call_input) if ad.call_input else None
    width = x.shape[ad.call_dim] if isinstance(x, torch.Tensor) else None
    regions = {r.input for r in ad.regions}
    done = {}
    for i, (extents, w) in enumerate(cs.catalog.classes):
        start = time.perf_counter()
        synth = dict(by_path)
        for r, e in zip(ad.regions, extents):
            t = by_path.get(r.input)
            if isinstance(t, torch.Tensor):
                size = list(t.shape)
                size[r.dim] = e
                synth[r.input] = torch.zeros(size, dtype=t.dtype, device=t.device)
        if width is not None:
            for path, t in by_path.items():
                if (isinstance(t, torch.Tensor) and path not in regions
                        and -t.dim() <= ad.call_dim < t.dim() and t.shape[ad.call_dim] == width):
                    size = list(t.shape)
                    size[ad.call_dim] = w
                    synth[path] = torch.zeros(size, dtype=t.dtype, device=t.device)
        done[(extents, w)] = prepare(cs, (), _replace_leaves(named, synth))
        progress.note("class %d/%d %s: %s in %.1f s", i + 1, len(cs.catalog.classes),
                      (extents, w), "ready" if done[(extents, w)] else "not prepared",
                      time.perf_counter() - start)
    return done


def _replace_leaves(named, by_path):
    leaves, spec = leaves_with_paths(named)
    return pytree.tree_unflatten([by_path.get(p, v) for p, v in leaves], spec)
