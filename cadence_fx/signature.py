"""What a compiled class is keyed on: the signature of every tensor leaf and the global modes a
trace bakes in. Shared by the call path, the tracer and the copier of repeated calls."""
from __future__ import annotations

import torch

__all__ = ["tensor_signature", "global_signature"]


def tensor_signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.storage_offset())


def global_signature() -> tuple:
    """Global state a trace bakes in: grad/inference mode, autocast, deterministic kernels, and
    the cuDNN and TF32 switches (which kernels run, and whether a convolution's bias is added
    after it: ``passes/fuse_exact.py`` splits it off where it is)."""
    autocast = []
    for dev in ("cpu", "cuda"):
        try:
            on = torch.is_autocast_enabled(dev)
            autocast.append((dev, on, torch.get_autocast_dtype(dev) if on else None))
        except (TypeError, RuntimeError):  # pragma: no cover - device type unknown to this build
            pass
    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast),
            torch.are_deterministic_algorithms_enabled(),
            (cudnn.enabled, cudnn.deterministic, cudnn.benchmark, _precisions()),
            (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
             cuda.cudnn_sdp_enabled()))


def _precisions() -> tuple:
    """The fp32 precision of matmuls and convolutions (TF32 or not). Read through the
    ``fp32_precision`` API, which reflects the legacy ``allow_tf32`` switches too: reading
    those after the new API was used raises."""
    b = torch.backends
    try:
        return (b.fp32_precision, b.cuda.matmul.fp32_precision, b.cudnn.fp32_precision,
                b.cudnn.conv.fp32_precision)
    except AttributeError:   # pragma: no cover - a torch without the fp32_precision API
        return (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32)
