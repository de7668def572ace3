"""Concatenations written in place (passes/cat_in_place.py) and the stock epilogues split off ahead
of fusion (passes/epilogues.py: a cuDNN convolution's bias, a LayerNorm's strided input).

The pass is exercised on the DiT attention's own shape (K/V cats copied into a scratch buffer and
read by attention), on the cases it must leave alone (a reader that is not attention, a write to
the buffer in between, a part that is a view of the buffer), and on the real Token2Wav CFM chunk
compiled with fusion over a stream with a turn reset and a last partial chunk, bit-exact against
stock. On the CPU the fused regions run their stock code (``compile_region`` is the stock module:
what is tested here is the rewrites around them); the device test compiles them."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

import cadence_fx
from cadence_fx import fusion
from cadence_fx.passes import exact_ops
from cadence_fx.passes.cat_in_place import write_cats_in_place
from cadence_fx.passes.fx_utils import aten
from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file

fuse_exact_module = sys.modules["cadence_fx.passes.fuse_exact"]
epilogues = sys.modules["cadence_fx.passes.epilogues"]


def _norm_inputs(gm):
    """``contiguous_norm_inputs`` with fusion's own predicates, as ``fuse_exact`` runs it."""
    fe = fuse_exact_module
    return epilogues.contiguous_norm_inputs(
        gm, "cpu", lambda n: fe.fusible(n, "cpu") and fe.is_kernel(n),
        lambda n: n.op == "call_function" and n.target in fe.VIEWS and fe.fusible(n, "cpu"))
HEADS, HEAD_DIM, HELD = 4, 8, 12


class Attention(nn.Module):
    """The DiT's ``forward_chunk`` attention, with its scratch buffer written as the stock
    ``blocks_forward_chunk`` writes it (``buf[i][:, :, :L] = new_att_cache``). ``reader`` picks
    what else reads K; ``between`` writes the buffer between the cats and the copy; ``aliased``
    takes the cache from the buffer itself."""

    def __init__(self, reader="attention", between=False, aliased=False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))
        self.register_buffer("buf", torch.zeros(3, 2, HEADS, 40, 2 * HEAD_DIM))
        self.reader, self.between, self.aliased = reader, between, aliased

    def heads(self, x):
        return x.view(x.shape[0], x.shape[1], HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, x, cache):
        if self.aliased:
            cache = self.buf[0, :, :, :HELD]
        q = self.heads(self.q(x))
        k = F.layer_norm(self.heads(self.k(x)), [HEAD_DIM])
        v = self.heads(self.v(x))
        k_cache, v_cache = cache.chunk(2, dim=3)
        k, v = torch.cat([k, k_cache], 2), torch.cat([v, v_cache], 2)
        kv = torch.cat([k, v], 3)
        o = F.scaled_dot_product_attention(q, k, v)
        if self.reader == "sum":
            o = o + k.sum()
        if self.between:
            self.buf[2].add_(1.0)
        self.buf[1][:, :, :kv.shape[2], :] = kv
        return o.transpose(1, 2).reshape(x.shape[0], x.shape[1], 32), self.buf[1, :, :, :kv.shape[2]]


def _traced(module):
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())

    def run(p, b, x, cache):
        return functional_call(module, {**p, **b}, (x, cache))

    x, cache = torch.randn(2, 5, 32), torch.randn(2, HEADS, HELD, 2 * HEAD_DIM)
    gm = make_fx(run, tracing_mode="fake", pre_dispatch=True)(params, buffers, x, cache)
    return gm, run, (params, buffers, x, cache)


