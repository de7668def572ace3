"""Effect classification (paper §3.4 (iii)): watch random generators around a probationary call,
then rewind them so the probe is invisible.

Host randomness drawn in Python (``random``, NumPy) is frozen into a trace as a constant, so a
class whose step reads it is rejected for good. Draws from torch generators are ops in the graph:
device (Philox) draws are admitted -- a replay draws exactly what eager would at the same
generator state -- and CPU-generator draws inside a device step stay in eager pieces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Dict, Iterable, List, Optional

import torch

__all__ = ["RngSnapshot", "TensorSnapshot", "Effects", "drawing_from"]

try:  # NumPy is optional: only watched when present
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None


@dataclasses.dataclass
class Effects:
    host: List[str]        # host generators the call advanced ("python random", "numpy")
    torch_cpu: bool        # torch's CPU generator advanced
    device: bool           # a CUDA generator advanced

    @property
    def host_reason(self) -> Optional[str]:
        if not self.host:
            return None
        return (f"host randomness ({', '.join(self.host)}): a trace would freeze the draws as "
                "constants, so this class runs the stock step; draw with torch on the step's "
                "device instead (device randomness is replayed exactly)")


@contextlib.contextmanager
def drawing_from(generator: Optional[torch.Generator]):
    """The device's default generator draws from ``generator``'s state meanwhile (None: from its
    own). A CUDA graph captured meanwhile registers that state: every replay reads the seed and
    offset from that state's own device holder and advances that state, whatever the default
    generator holds at the time. A pool lane drawing randomness captures and runs under a state
    of its own (``Lane.generator``), so its replays never share a holder with another lane's.
    Swaps the process's generator: hold ``cudagraphs.GLOBAL_STATE`` (or the pool's draw lock)."""
    if generator is None:
        yield
        return
    default = torch.cuda.default_generators[generator.device.index or 0]
    outside = default.graphsafe_get_state()
    default.graphsafe_set_state(generator)
    try:
        yield
    finally:
        default.graphsafe_set_state(outside)


class RngSnapshot:
    """Every generator's state, comparable and restorable."""

    def __init__(self):
        self.python = random.getstate()
        self.numpy = _np.random.get_state() if _np is not None else None
        self.torch_cpu = torch.get_rng_state()
        self.cuda = ([torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
                     if torch.cuda.is_available() and torch.cuda.is_initialized() else [])

    def effects(self) -> Effects:
        now = RngSnapshot()
        host = []
        if now.python != self.python:
            host.append("python random")
        if self.numpy is not None and not _same_numpy(now.numpy, self.numpy):
            host.append("numpy")
        device = any(not torch.equal(a, b) for a, b in zip(now.cuda, self.cuda))
        return Effects(host=host, torch_cpu=not torch.equal(now.torch_cpu, self.torch_cpu),
                       device=device)

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            _np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        for i, state in enumerate(self.cuda):
            torch.cuda.set_rng_state(state, i)


def _same_numpy(a, b) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and a[2:] == b[2:]


HOST_SNAPSHOT_BYTES = 1 << 20   # device tensors larger than this are saved in pinned host memory


class TensorSnapshot:
    """Copies of tensors a probe may write, put back afterwards (values only; addresses stay).

    A device tensor over ``HOST_SNAPSHOT_BYTES`` is copied to pinned host memory rather than
    cloned on the device: the snapshots of a compile (the probationary call's, each warm-up's)
    cover every carry and written buffer, gigabytes for a 7B LM's KV cache, and device clones of
    them would set the process's peak memory. The copies are asynchronous on the current stream,
    ordered before anything the probe runs on it (or on a stream that waits on it)."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        seen: Dict[int, torch.Tensor] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen[id(t)] = t
        with torch.no_grad():
            self.saved = [(t, _saved_copy(t.detach())) for t in seen.values()]

    def restore(self) -> None:
        with torch.no_grad():
            for t, copy in self.saved:
                t.copy_(copy, non_blocking=copy.device != t.device)


def _saved_copy(t: torch.Tensor) -> torch.Tensor:
    if t.is_cuda and t.numel() * t.element_size() > HOST_SNAPSHOT_BYTES:
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return t.clone()
