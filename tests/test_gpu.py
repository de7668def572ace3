"""ExactShapeReplay on CUDA: replays, guards, aliasing, effects, output lifetime, failures.
Skipped without CUDA; run on the device and committed under bench/results/."""
import random

import pytest
import torch

import cadence_fx
from cadence_fx.cudagraphs import CudaGraphBackend
from cadence_fx.errors import GuardError
from cadence_fx.models.toy import (CONV_ADAPTER, NOISY_ADAPTER, PROMPT_RETAINED_ADAPTER,
                                   HostRandomToy, NoisySourceToy, PromptRetainedToy)
from helpers import stream
from stock_packages import MOSHI, TOKEN2WAV, require

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
WIDTHS = [8] * 7 + [10] + [8] * 5 + [10]     # 14 chunks: two turns, each ending in a 10-frame call
RESET_AT = 8


def _toy():
    model = PromptRetainedToy().to(DEV)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64, generator=g).to(DEV), None)
    prompt_state = {k: v.clone() for k, v in state.items()}
    xs = [torch.randn(1, w, 64, generator=g).to(DEV) for w in WIDTHS]
    return model, prompt_state, xs


def _stream(step, prompt_state, xs, hold=False):
    outs, addresses, held, state = [], set(), [], prompt_state
    for i, x in enumerate(xs):
        if i == RESET_AT:
            state = prompt_state
        with torch.no_grad():
            y, state = step(x, state)
        if hold:  # keep the result object itself, as a caller streaming audio would
            held.append((y, y.clone()))
        addresses.add(state["att"].data_ptr())
        outs.append((y.clone(), state["att"].clone()))
    return outs, addresses, held


def _equal(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_stream_replays_every_call_bit_exact():
    model, prompt_state, xs = _toy()
    stock, stock_addresses, _ = _stream(model, prompt_state, xs)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    ours, addresses, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours)
    c = compiled.counters
    assert c.fallbacks == 0 and c.invalidations == 0
    assert c.replays == len(xs)                    # one capturable piece per class, every call
    assert c.traces == 4                          # K = 3 extents x widths actually seen: (24,8) (32,8) (40,8) (40,10)
    assert compiled.backend.captured == c.traces
    assert compiled.backend.warmups == 0          # each class's probe ran its kernels already
    assert len(addresses) == 1 and len(stock_addresses) > 1
    again, _, _ = _stream(compiled, prompt_state, xs)   # steady state: all replays, no new captures
    assert _equal(stock, again) and compiled.backend.captured == 4 and c.fallbacks == 0


def test_carry_is_aliased_and_inputs_staged():
    model, prompt_state, xs = _toy()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    _stream(compiled, prompt_state, xs[:3])
    pieces = [p for e in compiled.classes.values() for p in e.records.pieces]
    assert all(p.aliased_inputs >= 1 for p in pieces)   # carry and weights read in place
    x_bytes = xs[0].numel() * xs[0].element_size()
    assert compiled.backend.staging_bytes == 3 * x_bytes   # only the chunk input is staged, per class


def test_pointer_drift_invalidates_and_recovers_bit_exact():
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    outs, state = [], prompt_state
    for i, x in enumerate(xs):
        if i == RESET_AT:
            state = prompt_state
        if i == 5:  # the caller re-allocates a weight: same values, new address
            model.inp.weight.data = model.inp.weight.data.clone()
        with torch.no_grad():
            y, state = compiled(x, state)
        outs.append((y.clone(), state["att"].clone()))
    assert _equal(stock, outs)
    c = compiled.counters
    # every class captured before the move and used after it is dropped once: (40,8) at call 5,
    # (24,8) and (32,8) after the turn reset; each such call runs eager, later calls re-capture
    assert c.invalidations == 3
    assert any("moved (invalidated)" in r for r in c.reasons)
    assert c.replays == len(xs) - 3


