"""Error classes. Each message names the declaration, clock or region at fault and the fix."""

__all__ = ["CadenceError", "ContractError", "TraceError", "ShadowMismatch", "GuardError"]


class CadenceError(Exception):
    """Base class of every error cadence_fx raises on purpose."""


class ContractError(CadenceError, ValueError):
    """An adapter's declarations are inconsistent, or contradict what the traced model does."""


class TraceError(CadenceError):
    """The step could not be traced into an FX graph at a catalog signature."""


class ShadowMismatch(CadenceError, AssertionError):
    """verify mode: a carry write differs from the stock concatenation it replaces."""


class GuardError(CadenceError):
    """strict mode: a call would have fallen back to eager."""
