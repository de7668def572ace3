"""What a compiled class is keyed on: the signature of every tensor leaf and the global modes a
trace bakes in. Shared by the call path, the tracer and the copier of repeated calls."""
from __future__ import annotations

import torch

__all__ = ["tensor_signature", "global_signature"]


def tensor_signature(t: torch.Tensor) -> tuple:
    # Strides of size-1 dims stay in the key, although they address no other element
    # (``x[:, :12].contiguous()`` is ``x[:, :12]`` itself, with dim 0's stride of the uncut
    # tensor, so it keys another class than a fresh tensor of the same shape). Merging them would
    # be exact only if no kernel a class runs, compiled or stock, read those strides: the trace
    # bakes the caller's strides into every view and ``empty_like`` it records, and kernels
    # receive strides as launch arguments (a BLAS leading dimension, an attention backend's
    # alignment checks, a custom op's own indexing), where one library may pick another
    # algorithm for them. torch normalises some of these (cuDNN descriptors, cuBLAS leading
    # dimensions of size-1 matrices), not all, and nothing here can enumerate them, so one class
    # per layout is what keeps every call exact against stock; a caller that wants one class
    # passes ``t.clone(memory_format=torch.contiguous_format)``.
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
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(autocast),
            torch.are_deterministic_algorithms_enabled(), _kernel_switches())


_C = torch._C
# (backend, op) of every fp32-precision switch (TF32 or not): the generic one, matmuls, cuDNN,
# convolutions. The ``fp32_precision`` API reflects the legacy ``allow_tf32`` switches too;
# reading those after the new API was used raises.
_PRECISIONS = (("generic", "all"), ("cuda", "matmul"), ("cuda", "all"), ("cuda", "conv"))


def _kernel_switches() -> tuple:
    """The cuDNN, fp32-precision and attention-backend switches, read from torch's own getters
    (``torch.backends``' properties cost ten times as much, on every call)."""
    return (_C._get_cudnn_enabled(), _C._get_cudnn_deterministic(), _C._get_cudnn_benchmark(),
            tuple(_C._get_fp32_precision_getter(b, op) for b, op in _PRECISIONS),
            _C._get_flash_sdp_enabled(), _C._get_mem_efficient_sdp_enabled(),
            _C._get_math_sdp_enabled(), _C._get_cudnn_sdp_enabled())
