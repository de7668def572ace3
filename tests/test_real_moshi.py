"""The real Moshi code of moshi==0.2.13, compiled and bit-exact on the CPU against its own
streaming loop: Mimi at its real configuration (SEANet, 8 + 8 transformer layers, 8 codebooks),
and the full frame (Mimi encode, LMGen step with sampling, Mimi decode) with the LM shrunk to
2 layers of width 128 to fit CI (``SMALL_LM``: same classes and code path as the 7B model)."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from stock_packages import MOSHI, require

require(*MOSHI)   # skips only when a third-party package is absent
from cadence_fx.models import moshi as M  # noqa: E402 - the project's own: must import
from helpers import same

M.import_stock()


def _frames(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [0.1 * torch.randn(1, 1, 1920, generator=g) for _ in range(n)]


def _run(fn, fresh, frames, reset_at, seed=5):
    torch.manual_seed(seed)
    outs, state, addresses = [], fresh(), {}
    for i, frame in enumerate(frames):
        if i == reset_at:
            state = fresh()
        with torch.no_grad():
            a, b, state = fn(frame, state)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                addresses.setdefault(k, set()).add(v.data_ptr())
        outs.append((None if a is None else a.clone(), None if b is None else b.clone()))
    return outs, addresses


def _reset_in_place(step, compiled, state, frames, reset_at):
    """Mimi frames through ``compiled`` from ``state``, the turn started in place at
    ``reset_at`` (``step.reset_state``); returns the (codes, pcm) per frame and the last state."""
    outs = []
    for i, frame in enumerate(frames):
        if i == reset_at:
            state = step.reset_state(state)
        with torch.no_grad():
            codes, pcm, state = compiled(frame, state)
        outs.append((codes.clone(), pcm.clone()))
    return outs, state


def test_mimi_stream_bit_exact_against_the_stock_loop():
    mimi = M.build_mimi(seed=0)
    frames = _frames(6)
    stock = M.stock_stream(mimi, None, frames, reset_at=3)   # reset_streaming at the turn boundary
    step = M.MimiStep(mimi)
    compiled = cadence_fx.compile(step, "moshi-mimi")       # the real declared shapes
    ours, addresses = _run(compiled, step.initial_state, frames, reset_at=3)
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(stock, ours)] == [True] * 6
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks, k.traces) == (6, 6, 0, 1)
    for region in ("mimi_encoder_kv", "mimi_decoder_kv", "mimi_conv_in"):
        assert len(addresses[region]) == 1   # the carry: one address over the stream and the reset
    assert k.absorptions == 6                # 3 regions, absorbed at the start and at the reset


def test_a_turn_reset_in_place_copies_nothing_and_the_step_keeps_no_second_state():
    """``reset_state`` starts the next turn in the state itself, as the stock loop's
    ``reset_streaming`` does: the compiled step copies nothing at the reset. The step keeps no
    template of the fresh state (its all-zero rings are remembered by shape), and the modules'
    own streaming caches are the first ``initial_state()``: once that is copied into the carries
    and dropped, the carries are the only copy of the state."""
    mimi = M.build_mimi(seed=0)
    frames = _frames(4)
    stock = M.stock_stream(mimi, None, frames, reset_at=2)
    step = M.MimiStep(mimi)
    assert not any(isinstance(v, torch.Tensor) and v.numel() > 1000 for v in step._initial.values())
    compiled = cadence_fx.compile(step, "moshi-mimi")
    state = step.initial_state()
    holder = mimi.encoder_transformer.transformer.layers[0].self_attn._streaming_state
    assert holder.kv_cache.cache.data_ptr() == state["mimi_encoder_kv"].data_ptr()
    outs, state = _reset_in_place(step, compiled, state, frames, reset_at=2)
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(stock, outs)] == [True] * 4
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.absorptions) == (4, 0, 3)   # the first call only
    carry = compiled.carries["mimi_encoder_kv"].tensor
    assert holder.kv_cache.cache.untyped_storage().data_ptr() == carry.untyped_storage().data_ptr()


def test_moshi_frame_bit_exact_with_sampling_and_a_turn_reset():
    mimi = M.build_mimi(seed=0)
    lm_gen = M.build_lm_gen(seed=1, overrides=M.SMALL_LM, dtype=torch.float32)
    frames = _frames(8)
    torch.manual_seed(5)
    stock = M.stock_stream(mimi, lm_gen, frames, reset_at=4)
    assert stock[0] == (None, None) and stock[1][0] is not None   # the delays fill, then audio
    step = M.MoshiStep(mimi, lm_gen)
    adapter = M.moshi_adapter(M.SMALL_LM)
    eager, _ = _run(step, step.initial_state, frames, reset_at=4)
    assert all(same(s[0], e[0]) and same(s[1], e[1]) for s, e in zip(stock, eager))
    compiled = cadence_fx.compile(step, adapter)
    ours, addresses = _run(compiled, step.initial_state, frames, reset_at=4)
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(stock, ours)] == [True] * 8
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (8, 8, 0)
    # lm_offset 0 (delays filling), 1 (first tokens), 2 (steady): one class each
    assert len(compiled.classes) == 3
    assert len(addresses["lm_kv"]) == 1 and len(addresses["lm_token_ring"]) == 1
    steady = [e for e in compiled.classes.values() if "lm_offset', '2'" in str(e.key)]
    # the boolean-mask blanking of LMGen._step is a select (passes/mask_writes.py): one piece
    assert [(p.kind, list(p.reasons)) for p in steady[0].records.pieces] == [("graph", [])]
    assert [w.kind for w in steady[0].records.rewrites].count("mask_write") == 1


def test_closing_the_step_lets_the_stock_modules_stream_again():
    """A server that moves a model from the compiled step back to the vendor's own loop (or a
    benchmark that runs both in one process) closes the step: the modules leave streaming as
    the stock context does on exit, and the stock loop then runs on them exactly as on modules
    never compiled."""
    mimi = M.build_mimi(seed=0)
    frames = _frames(4)
    want = M.stock_stream(mimi, None, frames, reset_at=2)
    step = M.MimiStep(mimi)
    compiled = cadence_fx.compile(step, "moshi-mimi")
    ours, _ = _run(compiled, step.initial_state, frames, reset_at=2)
    assert compiled.counters.compiled_calls == 4
    with pytest.raises(AssertionError, match="already streaming"):
        M.stock_stream(mimi, None, frames, reset_at=2)   # the step still streams the modules
    step.close()
    assert mimi._streaming_state is None
    again = M.stock_stream(mimi, None, frames, reset_at=2)
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(want, again)] == [True] * 4
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(want, ours)] == [True] * 4


def test_initial_state_matches_the_declared_regions():
    mimi = M.build_mimi(seed=0)
    step = M.MimiStep(mimi)
    state = step.initial_state()
    ad = adapters.get("moshi-mimi")
    for r in ad.regions:
        t = state[r.input.split(".", 1)[1]]
        want = [ad.dim_size(d, r) if d is not None else None for d in r.shape]
        assert [w for w in want if w is not None] == [n for i, n in enumerate(t.shape) if want[i] is not None]
    assert state["mimi_encoder_kv"].shape == (8, 2, 1, 8, 250, 64)


def test_state_missing_an_entry_is_refused_with_the_fix():
    step = M.MimiStep(M.build_mimi(seed=0))
    state = step.initial_state()
    del state["mimi_conv_in"]
    with pytest.raises(KeyError, match="start from initial_state"):
        step(torch.zeros(1, 1, 1920), state)


def test_a_restarted_moshi_server_loads_every_frame_class_compiled(tmp_path):
    """Restart: new modules (same weights) and a new step on the cache directory the first
    process filled. Every frame class loads compiled -- the LM and Mimi streaming state the
    graphs read and write is module state, bound to the new modules by its path -- and the
    stream is bit-exact against the stock loop, sampling and a turn reset included."""
    frames = _frames(8)

    def serve():
        mimi = M.build_mimi(seed=0)
        lm_gen = M.build_lm_gen(seed=1, overrides=M.SMALL_LM, dtype=torch.float32)
        torch.manual_seed(5)
        stock = M.stock_stream(mimi, lm_gen, frames, reset_at=4)
        step = M.MoshiStep(mimi, lm_gen)
        compiled = cadence_fx.compile(step, M.moshi_adapter(M.SMALL_LM), cache_dir=tmp_path)
        ours, _ = _run(compiled, step.initial_state, frames, reset_at=4)
        assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(stock, ours)] == [True] * 8
        k = compiled.counters
        assert (k.compiled_calls, k.fallbacks) == (8, 0)
        step.close()
        return k

    first = serve()
    assert (first.traces, first.cache_loads) == (3, 0)
    restarted = serve()
    assert (restarted.traces, restarted.cache_loads, restarted.compiled_loads) == (0, 3, 3)


def test_a_donated_state_is_the_carry_and_the_only_copy_of_the_state():
    """``donate_state=True`` (a server that gives each stream's state to the step, as the stock
    loop lets its modules write theirs): Mimi's rings, already at the declared size, become the
    carries themselves -- nothing allocated beside them, nothing copied, the modules' own caches
    are the carries; the input conv's context (6 samples, its carry the 1926-sample window) is
    copied as always -- and the stream, turn reset included, is stock's."""
    mimi = M.build_mimi(seed=0)
    frames = _frames(5)
    stock = M.stock_stream(mimi, None, frames, reset_at=3)
    step = M.MimiStep(mimi)
    compiled = cadence_fx.compile(step, "moshi-mimi", donate_state=True)
    state = step.initial_state()
    given = {k: state[k].data_ptr() for k in ("mimi_encoder_kv", "mimi_decoder_kv")}
    outs, state = _reset_in_place(step, compiled, state, frames, reset_at=3)
    assert [same(s[0], o[0]) and same(s[1], o[1]) for s, o in zip(stock, outs)] == [True] * 5
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.adoptions, k.absorptions) == (5, 0, 2, 1)
    for name, ptr in given.items():
        assert compiled.carries[name].tensor.data_ptr() == ptr == state[name].data_ptr()
    holder = mimi.encoder_transformer.transformer.layers[0].self_attn._streaming_state
    assert holder.kv_cache.cache.data_ptr() == given["mimi_encoder_kv"]


def test_a_donated_state_never_writes_the_fresh_state_the_step_keeps():
    """The fresh values ``reset_state`` and ``initial_state`` restore (the delayed-token ring's
    -2s) are the step's own copies, never the tensors of a state handed out: a donating step
    takes those over as carries and writes them."""
    mimi, lm_gen = M.build_mimi(seed=0), M.build_lm_gen(seed=1, overrides=M.SMALL_LM,
                                                          dtype=torch.float32)
    step = M.MoshiStep(mimi, lm_gen)
    compiled = cadence_fx.compile(step, M.moshi_adapter(M.SMALL_LM), donate_state=True)
    state = step.initial_state()
    fresh = state["lm_token_ring"].clone()
    assert fresh.lt(0).all()
    for frame in _frames(4):
        with torch.no_grad():
            _, _, state = compiled(frame, state)
    assert compiled.counters.adoptions >= 2 and not torch.equal(state["lm_token_ring"], fresh)
    assert torch.equal(step.reset_state(state)["lm_token_ring"], fresh)
    assert torch.equal(step.initial_state()["lm_token_ring"], fresh)
