"""The prompt-retained join written in place (passes/_carry_prompt.py): a cache kept as
``all = cat([cache, new])`` and, once longer than P + R, cut to ``cat([all[:P], all[-R:]])``
(or prepended and cut to the newest R, then the prompt).

Unit tests run the carry pass on a small step and check op counts, ``graph.lint()``, the record
and ``torch.equal`` against stock; stream tests run ``tests/streaming_prompt_decoder.py`` (per-layer
K/V caches whose join attention reads, a prosody history only its cut reads, conv contexts) over
two speakers, a turn reset and partial last chunks, with the shadow audit on, and compare every
output and state with stock eager. In the classes where the caches are full the prompt's frames
of the carry are never written; a form still copied says why, as a near miss."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cadence_fx
from cadence_fx.catalog import build_catalog
from cadence_fx.passes.context import Carry, PassContext, RegionBinding
from cadence_fx.contract import APPEND, PREPEND, Adapter, PromptRetained, Region
from cadence_fx.counters import Counters
from cadence_fx.passes.fx_utils import CATS, aten
from cadence_fx.tracing import trace_step

from streaming_prompt_decoder import (CHUNK, LAYERS, PROMPT, RETAINED, make_decoder,
                                      prompt_adapter, serve)

carry_pass = importlib.import_module("cadence_fx.passes.carry_retention")
P, R, C = 4, 6, 2
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


class Cut(nn.Module):
    """``X`` joins the old state and ``x`` in ``order``; ``read`` makes attention read all of
    ``X`` (else only its cut does); the cut keeps the prompt and the last R frames."""

    def __init__(self, order=APPEND, read=True):
        super().__init__()
        self.order, self.read = order, read

    def forward(self, x, cache):
        both = torch.cat([cache, x], 2) if self.order == APPEND else torch.cat([x, cache], 2)
        y = F.scaled_dot_product_attention(x, both, both) if self.read else x * 2
        if self.order == APPEND:
            return y, torch.cat([both[:, :, :P], both[:, :, -R:]], 2)
        return y, torch.cat([both[:, :, :R], both[:, :, -P:]], 2)


def _adapter(order=APPEND, room="c"):
    return Adapter(name="cut", clocks={"p": P, "r": R, "c": C, "h": 2, "d": 4},
                   regions=(Region(name="k", input="cache", output="1", dim=2,
                                   retention=PromptRetained("p", "r"), advance="c", ordering=order,
                                   shape=(1, "h", None, "d"), room=room),),
                   call_frames=("c",), call_input="x", call_dim=2)


def _pass(module, adapter, held=P + R):
    """The carry pass on ``module`` traced holding ``held`` frames (by default its full class):
    the graph after, the context, the cats before and after; the rewritten graph is run and
    compared with stock."""
    g = torch.Generator().manual_seed(0)
    named = {"x": torch.randn(1, 2, C, 4, generator=g), "cache": torch.randn(1, 2, held, 4, generator=g)}
    traced = trace_step(module, module.forward, named)
    gm = traced.gm
    cats = sum(n.target in CATS for n in gm.graph.nodes)
    ph = next(n for n, s in zip([n for n in gm.graph.nodes if n.op == "placeholder"], traced.inputs)
              if s.kind == "arg" and s.name == "cache")
    (r,) = adapter.regions
    carry = Carry(r, torch.zeros(1, 2, build_catalog(adapter).region("k").declared_extent, 4))
    ctx = PassContext(adapter=adapter, class_key="test", inputs=list(traced.inputs),
                      regions=[RegionBinding(r, ph, 1, carry)], module_buffers={},
                      counters=Counters())
    result = carry_pass.carry_retention(gm, ctx)
    result.graph_module.graph.lint()
    result.graph_module.recompile()
    carry.view(held).copy_(named["cache"])
    flat = [carry.tensor if s.kind == "carry" else named[s.name] for s in ctx.inputs]
    with torch.no_grad():
        got, want = list(result.graph_module(*flat)), module(named["x"], named["cache"].clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1].data_ptr() == carry.tensor.data_ptr() and result.modified
    return result.graph_module, ctx, cats, sum(n.target in CATS for n in result.graph_module.graph.nodes)


def _frames(n):
    """The carry frames ``[lo, hi)`` a chain of frame-dim slices of a carry reads, else the name
    of the node the chain starts from."""
    lo, hi = 0, None
    while n.op == "call_function" and n.target is aten.slice.Tensor:
        if n.args[1] == 2:
            hi = lo + n.args[3] - n.args[2] if hi is None else hi   # the carry pass's own slices
            lo += n.args[2]
            hi += n.args[2]
        n = n.args[0]
    return (lo, hi) if n.name.startswith("carry") else n.name


def _copies(gm):
    """``(destination, source)`` of every ``copy_``, each as ``_frames`` gives it."""
    return [(_frames(n.args[0]), _frames(n.args[1]))
            for n in gm.graph.nodes if n.target is aten.copy_.default]


def test_append_join_read_by_attention_becomes_the_carrys_room():
    """``X = C[:P+R+c]`` (x copied into the room), attention reads it, the last R frames move
    down to ``C[P:P+R]`` after it: no cat, the prompt ``C[:P]`` never written."""
    gm, ctx, before, after = _pass(Cut(APPEND), _adapter(APPEND))
    (write,) = ctx.records.rewrites
    assert write.kind == "retention" and "into the carry's room" in write.detail
    assert (before, after, ctx.records.near_misses) == (2, 0, [])
    # x into the room, then the last R frames down by c through one temporary (3 pieces)
    copies = _copies(gm)
    assert [dst for dst, _ in copies] == [(P + R, P + R + C), (P, P + R)], copies


@pytest.mark.parametrize("order", [APPEND, PREPEND])
def test_a_join_only_its_cut_reads_needs_no_room(order):
    """Only the cut reads ``X``: the kept old frames move, x is written, no room, no cat; the
    prompt (``C[:P]`` appended, ``C[R:R+P]`` prepended) stays where it is."""
    gm, ctx, before, after = _pass(Cut(order, read=False), _adapter(order, room=None))
    (write,) = ctx.records.rewrites
    assert write.kind == "retention" and "no concatenation is left" in write.detail
    assert (before, after, ctx.records.near_misses) == (2, 0, [])
    prompt = (0, P) if order == APPEND else (R, R + P)
    dsts = [dst for dst, _ in _copies(gm)]
    assert dsts and all(hi <= prompt[0] or lo >= prompt[1] for lo, hi in dsts), dsts
    new = (P + R - C, P + R) if order == APPEND else (0, C)
    assert _copies(gm)[-1][0] == new and isinstance(_copies(gm)[-1][1], str)


@pytest.mark.parametrize("order", [APPEND, PREPEND])
def test_a_join_cut_off_the_grid_reads_each_frame_before_it_is_overwritten(order):
    """Holding P + R - 1 frames (a flush before the cache is full): prepended, the tail's old
    frames ``C[R-1:P+R-1]`` move up to ``C[R:R+P]`` before the head's ``C[:R-c]`` moves up over
    their source; appended, the kept frames move down by one before x is written."""
    gm, ctx, before, after = _pass(Cut(order, read=False), _adapter(order, room=None), held=P + R - 1)
    assert [w.kind for w in ctx.records.rewrites] == ["retention"] and after == 0


@pytest.mark.parametrize("order,room,why", [
    (PREPEND, "c", "read beyond its cut"),
    (APPEND, None, "give the region `room` for a call's frames (2 more)")])
def test_a_join_that_stays_a_temporary_is_a_near_miss(order, room, why):
    """Attention reads ``X`` in prepend order (a carry view would move every old frame), or in
    append order with no room for x: ``X`` stays, the kept frames are copied from it except the
    prompt, already in place; the record and a near miss say why."""
    gm, ctx, before, after = _pass(Cut(order), _adapter(order, room=room))
    (write,) = ctx.records.rewrites
    (miss,) = ctx.records.near_misses
    assert write.kind == "materialize" and why in write.detail and why in miss.detail
    assert f"{P} frames already in place not copied" in write.detail
    assert (before, after) == (2, 1)
    assert [dst for dst, _ in _copies(gm)] == [(0, R) if order == PREPEND else (P, P + R)]


def test_a_join_in_the_other_order_is_copied_with_the_reason():
    """Near miss that must not fire: the step appends, the region declares prepend."""
    gm, ctx, before, after = _pass(Cut(APPEND), _adapter(PREPEND))
    (miss,) = ctx.records.near_misses
    assert "ordering='prepend'" in miss.detail and after == 1
    assert [w.kind for w in ctx.records.rewrites] == ["retention"]


# -- whole streams -------------------------------------------------------------------------------

def _full(compiled, width):
    key = ((PROMPT + RETAINED,) * (2 * LAYERS) + (2,) * LAYERS + (PROMPT + RETAINED,), width)
    (entry,) = [e for k, e in compiled.classes.items() if k[0] == key]
    return entry


def _carry_writes(entry, region):
    """Frame ranges of the carry ``region`` that the class's graphs copy into."""
    return [dst for m in entry.gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is aten.copy_.default
            for dst in [_frames(n.args[0])] if _carry_of(n.args[0]) == f"carry_{region}"]


