"""A window step of our own and its adapter: the last (or first) ``W`` frames of a concatenation
along dim 2, kept as the state ``{"k": ...}``, in each form streaming code writes it.

* ``Window(form)``: ``x`` through a linear layer, joined to ``cache["k"]`` (``window`` gives the
  concatenation and the kept window); the step returns a sum over the whole concatenation, plus
  the window's mean where ``reads_window`` (``window-only``: a softmax over the window alone, so
  the kept frames move first, then ``x``).
* ``window_step_adapter(order, chunk)``: the adapter of such a step, the window read from
  ``cache.k`` and returned as ``1.k``, ``chunk`` frames a call (``helpers.window_adapter``).

``tests/test_retention_forms.py`` runs every form; ``tests/test_explain_records.py`` and
``tests/test_mask_writes.py`` build on the plain append (``slice``) and ``prepend`` forms.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from cadence_fx.contract import APPEND, Adapter
from helpers import window_adapter

__all__ = ["W", "FORMS", "Window", "window_step_adapter"]

W = 6
FORMS = ["slice", "narrow", "split", "chunk", "conditional", "clone", "prepend", "window-only",
         "concat"]


class Window(nn.Module):
    """A window of the last ``W`` frames (the first, ``prepend``), kept by concatenation along
    dim 2 in one of ``FORMS``; the step reads the whole concatenation and, where
    ``reads_window``, the window."""

    def __init__(self, form: str = "slice", reads_window: bool = True):
        super().__init__()
        self.form, self.reads_window = form, reads_window
        self.lin = nn.Linear(4, 4)

    def window(self, x, cache, form: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """The concatenation of ``cache["k"]`` and this call's frames, and the window kept."""
        x = self.lin(x)
        if form == "prepend":
            full = torch.cat([x, cache["k"]], 2)
            return full, full[:, :, :W]
        # torch.concat traces as an op of its own (aten.concat)
        full = (torch.concat if form == "concat" else torch.cat)([cache["k"], x], 2)
        n = full.shape[2]
        keep = min(W, n)
        if form in ("slice", "window-only", "concat"):
            return full, full[:, :, -W:]             # a no-op slice while the window fills
        if form == "narrow":
            return full, full.narrow(2, n - keep, keep)
        if form == "split":
            return full, full.split([n - keep, keep], 2)[1]
        if form == "chunk":              # the last of two halves once the window is full
            return full, full.chunk(2, 2)[1] if n == 2 * W else full[:, :, -W:]
        if form == "conditional":
            return full, full[:, :, -W:] if n > W else full
        return full, full[:, :, -W:].clone().detach()  # a detached copy of the tail

    def forward(self, x, cache):
        full, new = self.window(x, cache, self.form)
        if self.form == "window-only":               # attention over the window: the kept frames
            return new.softmax(2).sum(2, keepdim=True), {"k": new}   # move first, then x
        y = (full * 2).sum(2, keepdim=True)
        if self.reads_window:
            y = y + new.mean(2, keepdim=True)
        return y, {"k": new}


def window_step_adapter(order: str = APPEND, chunk: int = 2, batch: int = 1,
                        name: str = "") -> Adapter:
    """The adapter of a ``Window`` step (``batch`` rows, 2 heads of 4), ``chunk`` frames a call."""
    return window_adapter(name or f"window-{order}", (batch, "heads", None, "d"), w=W, c=chunk,
                          order=order, clocks={"heads": 2, "d": 4})
