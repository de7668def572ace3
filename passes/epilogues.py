"""Stock epilogues made ops of their own, so that they can join a fused region
(run as the passes ``split_conv_bias`` and ``contiguous_norm_inputs``, ``fusion_prep.py``,
before ``fuse_exact``). Cases handled -- the Token2Wav DiT's causal conv::

    before:  h = conv1d(x, w, b)                      # cuDNN, then ATen's own output.add_(b)
             n = layer_norm(h.transpose(1, 2))        # the norm's kernel copies its strided input
    after:   h = conv1d(x, w, None) + b.view(1, C, 1)
             n = layer_norm(h.transpose(1, 2).clone(memory_format=contiguous))
             # the add and the copy are one fused kernel; the norm reads a contiguous input

Both are exact by construction: the same cuDNN call and the same IEEE add, which ATen itself
performs after the convolution on that backend (``torch._C._select_conv_backend`` decides, on
the traced values; backends that add the bias inside their kernel are left alone), and the same
contiguous copy the norm's kernel would make (``expect_contiguous``), into the same kernel.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.fx import GraphModule, Node

from .fx_utils import aten, val

__all__ = ["split_conv_bias", "contiguous_norm_inputs", "bias_added_after", "CONVS"]

FLOAT = (torch.float32, torch.bfloat16)

CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)
# the backends that run the convolution without its bias and then ``output.add_(bias)``
# (ATen's Convolution.cpp: "cuDNN convolutions does not handle bias. Bias is handled outside.")
BIAS_ADDED_AFTER = ("Cudnn", "CudnnTranspose")


def _conv_args(node: Node) -> Optional[dict]:
    """The convolution's arguments by name, as its schema has them."""
    from torch.fx.operator_schemas import normalize_function
    found = normalize_function(node.target, node.args, node.kwargs,
                               normalize_to_only_use_kwargs=True)
    return None if found is None else dict(found.kwargs)


def bias_added_after(node: Node) -> bool:
    """Whether ATen runs this convolution as the convolution without its bias and then an
    in-place add of the bias: the backend (``torch._C._select_conv_backend`` on the traced
    values) is cuDNN, with the bias and without it."""
    kw = _conv_args(node)
    if kw is None or not isinstance(kw.get("bias"), Node):
        return False
    spatial = val(kw["weight"]).dim() - 2
    common = {"transposed": kw.get("transposed", False), "groups": kw.get("groups", 1)}
    for k, default in (("stride", 1), ("padding", 0), ("dilation", 1), ("output_padding", 0)):
        v = kw.get(k, default)
        common[k] = [v] * spatial if isinstance(v, int) else v
        if not isinstance(common[k], (list, tuple)) or not all(isinstance(i, int) for i in common[k]):
            return False   # ``padding="same"``, symbolic sizes: left alone
    x, w, b = val(kw["input"]), val(kw["weight"]), val(kw["bias"])
    try:
        with_bias = torch._C._select_conv_backend(x, w, bias=b, **common)
        without = torch._C._select_conv_backend(x, w, bias=None, bias_sizes=None, **common)
    except (RuntimeError, TypeError):   # a form the selector does not take: left alone
        return False
    return with_bias.name in BIAS_ADDED_AFTER and without.name == with_bias.name


def split_conv_bias(gm: GraphModule, device: str) -> int:
    """``conv(x, w, b)`` whose backend adds the bias after the convolution (cuDNN) becomes
    ``conv(x, w, None) + b.view(1, C, 1...)``: the same convolution call and the same IEEE add,
    now an op of its own that may join the region after it. Returns how many were split."""
    split = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in CONVS:
            continue
        out = val(node)
        if (out is None or out.device.type != device or out.dtype not in FLOAT
                or not bias_added_after(node)):
            continue
        kw = _conv_args(node)
        bias = kw["bias"]
        shape = [1, val(bias).numel()] + [1] * (out.dim() - 2)
        with gm.graph.inserting_before(node):
            bare = gm.graph.call_function(node.target, (), {**kw, "bias": None})
            bare.meta = dict(node.meta)
            bare.meta["val"] = out.clone()   # a value of its own: the add does not alias it
            view = gm.graph.call_function(aten.view.default, (bias, shape))
            view.meta["val"] = val(bias).view(shape)
            add = gm.graph.call_function(aten.add.Tensor, (bare, view))
            add.meta = dict(node.meta)
        node.replace_all_uses_with(add)
        gm.graph.erase_node(node)
        split += 1
    if split:
        gm.graph.lint()
        gm.recompile()
    return split


# ops whose device kernel copies a strided input to a contiguous one first (``expect_contiguous``)
# and computes the same on the copy: an explicit copy before them is theirs, and may be fused
NORMS_COPYING_INPUT = (aten.layer_norm.default, aten.native_layer_norm.default)


def contiguous_norm_inputs(gm: GraphModule, device: str, fusible_kernel: Callable[[Node], bool],
                           fusible_view: Callable[[Node], bool]) -> int:
    """A strided input of a LayerNorm made by a fusible kernel (``fusible_kernel``, through
    ``fusible_view``s) is copied to a contiguous one explicitly, as the norm's kernel would copy
    it itself: the copy then joins the region that makes the input (one kernel fewer). Returns
    how many were inserted."""
    made = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in NORMS_COPYING_INPUT:
            continue
        x = node.args[0]
        v = val(x) if isinstance(x, Node) else None
        if v is None or v.device.type != device or v.is_contiguous():
            continue
        base = x
        while fusible_view(base):
            base = base.args[0]
        if not fusible_kernel(base):
            continue   # nothing to fuse the copy with: the norm's own copy costs the same
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(aten.clone.default, (x,),
                                          {"memory_format": torch.contiguous_format})
        copy.meta["val"] = v.clone(memory_format=torch.contiguous_format)
        node.replace_input_with(x, copy)
        made += 1
    if made:
        gm.recompile()
    return made