def _carry_of(n):
    while n.op == "call_function" and n.target is aten.slice.Tensor:
        n = n.args[0]
    return n.name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", [APPEND, PREPEND])
def test_a_stream_keeps_every_cache_exact_and_the_prompt_in_place(order, device):
    torch.manual_seed(0)
    stock = serve(make_decoder(order, device), device)
    compiled = cadence_fx.compile(make_decoder(order, device), prompt_adapter(order), verify=True)
    ours = serve(compiled, device)
    assert len(ours) == len(stock) == 24
    for i, ((y, s), (y0, s0)) in enumerate(zip(ours, stock)):
        assert torch.equal(y, y0) and s.keys() == s0.keys(), i
        assert all(torch.equal(s[k], s0[k]) for k in s), (i, [k for k in s if not torch.equal(s[k], s0[k])])
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (26, 26, 0, {})
    assert compiled.auditor.comparisons["hist"] == 26
    if device == "cuda":     # the audit is an eager piece: each call replays the pieces around it
        assert k.replays >= 26
    prompt = (0, PROMPT) if order == APPEND else (RETAINED, RETAINED + PROMPT)
    for width in (CHUNK, 2):                      # the steady chunk and the turn's last one
        entry = _full(compiled, width)
        kinds = {w.region: w.kind for w in entry.records.rewrites}
        misses = {w.region for w in entry.records.near_misses}
        kv = "retention" if order == APPEND else "materialize"   # prepend: attention reads X
        assert kinds == {**{f"{c}{i}": kv for i in range(LAYERS) for c in "kv"},
                         **{f"conv{i}": "retention" for i in range(LAYERS)}, "hist": "retention"}
        assert misses == (set() if order == APPEND else {f"{c}{i}" for i in range(LAYERS) for c in "kv"})
        for region in ("k0", "v1", "hist"):
            writes = _carry_writes(entry, region)
            assert writes and all(hi <= prompt[0] or lo >= prompt[1] for lo, hi in writes), writes
    assert k.retentions > 0


def test_the_compiled_join_leaves_no_concatenation_behind():
    """Without the audit (which keeps stock values to compare), the full classes of the append
    stream join nothing: every cache is written in place."""
    compiled = cadence_fx.compile(make_decoder(APPEND), prompt_adapter(APPEND))
    serve(compiled)
    for width in (CHUNK, 2):
        entry = _full(compiled, width)
        cats = [n for m in entry.gm.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes if n.target in CATS]
        assert cats == [], [n.name for n in cats]   # the conv contexts are windows in place too
