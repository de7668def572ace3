"""Priming classes: the prompt pass of each length an adapter declares, compiled off the hot path.

A priming call hands the step no region state (a speaker's prompt, ``state=None``); its class is
keyed by the prompt's length along ``call_dim`` of ``call_input``. An adapter that declares
``prompt_lengths`` bounds these classes: ``capture_catalog`` prepares each one ahead of traffic,
and at run time

* a declared length whose class is compiled replays it;
* a declared length not compiled yet runs the stock step once, with the reason counted, while its
  class compiles in a background thread; later calls replay it;
* a length not declared runs the stock step, with the reason naming the fix.

The background compile takes the compiled step's lock (``CompiledStep._lock``) for the whole of
it: the class compiler's probationary call writes the module's buffers and rewinds the
generators, which no other call of the same step may see. Calls of that step (that lane) wait
for it; other compiled steps and other lanes go on. An adapter without ``prompt_lengths``
compiles each priming class inline at its first call, as before.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, Optional

import torch
import torch.utils._pytree as pytree

__all__ = ["Background", "is_priming"]

log = logging.getLogger(__name__)


def is_priming(cs, by_path) -> bool:
    """Whether a call hands the step no region state: the priming pass."""
    regions = cs.adapter.regions
    return bool(regions) and not any(isinstance(by_path.get(r.input), torch.Tensor)
                                     for r in regions)


def _own(t):
    """A copy at the same layout (the class key holds strides), owned by the compile."""
    if not isinstance(t, torch.Tensor):
        return t
    with torch.no_grad():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


class Background:
    """The priming classes of one compiled step that compile in background threads."""

    def __init__(self, cs):
        self.cs = cs
        self.enabled = True   # False: a declared length compiles inline at its first call
        self.pending: Dict[tuple, threading.Thread] = {}
        self.failures: Dict[tuple, str] = {}
        self._local = threading.local()

    @contextlib.contextmanager
    def inline(self):
        """Compile classes met inside this block in the calling thread (``prepare`` does)."""
        before = getattr(self._local, "on", False)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before

    def reason(self, key, named) -> Optional[str]:
        """Why this call of a class not compiled yet runs the stock step, or None to compile it
        now. Starts the background compile of a declared prompt length."""
        ad = self.cs.adapter
        (extents, width) = key[0]
        if not ad.prompt_lengths or any(e is not None for e in extents) \
                or getattr(self._local, "on", False):
            return None
        widths = ad.prompt_widths()
        if width not in widths:
            return (f"prompt length {width} is not among the prompt lengths adapter {ad.name!r} "
                    f"declares ({_span(widths)}): the priming pass runs stock; add {width} to "
                    "the adapter's `prompt_lengths` (capture_catalog then prepares it)")
        if not self.enabled:
            return None
        if key not in self.pending:
            owned = pytree.tree_map(_own, named)
            thread = threading.Thread(target=self._compile, args=(key, owned), daemon=True,
                                      name=f"cadence-prime-{width}")
            self.pending[key] = thread
            thread.start()
        return (f"the priming class for prompt length {width} is compiling in the background; "
                "this call runs the stock step (call capture_catalog at start-up to prepare it)")

    def _compile(self, key, named) -> None:
        from .prepare import prepare
        cs = self.cs
        try:
            with cs.lock, _modes(key[2]):
                if cs.store.knows(key):
                    return
                compiled = prepare(cs, (), named)
                cs.counters.background_compiles += 1
                log.info("priming class %s compiled in the background (%s)", key[0],
                         "compiled" if compiled else f"stock: {cs.store.verdict(key)}")
        except Exception as e:  # noqa: BLE001 - the length keeps running stock, with the reason
            why = f"its background compile failed: {type(e).__name__}: {e}"
            log.warning("priming class %s: %s", key[0], why)
            with cs.lock:
                self.failures[key] = why
                cs.store.reject(key, why, keep=True)
        finally:
            self.pending.pop(key, None)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Join the background compiles; whether none is still running."""
        for thread in list(self.pending.values()):
            thread.join(timeout)
        return not self.pending


@contextlib.contextmanager
def _modes(signature):
    """The calling thread's grad, inference and autocast modes (thread-local in torch, and part
    of every class key: ``signature.global_signature``) in the background thread."""
    grad, inference, autocast = signature[:3]
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
        for device, on, dtype in autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=on))
        yield


def _span(widths) -> str:
    if len(widths) > 6:
        return f"{widths[0]}, {widths[1]}, ..., {widths[-1]}"
    return ", ".join(map(str, widths))
