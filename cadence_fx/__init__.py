"""cadence_fx: exact state and exact-shape replay for streaming speech models, from declared clocks."""
import os

# A compiled chunk is one device graph of thousands of kernels (the Token2Wav flow's: 8,373). The
# driver's default launch queue fills while it is queued, and the launching thread then waits for
# the device: on the H200 a 64 ms flow + HiFT chunk kept its thread 31 ms in "Command Buffer Full"
# (bench/results/2026-12-02-h200-host-profile-23dccee.json), so lanes queued from one thread
# could not overlap. The driver reads CUDA_SCALE_LAUNCH_QUEUES once, when it creates the context,
# so it is set here, before torch touches CUDA, unless it is set already (docs/sessions.md, Lanes).
# It sizes the queue only: the kernels, their order and their results are the same.
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")
from .catalog import Catalog, build_catalog
from .contract import APPEND, PREPEND, Adapter, Effects, PromptRetained, Region, Ring, SlidingWindow
from .errors import CadenceError, ContractError, GuardError, ShadowMismatch, TraceError

__all__ = ["compile", "CompiledStep", "SessionPool", "Adapter", "Region", "PromptRetained", "Ring", "SlidingWindow",
           "Effects", "PREPEND", "APPEND", "build_catalog", "Catalog", "CadenceError",
           "ContractError", "TraceError", "ShadowMismatch", "GuardError", "pin_deterministic_kernels"]

__version__ = "0.1.0"


def __getattr__(name):  # torch and the runtime load on first use (`cadence-fx --help` needs neither)
    if name == "pin_deterministic_kernels":
        from .determinism import pin_deterministic_kernels
        return pin_deterministic_kernels
    if name in ("compile", "CompiledStep"):
        from . import runtime
        return getattr(runtime, name)
    if name == "SessionPool":
        from .sessions import SessionPool
        return SessionPool
    raise AttributeError(name)
