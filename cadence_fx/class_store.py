"""The class store: what one compiled step knows about each signature class it has met.

A class (its key: extents and width, the full signature, the global modes) is either compiled,
with its ``ClassEntry`` (``class_compiler.py``) that the call path runs, or runs the stock step,
with the reason (its *verdict*). Beside them the store keeps the traces: shared with other steps
of the same module and step function (``trace_cache``), else kept as traced for the report's
before/after view (``keep_before``), and those traced here that the compile cache has not stored
yet; between the lanes of one pool (``lanes.py``), each compiled class as frozen for the compile
cache (``stored_class.freeze``, pickled), which a lane thaws instead of tracing, running the passes
and the probationary call again. The class compiler fills the store, the call path, preparation,
priming and the report read it; every one of them through these methods.

It does not compile, trace or run anything, and it holds no tensors of its own beyond the traces.
"""
from __future__ import annotations

import types
from typing import Callable, Dict, Mapping, Optional, Tuple

__all__ = ["ClassStore"]


class ClassStore:
    """The classes of one compiled step (of ``module``'s step function ``fn``), by class key."""

    def __init__(self, module, fn: Callable, *, trace_cache: Optional[dict] = None,
                 keep_before: bool = True, class_cache: Optional[dict] = None):
        self._entries: Dict[Tuple, object] = {}    # class key -> its ClassEntry
        self._verdicts: Dict[Tuple, str] = {}      # class key -> why it runs the stock step
        self._unstored: Dict[Tuple, object] = {}   # traces not yet in the compile cache
        self._before: Dict[Tuple, object] = {}     # class key -> its trace before the passes
        self._shared = trace_cache                 # shared between compiled steps, if given
        # class key -> the class frozen and pickled, shared by steps of one adapter and config
        self._classes = class_cache
        self._keep_before = keep_before
        # a shared trace cache holds several steps' traces: each keyed by module and function
        self._owner = (id(module), getattr(fn, "__func__", fn))
        self._warned: set = set()                  # what was warned about once

    # -- compiled classes -----------------------------------------------------------------------
    @property
    def entries(self) -> Mapping[Tuple, object]:
        """The compiled classes, ``{class key: ClassEntry}`` (read-only)."""
        return types.MappingProxyType(self._entries)

    def entry(self, key) -> Optional[object]:
        return self._entries.get(key)

    def add(self, entry) -> None:
        self._entries[entry.key] = entry

    def forget(self, key) -> None:
        """The class is compiled again at its next call (its entry dropped)."""
        self._entries.pop(key, None)

    # -- stock verdicts -------------------------------------------------------------------------
    @property
    def verdicts(self) -> Mapping[Tuple, str]:
        """The classes that run the stock step, ``{class key: reason}`` (read-only)."""
        return types.MappingProxyType(self._verdicts)

    def verdict(self, key) -> Optional[str]:
        """Why the class ``key`` runs the stock step; None when it does not (or is not known)."""
        return self._verdicts.get(key)

    def reject(self, key, reason: str, *, keep: bool = False) -> None:
        """The class runs the stock step, with ``reason``; ``keep``: unless it has a verdict."""
        if keep:
            self._verdicts.setdefault(key, reason)
        else:
            self._verdicts[key] = reason

    def knows(self, key) -> bool:
        """Whether the class is compiled or has a verdict."""
        return key in self._entries or key in self._verdicts

    def met(self) -> int:
        """How many classes the step has met: compiled or running stock."""
        return len(self._entries) + len(self._verdicts)

    # -- traces ---------------------------------------------------------------------------------
    @property
    def before(self) -> Mapping[Tuple, object]:
        """Each class's trace before the passes, when kept for the report (read-only)."""
        return types.MappingProxyType(self._before)

    def shared_trace(self, key):
        """Another step's (or this one's) trace of the class, from the shared trace cache."""
        return None if self._shared is None else self._shared.get((*self._owner, key))

    def trace_before(self, key):
        """The class's trace before the passes, kept for the report or shared; None if neither."""
        kept = self._before.get(key)
        return kept if kept is not None else self.shared_trace(key)

    def keeps_traces(self) -> bool:
        """Whether a class's trace is kept (shared, or for the report) before the passes run."""
        return self._shared is not None or self._keep_before

    def keep_trace(self, key, traced) -> None:
        """Keep ``traced`` (a copy the passes will not rewrite): shared, else for the report."""
        if self._shared is not None:
            self._shared[(*self._owner, key)] = traced
        elif self._keep_before:
            self._before[key] = traced

    def share_traces(self) -> dict:
        """Share this step's traces from now on (``lanes.py``): the trace cache (made if the
        step had none), holding the traces kept before sharing began."""
        if self._shared is None:
            self._shared = {}
        for key, traced in self._before.items():
            self._shared.setdefault((*self._owner, key), traced)
        return self._shared

    # -- compiled classes shared between lanes --------------------------------------------------
    def share_classes(self) -> dict:
        """Share this step's compiled classes from now on (``lanes.py``): every class compiled
        after this is frozen into the returned dict, which the lanes' stores read. Only steps of
        the same module, step function, adapter and options may read it: the rewritten graph
        depends on all of them (a trace depends on the first two only)."""
        if self._classes is None:
            self._classes = {}
        return self._classes

    def shares_classes(self) -> bool:
        return self._classes is not None

    def shared_class(self, key) -> Optional[bytes]:
        """The class as another lane (or this step) froze it; None when no lane compiled it."""
        return None if self._classes is None else self._classes.get(key)

    def share_class(self, key, frozen: bytes) -> None:
        self._classes[key] = frozen

    def unshare_class(self, key) -> None:
        """A frozen class that did not load here: the next lane compiles it itself."""
        if self._classes is not None:
            self._classes.pop(key, None)

    def hold_unstored(self, key, traced) -> None:
        """A trace made here, stored in the compile cache once its class is compiled."""
        self._unstored[key] = traced

    def take_unstored(self, key):
        """The trace held for the compile cache, if any, no longer held."""
        return self._unstored.pop(key, None)

    # -- the rest -------------------------------------------------------------------------------
    def warn_once(self, what) -> bool:
        """True the first time ``what`` is asked about: a warning that is given once."""
        if what in self._warned:
            return False
        self._warned.add(what)
        return True

    def clear(self) -> None:
        """Forget every class and the traces held for the compile cache (``close``)."""
        self._entries.clear()
        self._verdicts.clear()
        self._unstored.clear()