def _ops(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _same_results(gm, run, args):
    params, buffers, x, cache = args
    b_ref, b_ours = ({k: v.clone() for k, v in buffers.items()} for _ in range(2))
    ref, ours = run(params, b_ref, x, cache), gm(params, b_ours, x, cache)
    return all(torch.equal(a, b) for a, b in zip(ref, ours)) and torch.equal(b_ref["buf"], b_ours["buf"])


def test_kv_cats_are_written_in_place_and_attention_reads_the_buffer():
    gm, run, args = _traced(Attention())
    assert len(_ops(gm, aten.cat.default)) == 3
    assert write_cats_in_place(gm, "cpu") == 3
    assert _ops(gm, aten.cat.default) == []
    copies = _ops(gm, aten.copy_.default)
    # k_new, v_new and the cache in one piece (its K and V halves land side by side)
    assert len(copies) == 3
    assert sorted(tuple(c.meta["val"].shape) for c in copies) == [
        (2, HEADS, 5, HEAD_DIM), (2, HEADS, 5, HEAD_DIM), (2, HEADS, HELD, 2 * HEAD_DIM)]
    (sdpa,) = _ops(gm, aten.scaled_dot_product_attention.default)
    k, v = (a.meta["val"] for a in sdpa.args[1:3])
    assert k.stride()[-2] == v.stride()[-2] == 2 * HEAD_DIM   # views of the buffer's rows
    node = list(gm.graph.nodes)
    assert all(node.index(c) < node.index(sdpa) for c in copies)   # written before it reads
    assert _same_results(gm, run, args)


def test_the_attention_backend_is_chosen_on_real_tensors(monkeypatch):
    """The traced values are fake, and ``torch._fused_sdp_choice`` on a fake tensor answers for
    the meta device (always math): the choice is read from real tensors of the same layout."""
    from torch._subclasses.fake_tensor import FakeTensor
    seen, choose = [], torch._fused_sdp_choice

    def spy(*args, **kwargs):
        seen.append(args)
        return choose(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sdp_choice", spy)
    gm, run, args = _traced(Attention())
    assert write_cats_in_place(gm, "cpu") == 3
    assert len(seen) == 2 and not any(isinstance(t, FakeTensor) for a in seen for t in a)
    assert [tuple(t.stride()) for t in seen[1][1:]] == [tuple(a.meta["val"].stride()) for a in
                                                        _ops(gm, aten.scaled_dot_product_attention.default)[0].args[1:3]]


def test_a_cat_read_by_another_op_is_kept_and_copied_whole():
    gm, run, args = _traced(Attention(reader="sum"))
    assert write_cats_in_place(gm, "cpu") == 2   # the outer cat and V's; K is read by the sum
    (kept,) = _ops(gm, aten.cat.default)
    assert any(u.target is aten.copy_.default for u in kept.users)
    assert _same_results(gm, run, args)


@pytest.mark.parametrize("case", ["between", "aliased"])
def test_the_buffer_written_in_between_or_aliased_by_a_part_is_left_alone(case):
    gm, run, args = _traced(Attention(**{case: True}))
    before, left = gm.code, {}
    assert write_cats_in_place(gm, "cpu", left) == 0
    assert list(left) == [{"between": "aten.select.int reads the buffer in between",
                           "aliased": "a part is a view of the buffer"}[case]]
    assert gm.code == before and len(_ops(gm, aten.cat.default)) == 3
    assert _same_results(gm, run, args)


class _Dup(nn.Module):
    """One piece of a chunk placed twice: each place must be written."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(2, 4, 6, 24))

    def forward(self, cache):
        k_cache, v_cache = cache.chunk(2, dim=3)
        self.buf[:, :, :6, :].copy_(torch.cat([v_cache, k_cache, v_cache], 3))
        return self.buf.clone()


class _InnerTwice(nn.Module):
    """An inner cat used twice by the outer one, or as a part of one cat and inside another."""

    def __init__(self, nested):
        super().__init__()
        self.register_buffer("buf", torch.zeros(2, 4, 12, 24 if nested else 16))
        self.nested = nested

    def forward(self, a, b):
        k = torch.cat([a, b], 2)
        whole = torch.cat([k, torch.cat([k, k], 3)], 3) if self.nested else torch.cat([k, k], 3)
        self.buf[:, :, :12, :].copy_(whole)
        return self.buf.clone()


class _QueryFromBuffer(nn.Module):
    """Attention's query read from the region the copy writes, made before the cats."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.randn(2, 4, 40, 16))

    def forward(self, k_new, k_cache, v_new, v_cache):
        q = self.buf[:, :, :5, :8]
        k, v = torch.cat([k_new, k_cache], 2), torch.cat([v_new, v_cache], 2)
        kv = torch.cat([k, v], 3)
        o = F.scaled_dot_product_attention(q, k, v)
        self.buf[:, :, :kv.shape[2], :] = kv
        return o


class _LegacyEmpty(nn.Module):
    """A legacy empty 1-D part, which ``cat`` skips."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(2, 4, 20, 8))

    def forward(self, a, e):
        self.buf[:, :, :5, :] = torch.cat([a, e], 2)
        return self.buf.clone()


_r = torch.randn
_TWICE = "a node placed twice, or a part of another rank or dtype"
TREES_LEFT_ALONE = {
    "piece-twice": (_Dup, (_r(2, 4, 6, 16),), _TWICE),
    "inner-twice": (lambda: _InnerTwice(False), (_r(2, 4, 5, 8), _r(2, 4, 7, 8)), _TWICE),
    "part-and-inner": (lambda: _InnerTwice(True), (_r(2, 4, 5, 8), _r(2, 4, 7, 8)), _TWICE),
    "query-reads-the-buffer": (_QueryFromBuffer, (_r(2, 4, 5, 8), _r(2, 4, 12, 8), _r(2, 4, 5, 8),
                                                  _r(2, 4, 12, 8)),
                               "an attention operand reads the buffer"),
    "legacy-empty-part": (_LegacyEmpty, (_r(2, 4, 5, 8), torch.empty(0)), _TWICE),
}


@pytest.mark.parametrize("case", sorted(TREES_LEFT_ALONE))
def test_trees_the_pass_cannot_place_exactly_are_left_alone(case):
    make, inputs, reason = TREES_LEFT_ALONE[case]
    module = make()
    buffers = dict(module.named_buffers())

    def run(b, *xs):
        return functional_call(module, b, xs)

    gm = make_fx(run, tracing_mode="fake", pre_dispatch=True)(buffers, *inputs)
    before, left = gm.code, {}
    assert write_cats_in_place(gm, "cpu", left) == 0 and gm.code == before
    assert left == {reason: 1}
    b_ref, b_ours = ({k: v.clone() for k, v in buffers.items()} for _ in range(2))
    assert torch.equal(run(b_ref, *inputs), gm(b_ours, *inputs))
    assert torch.equal(b_ref["buf"], b_ours["buf"])


def test_a_step_on_another_device_is_left_alone():
    gm, _, _ = _traced(Attention())
    assert write_cats_in_place(gm, "cuda") == 0


# -- the stock epilogues split off: a convolution's bias, a LayerNorm's strided input ----------------

class ConvBlock(nn.Module):
    """``CausalConvBlock`` of the DiT: conv, LayerNorm over channels, Mish, conv; gated residual."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(16, 16, 3), nn.Conv1d(16, 16, 3)
        self.norm = nn.LayerNorm(16)

    def forward(self, x, gate):
        h = self.conv1(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)
        h = F.mish(self.norm(h)).transpose(1, 2)
        h = self.conv2(F.pad(h, (2, 0))).transpose(1, 2)
        return x + gate * h


def _conv_traced():
    module = ConvBlock()
    params = dict(module.named_parameters())

    def run(p, x, gate):
        return functional_call(module, p, (x, gate))

    x, gate = torch.randn(2, 10, 16), torch.randn(2, 1, 16)
    return make_fx(run, tracing_mode="fake", pre_dispatch=True)(params, x, gate), run, (params, x, gate)


def test_a_bias_added_after_the_convolution_becomes_an_add_and_a_norm_input_a_copy(monkeypatch):
    gm, run, args = _conv_traced()
    monkeypatch.setattr(epilogues, "bias_added_after", lambda node: True)   # as cuDNN does
    assert epilogues.split_conv_bias(gm, "cpu") == 2
    convs = _ops(gm, aten.conv1d.default)
    assert len(convs) == 2 and all(c.kwargs["bias"] is None for c in convs)
    adds = [u for c in convs for u in c.users]
    assert [a.target for a in adds] == [aten.add.Tensor] * 2
    assert _norm_inputs(gm) == 1
    (norm,) = _ops(gm, aten.layer_norm.default)
    copy = norm.args[0]
    assert copy.target is aten.clone.default and copy.meta["val"].is_contiguous()
    assert copy.kwargs == {"memory_format": torch.contiguous_format}
    # the copy and the add are fusible: they join the region that makes the norm's input
    assert fuse_exact_module.fusible(copy, "cpu") and fuse_exact_module.is_kernel(copy)
    ref, ours = run(*args), gm(*args)
    assert torch.allclose(ref, ours, rtol=0, atol=1e-6)   # CPU kernels add the bias inside


def test_a_convolution_whose_backend_adds_the_bias_itself_is_left_alone():
    gm, _, _ = _conv_traced()
    assert not any(epilogues.bias_added_after(c) for c in _ops(gm, aten.conv1d.default))
    assert epilogues.split_conv_bias(gm, "cpu") == 0     # the CPU's own kernels
    assert _norm_inputs(gm) == 0                         # made by a stock kernel


# -- the real Token2Wav CFM chunk ------------------------------------------------------------------

def test_real_cfm_stream_with_cats_in_place_is_bit_exact(monkeypatch):
    from stock_packages import TOKEN2WAV, require
    require(*TOKEN2WAV)
    from cadence_fx import adapters
    from cadence_fx.models import token2wav
    from test_real_token2wav import WIDTHS, _lockstep
    monkeypatch.setattr(exact_ops, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "compile_region", lambda module, args, graph=None: module)
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2))
    spks, prompt_state = token2wav.prime_cfm(step)
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in WIDTHS]
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter)
    verdicts, _ = _lockstep(step, compiled, spks, prompt_state, chunks)
    assert all(v["mel"] and v["att"] and v["cnn"] for v in verdicts)
    k = compiled.counters
    assert k.compiled_calls == k.calls == len(WIDTHS) and k.fallbacks == 0
    for entry in compiled.classes.values():
        fusion_records = entry.records.fusion
        # per block and Euler step: K, V and their concatenation, and the conv cache's cat
        assert fusion_records.cats_in_place == 2 * 10 * 4, fusion_records.cats_left
        assert fusion_records.cats_left == {}
        reads = [a.target for m in entry.gm.modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)
                 for n in m.graph.nodes if n.target is aten.scaled_dot_product_attention.default
                 for a in n.args[1:3]]
        assert len(reads) == 2 * 2 * 10 and aten.cat.default not in reads   # K, V: buffer views


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cfm_on_the_device_splits_biases_copies_norm_inputs_and_writes_cats_in_place():
    """The shipped default on the device: cuDNN convolutions' biases split off and fused, the
    LayerNorm input after the first conv made by the region, the K/V cats written into the
    estimator's buffer; replayed, every chunk and the state bit-exact against stock."""
    from stock_packages import TOKEN2WAV, require
    require(*TOKEN2WAV)
    from cadence_fx import adapters
    from cadence_fx.models import token2wav
    from test_real_token2wav import WIDTHS, _lockstep
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2, device="cuda"))
    spks, prompt_state = token2wav.prime_cfm(step, device="cuda")
    g = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(1, 80, w, generator=g).cuda(), torch.zeros(1, 80, w, device="cuda"))
              for w in WIDTHS]
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter)
    verdicts, _ = _lockstep(step, compiled, spks, prompt_state, chunks)
    assert all(v["mel"] and v["att"] and v["cnn"] for v in verdicts)
    k = compiled.counters
    assert k.fallbacks == 0 and k.replays == k.calls == len(WIDTHS)
    assert k.fused_regions > 0 and k.fusions_refused == 0
    for entry in compiled.classes.values():
        f = entry.records.fusion
        assert f.cats_in_place == 2 * 10 * 4, f.cats_left
        assert f.cats_left == {}
        assert f.conv_bias_split == 2 * 10 * 2        # both convs of each block, each step
        assert f.norm_inputs_copied == 2 * 10          # after the first conv
        ops = {op for r in f.regions for op in r.ops}
        assert "clone.default" in ops
