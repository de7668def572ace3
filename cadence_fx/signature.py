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
    cudnn = torch.backends.cudnn
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast),
            torch.are_deterministic_algorithms_enabled(),
            (cudnn.enabled, cudnn.deterministic, cudnn.allow_tf32, cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32))
