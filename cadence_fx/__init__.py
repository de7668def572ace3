"""cadence_fx: exact state and exact-shape replay for streaming speech models, from declared clocks."""
# The driver's launch queue keeps its default size: CUDA_SCALE_LAUNCH_QUEUES=4x, which
# ``import cadence_fx`` once set, failed the 3-lane Token2Wav catalog's captures on the H200
# ("unspecified launch failure", driver 580.159.04, CUDA 13.0) where the default size ran them
# (docs/sessions.md, Lanes).
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
