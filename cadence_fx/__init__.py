"""cadence_fx: exact state and exact-shape replay for streaming speech models, from declared clocks."""
from .catalog import Catalog, build_catalog
from .determinism import pin_deterministic_kernels
from .contract import APPEND, PREPEND, Adapter, Effects, PromptRetained, Region, Ring, SlidingWindow
from .errors import CadenceError, ContractError, GuardError, ShadowMismatch, TraceError

__all__ = ["compile", "CompiledStep", "SessionPool", "Adapter", "Region", "PromptRetained", "Ring", "SlidingWindow",
           "Effects", "PREPEND", "APPEND", "build_catalog", "Catalog", "CadenceError",
           "ContractError", "TraceError", "ShadowMismatch", "GuardError", "pin_deterministic_kernels"]

__version__ = "0.1.0"


def __getattr__(name):  # the runtime pulls in torch.fx machinery; load it on first use
    if name in ("compile", "CompiledStep"):
        from . import runtime
        return getattr(runtime, name)
    if name == "SessionPool":
        from .sessions import SessionPool
        return SessionPool
    raise AttributeError(name)