def test_a_step_whose_every_graph_was_invalidated_captures_again():
    """One class in use, its weight moved: its only graph is dropped, so the pool it was captured
    into is released; the next call captures again (into a new pool) and replays."""
    model, prompt_state, xs = _toy()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    x = xs[0]
    want = model(x, prompt_state)[0]
    for i in range(5):
        if i == 2:
            model.inp.weight.data = model.inp.weight.data.clone()
        with torch.no_grad():
            y, _ = compiled(x, prompt_state)   # always from the prompt: one class, (24, 8)
        assert torch.equal(y, want)
    c = compiled.counters
    assert (c.invalidations, c.replays, compiled.backend.captured) == (1, 4, 2)
    assert list(c.reasons) == ["piece_0: fixed-address input(s) ['param inp.weight'] moved "
                               "(invalidated)"]


def test_host_randomness_is_rejected():
    model = HostRandomToy().to(DEV)
    xs = [torch.randn(1, 32, 4, device=DEV) for _ in range(5)]

    def run(step):
        random.seed(3)
        cc, ac, outs = torch.zeros(1, 32, 2, device=DEV), torch.zeros(1, 64, 0, device=DEV), []
        for x in xs:
            with torch.no_grad():
                y, cc, ac = step(x, cc, ac)
            outs.append(y.clone())
        return outs

    stock = run(model)
    compiled = cadence_fx.compile(model, CONV_ADAPTER)
    ours = run(compiled)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours))
    assert compiled.counters.replays == 0
    assert any("host randomness (python random)" in r for r in compiled.counters.reasons)


def test_device_randomness_replays_bit_exact_over_ten_calls():
    model = NoisySourceToy().to(DEV)
    xs = [torch.randn(1, 16, 8, device=DEV) for _ in range(12)]

    def run(step):
        torch.cuda.manual_seed(1234)
        cache, outs = torch.zeros(1, 16, 2, device=DEV), []
        for x in xs:
            with torch.no_grad():
                y, cache = step(x, cache)
            outs.append(y.clone())
        outs.append(torch.rand(4, device=DEV))  # eager continues the same sequence afterwards
        return outs

    stock = run(model)
    compiled = cadence_fx.compile(model, NOISY_ADAPTER)
    ours = run(compiled)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours))
    assert compiled.counters.replays >= 10 and compiled.counters.fallbacks == 0


def test_held_outputs_survive_the_next_replay():
    model, prompt_state, xs = _toy()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    _, _, held = _stream(compiled, prompt_state, xs, hold=True)
    assert all(torch.equal(obj, copy) for obj, copy in held)
    fast = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, copy_outputs=False)
    _, _, held = _stream(fast, prompt_state, xs, hold=True)
    assert not all(torch.equal(obj, copy) for obj, copy in held)  # overwritten: documented cost
    assert compiled.counters.replays == fast.counters.replays == len(xs)


def test_capture_failure_falls_back_with_the_reason(failing_capture):
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    failing_capture(RuntimeError("operation not permitted when stream is capturing"),
                    when=lambda n: True)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    ours, addresses, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours) and len(addresses) == 1
    assert compiled.counters.replays == 0 and compiled.counters.compiled_calls == len(xs)
    # the capture is retried once after a warm-up; the reason is the second failure's, exact
    assert compiled.backend.warmups == len(compiled.classes)
    assert compiled.counters.reasons and all(
        "capture failed: RuntimeError: operation not permitted when stream is capturing" in r
        for r in compiled.counters.reasons)


