"""The exact rewrites ahead of fusion (the K/V cats written into the workspace in place, integer
fills and clamps fused, the conv context's write taken over by its region) and the fused regions on our own streaming decoder, driven as a server drives it: speakers primed mid-stream, a chunk retried,
a session set aside and resumed, a new mode, a restart from the compile cache. Every output and
every state bit-exact against the stock decoder run through the same script."""
from __future__ import annotations

import pytest
import torch

import cadence_fx
from cadence_fx import fusion
from cadence_fx.fusion import regions

from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_decoder import CALL, CHUNK, DECODER_ADAPTER, LAYERS, chunks, clone, make_decoder, prompt
from helpers import same


def script(step, device="cpu"):
    """One server's traffic through ``step``; returns every output and state, cloned."""
    out = []
    xs = chunks([CHUNK, CHUNK, CALL, CHUNK, CHUNK, CALL], seed=7)

    def call(x, state, mode=torch.no_grad):
        with mode():
            y, new = step(x.to(device), state)
        out.append((y.clone(), clone(new)))
        return new

    a = clone(call(prompt(0), None))                 # speaker 0 primed
    a = clone(call(xs[0], a))
    before = clone(a)                                # kept to retry the next chunk
    call(xs[1], a)                                   # its result is lost: retried from the copy
    a = clone(call(xs[1], clone(before)))
    b = clone(call(prompt(1), None))                 # speaker 1 arrives mid-stream
    b = clone(call(xs[2], b))
    a = clone(call(xs[3], a))                        # speaker 0 resumes
    a = clone(call(xs[4], a, mode=torch.inference_mode))   # a new mode: a class of its own
    b = clone(call(xs[5], b))
    call(prompt(0), None)                            # speaker 0's next turn, primed again
    return out


def _same(a, b):
    """Every output and state equal bit for bit (what tests/test_region_kernels.py imports)."""
    return same(a, b, bits=True)


@pytest.fixture(scope="module")
def stock():
    return script(make_decoder())


def _fusion_records(compiled):
    return [e.records.fusion for e in compiled.classes.values()]


def fresh_process(monkeypatch):
    """What a restarted process starts with: no compiled region in memory, no open kernel
    store, and no compiler (a region compiled or verified again fails the test)."""
    from cadence_fx.region_kernels import KernelStore

    def no_compiler(module, args, graph=None):
        raise AssertionError("a region loaded from the compile cache was compiled again")
    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(KernelStore, "_open", {})
    monkeypatch.setattr(fusion, "compile_region", no_compiler)


# Fusion on the CPU (fuse_on_cpu): a convolution's bias is split off only where cuDNN runs it, which
# adds the bias after the convolution; the CPU's kernels add it inside, so that rewrite is the
# device's: the real CFM's device test covers it.
def test_the_rewrites_run_through_a_server_lifecycle_bit_exact(fuse_on_cpu, stock, tmp_path,
                                                              monkeypatch):
    compiled = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert same(stock, script(compiled), bits=True)
    k = compiled.counters
    assert k.fallbacks == 0 and k.compiled_calls == k.calls == len(stock)
    # per layer, the priming pass's K/V concatenation written into the workspace in place; a
    # chunk's K, V and their concatenation too: 1 and 3 cats per layer, none left
    primed = [e.key[0][0] == (None, None) for e in compiled.classes.values()]
    records = _fusion_records(compiled)
    assert sorted(primed) == [False] * 5 + [True]   # steady classes: widths x modes, one priming
    assert [r.cats_in_place for r in records] == [2 if p else 6 for p in primed]
    assert all(r.cats_left == {} for r in records)
    # the positions' integer fill and clamp fuse with the comparison and the select (in the
    # priming class the offset is a constant: folded at compile time)
    for r in (r for r, p in zip(records, primed) if not p):
        assert any({"full_like.default", "clamp.default", "where.self"} <= set(x.ops)
                   for x in r.regions), r.regions
    assert k.fused_regions > 0 and all(r.state != "pending" for e in compiled.classes.values()
                                       for r in regions(e.gm))
    # each layer's conv context (``conv_out.copy_(cat(...)[..., -2:])``) is written by its
    # region, in every class; those regions ran fused
    assert [r.writes_absorbed for r in records] == [LAYERS] * len(records)
    writing = [g for e in compiled.classes.values() for g in regions(e.gm) if g.writes]
    assert len(writing) == LAYERS * len(records) and {g.state for g in writing} == {"fused"}
    # a restart: every class loads from the cache, and every region its compiled code and its
    # verdict (nothing compiled or verified again: the compiler is gone), bit-exact
    assert len(list((tmp_path / "kernels").glob("*.kernel"))) > 0
    fresh_process(monkeypatch)
    restarted = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert same(stock, script(restarted), bits=True)
    r = restarted.counters
    assert r.traces == 0 and r.compiled_loads == len(restarted.classes) == len(compiled.classes)
    assert r.fallbacks == 0 and r.fused_regions == k.fused_regions
    assert r.fusions_loaded == r.fused_regions + r.fusions_refused > 0
    assert all(g.loaded for e in restarted.classes.values() for g in regions(e.gm))
    assert sorted(g.writes for e in restarted.classes.values() for g in regions(e.gm)
                  if g.writes) == sorted(g.writes for g in writing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_rewrites_run_through_a_server_lifecycle_on_the_device_in_graphs():
    """The same traffic on the device: every class replays device graphs holding its fused
    regions (the conv contexts written by theirs), bit-exact against the stock decoder there."""
    stock = script(make_decoder().cuda(), "cuda")
    compiled = cadence_fx.compile(make_decoder().cuda(), DECODER_ADAPTER)
    assert same(stock, script(compiled, "cuda"), bits=True)
    k = compiled.counters
    assert k.fallbacks == 0 and k.compiled_calls == k.calls == len(stock) and k.replays > 0
    records = _fusion_records(compiled)
    assert [r.writes_absorbed for r in records] == [LAYERS] * len(records)
    assert all(r.cats_left == {} for r in records)
    found = [g for e in compiled.classes.values() for g in regions(e.gm)]
    assert k.fused_regions == len(found) > 0 and k.fusions_refused == 0


def test_without_the_rewrites_nothing_is_written_in_place(stock):
    """The control: the same script with fusion off (the shipped default on the CPU) is also
    bit-exact, and none of the rewrites ran -- what the first test counts is theirs."""
    compiled = cadence_fx.compile(make_decoder(), DECODER_ADAPTER)
    assert same(stock, script(compiled), bits=True)
    assert all(r.cats_in_place is None and r.regions == ()
               for r in _fusion_records(compiled))
