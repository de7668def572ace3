"""The four rewrites that prepare a device step for exact fusion, each a pass of its own.

Each one only changes where values are stored or which kernel an op runs in, never what is
computed, and each gives ``fuse_exact`` (the pass after them) more to fuse:

* ``functional_temporaries``: in-place arithmetic on a temporary made functional
  (``region_writes.functional_temporaries``; Moshi's depformer offsets);
* ``cats_in_place``: ``buffer.copy_(cat(parts))`` written part by part into the buffer's views
  (``cat_in_place.write_cats_in_place``; the DiT's K/V caches);
* ``split_conv_bias``: a convolution whose backend adds the bias after it made
  ``conv(x, w, None) + b`` (``epilogues.split_conv_bias``; the DiT's causal conv);
* ``contiguous_norm_inputs``: a LayerNorm's strided input, made by a fusible kernel, copied to a
  contiguous one explicitly, as the norm's kernel would (``epilogues.contiguous_norm_inputs``).

Like fusion they run on fusion's devices only (``exact_ops.DEVICES``); elsewhere each leaves the
graph as it is. Each counts what it did in the class's ``Fusion`` record (``records.py``), in the field it always
had (``inplace_made_functional``, ``cats_in_place`` with ``cats_left``, ``conv_bias_split``,
``norm_inputs_copied``), and is ``modified`` only where it rewrote something.
"""
from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from . import cat_in_place, epilogues, region_writes
from .context import PassContext
from .exact_ops import VIEWS, fusible, fusion_device, is_kernel

__all__ = ["functional_temporaries", "cats_in_place", "split_conv_bias", "contiguous_norm_inputs"]


def functional_temporaries(gm: GraphModule, ctx: PassContext) -> PassResult:
    if fusion_device(gm) is None:
        return PassResult(gm, False)
    made = region_writes.functional_temporaries(gm)
    ctx.records.update_fusion(inplace_made_functional=made)
    return PassResult(gm, made > 0)


def cats_in_place(gm: GraphModule, ctx: PassContext) -> PassResult:
    device = fusion_device(gm)
    if device is None:
        return PassResult(gm, False)
    left: dict = {}     # copies of a cat left as they were, by reason
    written = cat_in_place.write_cats_in_place(gm, device, left)
    ctx.records.update_fusion(cats_in_place=written, cats_left=left)
    return PassResult(gm, written > 0)


def split_conv_bias(gm: GraphModule, ctx: PassContext) -> PassResult:
    device = fusion_device(gm)
    if device is None:
        return PassResult(gm, False)
    split = epilogues.split_conv_bias(gm, device)
    ctx.records.update_fusion(conv_bias_split=split)
    return PassResult(gm, split > 0)


def contiguous_norm_inputs(gm: GraphModule, ctx: PassContext) -> PassResult:
    device = fusion_device(gm)
    if device is None:
        return PassResult(gm, False)
    copied = epilogues.contiguous_norm_inputs(
        gm, device, lambda n: fusible(n, device) and is_kernel(n),
        lambda n: n.op == "call_function" and n.target in VIEWS and fusible(n, device))
    ctx.records.update_fusion(norm_inputs_copied=copied)
    return PassResult(gm, copied > 0)