@pytest.mark.parametrize("warm_up", [False, True])
def test_a_capture_that_fails_once_is_warmed_up_and_captured_again(failing_capture, warm_up):
    """A capture failing for another reason than memory (a library setting itself up lazily) is
    retried once after an eager warm-up that leaves no trace; with ``warm_up=True`` every piece
    warms up first and a failure is final."""
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    captures = failing_capture(RuntimeError("operation not permitted when stream is capturing"),
                               when=lambda n: n == 1)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER,
                                  backend=CudaGraphBackend(warm_up=warm_up))
    ours, addresses, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours) and len(addresses) == 1
    b, c = compiled.backend, compiled.counters
    if warm_up:
        assert b.warmups == len(compiled.classes) and b.captured == len(compiled.classes) - 1
        assert sum("capture failed: RuntimeError" in r for r in c.reasons) == 1
        assert c.replays + c.fallbacks == c.compiled_calls == len(xs) and c.replays > 0
    else:
        assert b.warmups == 1 and b.captured == len(compiled.classes) == len(captures) - 1
        assert c.fallbacks == 0 and c.replays == len(xs)


def test_out_of_memory_in_one_capture_leaves_the_other_classes_replaying(failing_capture):
    """A real allocation failure type, raised inside the capture of the second class only: that
    class stays eager with the reason, every other class captures and replays, all bit-exact."""
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    failing_capture(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                    when=lambda n: n == 2)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    ours, addresses, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours) and len(addresses) == 1
    reasons = [r for r in compiled.counters.reasons if "capture failed: OutOfMemoryError" in r]
    assert len(reasons) == 1
    assert compiled.backend.captured == len(compiled.classes) - 1
    assert compiled.counters.replays > 0
    # the class that failed keeps running eagerly (its reason recorded on every call)
    assert compiled.counters.reasons[reasons[0]] == compiled.counters.fallbacks


def test_off_switch_and_strict(monkeypatch):
    model, prompt_state, xs = _toy()
    monkeypatch.setenv("CADENCE_FX_DISABLE_GRAPHS", "1")
    off = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    _stream(off, prompt_state, xs[:4])
    assert off.counters.replays == 0 and off.counters.guarded_eager == 4
    monkeypatch.delenv("CADENCE_FX_DISABLE_GRAPHS")
    strict = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, strict=True)
    with pytest.raises(GuardError, match="extent 30 is not in the catalog"):
        with torch.no_grad():
            strict(xs[0], {"att": torch.zeros(2, 1, 4, 30, 32, device=DEV)})


def test_prepare_captures_before_traffic_without_touching_state():
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    before = {k: v.clone() for k, v in prompt_state.items()}
    with torch.no_grad():   # grad mode would run stock (the weights require grad)
        assert compiled.prepare(xs[0], prompt_state)
    assert compiled.backend.captured == 1 and compiled.counters.replays == 0
    assert all(torch.equal(prompt_state[k], before[k]) for k in before)
    ours, _, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours)
    assert (compiled.counters.replays, compiled.counters.fallbacks) == (len(xs), 0)


def test_capture_catalog_before_the_first_chunk():
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        done = compiled.capture_catalog(xs[0], prompt_state)
    assert all(done.values()) and len(done) == compiled.catalog.size == 6
    captured = compiled.backend.captured
    ours, _, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours)
    assert compiled.backend.captured == captured and compiled.counters.traces == 0
    assert compiled.counters.replays == len(xs)
    memory = compiled.report().memory()
    assert memory["graph_reserved_bytes"] > 0 and memory["capture_seconds"] > 0


def test_real_cfm_chunk_is_one_captured_piece():
    require(*TOKEN2WAV)
    from cadence_fx.models import token2wav
    from cadence_fx import adapters
    step = token2wav.CFMStep(token2wav.build_cfm(2, device=DEV))
    spks, prompt = token2wav.prime_cfm(step, device=DEV)
    g = torch.Generator().manual_seed(4)
    chunks = [(torch.randn(1, 80, 50, generator=g).to(DEV), torch.zeros(1, 80, 50, device=DEV))
              for _ in range(4)]

    def run(s):
        outs, state = [], prompt
        for mu, cond in chunks:
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
                mel, state = s(mu, spks, cond, state)
            outs.append(mel.clone())
        return outs

    stock = run(step)
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter)
    assert all(torch.equal(a, b) for a, b in zip(stock, run(compiled)))
    for entry in compiled.classes.values():
        assert [p.kind for p in entry.records.pieces] == ["graph"]
        assert any(k.host_to_device for k in entry.records.constants)  # the DiT table
        assert entry.records.staging_predicted == sum(
            m.staging_bytes for m in entry.gm.modules() if hasattr(m, "staging_bytes"))
    assert compiled.counters.replays == len(chunks) and compiled.counters.fallbacks == 0
    assert compiled.counters.copied_calls == 9 * compiled.counters.traces   # the DiT, per step


