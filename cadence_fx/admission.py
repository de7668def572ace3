"""Admission and absorption: what a call must satisfy before a compiled class runs it.

Admission (§3.3): every region's frame extent is in its catalog, the extents occur together in the
joint catalog, and the call's frame width is declared or passes the adapter's admission predicate;
otherwise the call runs stock, with the reason. Bad input is refused with a ``ContractError``
naming the fix: state on another device than the weights, state of a float width neither declared
nor the weights', state whose shape contradicts the declaration.

Absorption (§3.2, copy-on-write prompt state): a region input that is not already the leading view
of its carry -- the first call, a turn reset restoring the prompt state -- is copied into the carry
once; the caller's tensor is never written. From then on the step's state *is* ``carry[..., :e]``.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

from .catalog import Catalog
from .context import Carry
from .contract import Adapter, Region
from .counters import Counters
from .errors import ContractError, GuardError

__all__ = ["Admission"]

log = logging.getLogger(__name__)


class Admission:
    """The adapter's declarations, precomputed for the per-call checks."""

    def __init__(self, adapter: Adapter, catalog: Catalog, params: Dict[str, torch.Tensor], *,
                 strict: bool = False):
        self.adapter = adapter
        self.catalog = catalog
        devices = {p.device for p in params.values()}
        self._weights_device = devices.pop() if len(devices) == 1 else None  # checked when one
        dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
        self._weights_dtype = dtypes.pop() if len(dtypes) == 1 else None     # likewise
        # (what, path, declared element width or None): checked on every call
        self._placement_checked = [(f"region {r.name!r} state", r.input, r.element_bytes)
                                   for r in adapter.regions]
        if adapter.call_input is not None:
            self._placement_checked.append(("call input", adapter.call_input, None))
        self._extents = {r.name: set(catalog.region(r.name).extents) for r in adapter.regions}
        self._classes_ok = {e for e, _ in catalog.classes}
        self._declared = {r.name: [None if i == r.dim else adapter.dim_size(d, r)
                                   for i, d in enumerate(r.shape)] for r in adapter.regions}
        self.excluded: Optional[str] = None  # Criterion 3.5: a catalog too wide to specialise
        wide = [r for r in catalog.regions if not r.admissible]
        if wide:
            self.excluded = "; ".join(
                f"region {r.name!r} has K = {r.K} signature classes, over the width limit "
                f"{adapter.width_limit} (Criterion 3.5)" for r in wide) + ": the step runs stock"
            if strict:
                raise GuardError(f"strict mode: {self.excluded}")
            log.warning("%s", self.excluded)

    # -- admission ------------------------------------------------------------------------
    def reason(self, by_path, carries: Dict[str, Carry]) -> Optional[str]:
        """Why this call cannot run a compiled class, or None when it is admitted."""
        if self.excluded:
            return self.excluded
        extents = []
        for r in self.adapter.regions:
            t = by_path.get(r.input)
            if not isinstance(t, torch.Tensor):
                return f"region {r.name!r} has no input state (priming pass): eager by construction"
            self._check_declared_shape(r, t, carries.get(r.name))
            e = t.shape[r.dim]
            if e not in self._extents[r.name]:
                return (f"region {r.name!r} extent {e} is not in the catalog "
                        f"{sorted(self._extents[r.name])} derived from its retention clocks")
            extents.append(e)
        if tuple(extents) not in self._classes_ok:
            return f"region extents {tuple(extents)} never occur together in the catalog"
        ad = self.adapter
        if ad.call_input is not None:
            x = by_path.get(ad.call_input)
            if not isinstance(x, torch.Tensor):
                return f"call input {ad.call_input!r} is missing"
            w = x.shape[ad.call_dim]
            if not ad.admits(w):
                bound = (f"admission {ad.admission} = {ad.clocks[ad.admission]}" if ad.admission
                         else "no admission clock")
                return (f"call width {w} is neither a declared call width "
                        f"{list(ad.call_widths())} nor admitted ({bound})")
        return None

    def check_placement(self, by_path) -> None:
        """Region state and the call input must sit where the step's weights are. Floating region
        state whose element width contradicts both the region's declared ``element_bytes`` and the
        dtype every floating weight has is refused too (a float64 cache for float32 weights):
        a carry could never hold it, and the stock step would fail deep inside."""
        device, dtype = self._weights_device, self._weights_dtype
        for what, path, width in self._placement_checked:
            t = by_path.get(path)
            if not isinstance(t, torch.Tensor):
                continue
            if device is not None and t.device != device:
                raise ContractError(
                    f"{what} {path!r} is on {t.device}, but the step's weights are on "
                    f"{device}; move it with .to({str(device)!r})")
            if (width is not None and dtype is not None and t.dtype != dtype
                    and t.is_floating_point() and t.element_size() != width):
                raise ContractError(
                    f"{what} {path!r} is {t.dtype} ({t.element_size()}-byte elements), but the "
                    f"region declares element_bytes={width} and the step's weights are {dtype}; "
                    f"cast it with .to({dtype})")

    def _check_declared_shape(self, r: Region, t: torch.Tensor, carry: Optional[Carry]) -> None:
        """The state must have the declared shape outside the frame dim. Stock code may reserve
        more rows than it ever writes (Token2Wav's 16 solver-step slots for 10 steps): larger dims
        are accepted when the rows beyond the declaration hold zeros; absorption drops them."""
        if not r.shape or (carry is not None and carry.holds(t)):
            return
        want = self._declared[r.name]
        got = list(t.shape)
        bad = len(got) != len(want) or any(w is not None and w > g for w, g in zip(want, got))
        if not bad:
            for i, (w, g) in enumerate(zip(want, got)):
                if w is not None and g > w and t.narrow(i, w, g - w).any():
                    bad = True
        if bad:
            raise ContractError(
                f"region {r.name!r} of adapter {self.adapter.name!r} declares shape "
                f"{tuple('frames' if w is None else w for w in want)} but the step received "
                f"{tuple(got)} at {r.input!r}; fix the region's shape clocks")

    # -- absorption -----------------------------------------------------------------------
    def absorb(self, r: Region, t: torch.Tensor, carries: Dict[str, Carry],
               counters: Counters) -> torch.Tensor:
        """``t`` as the leading view of the region's carry (allocated on first sight at the
        declared extent), copying it in unless it already is that view."""
        carry = carries.get(r.name)
        if carry is None:
            shape = [self.adapter.dim_size(d, r) for d in r.shape] if r.shape else list(t.shape)
            shape[r.dim] = self.catalog.region(r.name).declared_extent
            with torch.no_grad():
                carry = Carry(r, torch.zeros(shape, dtype=t.dtype, device=t.device))
            carries[r.name] = carry
        frames = t.shape[r.dim]
        if carry.holds(t):
            return carry.view(frames)
        if t.device != carry.tensor.device or t.dtype != carry.tensor.dtype:
            raise ContractError(f"region {r.name!r}: state arrived as {t.dtype} on {t.device}, but "
                                f"its carry is {carry.tensor.dtype} on {carry.tensor.device}")
        src = t
        for i, size in enumerate(carry.tensor.shape):
            if i != r.dim and src.shape[i] > size:  # undeclared rows, checked to be zero
                src = src.narrow(i, 0, size)
        with torch.no_grad():
            if src.untyped_storage().data_ptr() == carry.tensor.untyped_storage().data_ptr():
                src = src.clone()
            carry.view(frames).copy_(src)
        counters.absorptions += 1
        return carry.view(frames)
