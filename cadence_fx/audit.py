"""The shadow auditor (paper §3.6): in verify mode every carry write is compared with the stock
value it replaces, elementwise and by layout (stride order: the next call's reads of a state in
another layout may give other bits), and a mismatch raises with the region and the call index.
The carry pass puts the comparison in the graph (``check_carry_write`` in ``passes/specs.py``)
on the ``Auditor`` the compiled step hands it."""
from __future__ import annotations

import collections
import logging

import torch

from .errors import ShadowMismatch
from .layouts import describe, stride_order

__all__ = ["Auditor"]

log = logging.getLogger(__name__)


class Auditor:
    def __init__(self):
        self.call_index = 0
        self.comparisons = collections.Counter()  # region -> compared writes

    def check(self, region: str, kind: str, stock: torch.Tensor, carry: torch.Tensor) -> None:
        self.comparisons[region] += 1
        if stock.shape == carry.shape and torch.equal(stock, carry):
            if stride_order(stock) != stride_order(carry):
                raise ShadowMismatch(
                    f"verify: the {kind} write of region {region!r} has the stock bits but not "
                    f"its layout at call {self.call_index}: stock returns {describe(stock)}, the "
                    f"carry hands out {describe(carry)}; return {region!r} in one layout from "
                    "every call (e.g. `.contiguous()` on it)")
            return
        detail = (f"shapes {tuple(stock.shape)} vs {tuple(carry.shape)}" if stock.shape != carry.shape
                  else f"max |diff| {(stock.double() - carry.double()).abs().max().item():.3g}")
        raise ShadowMismatch(
            f"verify: the {kind} write of region {region!r} differs from the stock concatenation at "
            f"call {self.call_index} ({detail}); the region's ordering or retention clocks do not "
            "match the model's cache layout")