def test_copied_dit_calls_give_the_full_trace_on_cuda():
    """Repeated calls traced once, on CUDA fakes under the bench's autocast: node for node the
    full trace (ops, arguments, geometry, storage sharing)."""
    require(*TOKEN2WAV)
    from cadence_fx.models import token2wav
    from cadence_fx.tracing import bind_arguments, trace_step
    from test_splice import difference
    step = token2wav.CFMStep(token2wav.build_cfm(2, device=DEV))
    spks, prompt = token2wav.prime_cfm(step, device=DEV)
    mu, cond = torch.randn(1, 80, 50, device=DEV), torch.zeros(1, 80, 50, device=DEV)
    named = bind_arguments(step.forward, (mu, spks, cond, prompt), {})
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
        full = trace_step(step, step.forward, named)
        copied = trace_step(step, step.forward, named, repeated=[(step.cfm.estimator, "forward_chunk")])
    assert (copied.copied_calls, copied.refused) == (9, {})
    assert difference(full.gm, copied.gm) is None


def _moshi_frames(**compile_kw):
    """Real Mimi + LMGen (2-layer LM) on CUDA, built afresh (seeded weights): 10 frames with a
    turn reset through the stock loop and through the compiled step, every frame compared
    (PCM and tokens, ``torch.equal``). Returns the compiled step, its step closed."""
    from cadence_fx.models import moshi as M
    g = torch.Generator().manual_seed(3)
    frames = [(0.1 * torch.randn(1, 1, 1920, generator=g)).to(DEV) for _ in range(10)]
    mimi = M.build_mimi(device=DEV)
    lm_gen = M.build_lm_gen(device=DEV, seed=1, overrides=M.SMALL_LM, dtype=torch.float32)
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    stock = M.stock_stream(mimi, lm_gen, frames, reset_at=5)
    step = M.MoshiStep(mimi, lm_gen)
    compiled = cadence_fx.compile(step, M.moshi_adapter(M.SMALL_LM), **compile_kw)
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    state, ours = step.initial_state(), []
    for i, frame in enumerate(frames):
        if i == 5:
            state = step.initial_state()
        with torch.no_grad():
            pcm, tokens, state = compiled(frame, state)
        ours.append((None if pcm is None else pcm.clone(), None if tokens is None else tokens.clone()))
    same = [all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(s, o)) for s, o in zip(stock, ours)]
    assert same == [True] * 10
    step.close()
    return compiled


def test_moshi_frame_replays_bit_exact_against_the_stock_loop():
    """Real Mimi + LMGen (2-layer LM to keep the test short) on CUDA: every steady frame replays
    one graph (the boolean-mask blanking a select on the device), bit-exact against plain stock
    eager."""
    require(*MOSHI)
    compiled = _moshi_frames()
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.eager_pieces) == (10, 0, 0)
    assert k.replays == 10                     # one graph launch per frame


def test_freeze_omni_replays_bit_exact():
    from cadence_fx.models.freeze_omni import FreezeOmniEncoder
    from cadence_fx import adapters
    enc = FreezeOmniEncoder(layers=4, dim=256, heads=4, ffn=1024).to(DEV).eval()
    adapter = adapters.get("freeze-omni").with_clocks(layers=4, heads=4, head_dim=64)
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(1, 16, 80, generator=g).to(DEV) for _ in range(10)]

    ref = stream(enc, feats, enc.initial_state, "att_cache", reset_at=5, mode=torch.inference_mode)
    compiled = cadence_fx.compile(enc, adapter)
    got = stream(compiled, feats, enc.initial_state, "att_cache", reset_at=5,
                 mode=torch.inference_mode)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got))
    k = compiled.counters
    assert k.replays == 10 and k.fallbacks == 0 and len(compiled.classes) == 2


