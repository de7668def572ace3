"""One switch for deterministic kernels.

Some stock paths are not reproducible against themselves: from one generator state, stock HiFT
on CUDA differs from call to call (~1e-5) through a non-deterministic kernel. Exactness claims
there are made with deterministic kernels pinned on both sides, stock and compiled.
"""
from __future__ import annotations

import logging
import os

import torch

__all__ = ["pin_deterministic_kernels"]

log = logging.getLogger(__name__)


def pin_deterministic_kernels() -> None:
    """``torch.use_deterministic_algorithms(True)``, ``cudnn.deterministic``, and cuBLAS's fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which must be set before CUDA starts)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            log.warning("CUBLAS_WORKSPACE_CONFIG set after CUDA started; cuBLAS may not honour it")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