def test_real_cfm_primes_new_speakers_through_the_compiled_step_with_released_envelopes():
    """Each new speaker's cache-free prompt pass (302 frames, no state) is a class of its own,
    captured like the others: with ``release_envelopes=True`` and ``strict=True`` two speakers
    are primed and streamed, every call replays, the 2.1 GB envelope stays released."""
    require(*TOKEN2WAV)
    from cadence_fx.models import token2wav
    from cadence_fx import adapters
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")

    def serve(step):
        outs = []
        for speaker in (1, 2):
            g = torch.Generator().manual_seed(speaker)
            mu, spks, cond = (torch.randn(1, 80, 302, generator=g).to(DEV),
                              torch.randn(1, 80, generator=g).to(DEV),
                              torch.randn(1, 80, 302, generator=g).to(DEV))
            with torch.inference_mode():
                mel, state = step(mu, spks, cond, None)
                outs.append(mel.clone())
                for w in (50, 50, 50, 56):
                    mel, state = step(torch.randn(1, 80, w, generator=g).to(DEV), spks,
                                      torch.zeros(1, 80, w, device=DEV), state)
                    outs.append(mel.clone())
        return outs

    stock = serve(token2wav.CFMStep(token2wav.build_cfm(depth=2)).to(DEV))
    step = token2wav.CFMStep(token2wav.build_cfm(depth=2)).to(DEV)
    compiled = cadence_fx.compile(step, adapter, release_envelopes=True, strict=True)
    ours = serve(compiled)
    assert [torch.equal(a, b) for a, b in zip(stock, ours)] == [True] * len(stock)
    c = compiled.counters
    assert (c.fallbacks, c.compiled_calls) == (0, len(stock)) and c.replays >= len(stock)
    assert c.released_bytes >= 16 * 16 * 2 * 8 * 1000 * 128 * 4 and c.restored_bytes == 0
    assert ((None, None), 302) in {key[0] for key in compiled.classes}
    assert c.carry_addresses == 1


def test_a_restarted_step_loads_compiled_captures_and_replays_bit_exact(tmp_path):
    """The compile cache on CUDA: a second compiled step (a restart) loads every class compiled
    -- no trace, no passes, no probationary call -- captures it on first use and replays every
    call bit-exact, the carry at one address."""
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    first = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, cache_dir=tmp_path)
    assert _equal(stock, _stream(first, prompt_state, xs)[0]) and first.counters.traces == 4
    restarted = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, cache_dir=tmp_path)
    ours, addresses, _ = _stream(restarted, prompt_state, xs)
    assert _equal(stock, ours)
    c = restarted.counters
    assert (c.traces, c.cache_loads, c.compiled_loads) == (0, 4, 4)
    assert (c.replays, c.fallbacks, len(addresses)) == (len(xs), 0, 1)
    assert restarted.backend.captured == 4


def test_a_restarted_moshi_frame_loads_compiled_and_replays_bit_exact(tmp_path):
    """Real Mimi + LMGen (2-layer LM) on CUDA, restarted on a filled cache: new modules with the
    same weights, every frame class loaded compiled with its streaming state bound to the new
    modules, one graph launch per frame, bit-exact against the stock loop."""
    require(*MOSHI)
    first = _moshi_frames(cache_dir=tmp_path).counters
    assert (first.traces, first.cache_loads) == (3, 0)
    k = _moshi_frames(cache_dir=tmp_path).counters
    assert (k.traces, k.cache_loads, k.compiled_loads) == (0, 3, 3)
    assert (k.compiled_calls, k.fallbacks, k.eager_pieces, k.replays) == (10, 0, 0, 10)
