"""Runtime edge cases: state the step keeps in its module, fallbacks in the middle of a stream,
steps that cannot be traced, catalogs too wide to specialise. On the CPU, and on CUDA where
device graphs change the picture (marked gpu)."""
import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow
from cadence_fx.errors import GuardError
from cadence_fx.models.toy import RING_ADAPTER, RingToy

ADAPTER = Adapter(name="edge", clocks={"ctx": 2, "f_chunk": 4, "dim": 8, "batch": 1},
                  regions=(Region(name="c", input="cache", output="1", dim=2,
                                  retention=SlidingWindow("ctx", start="ctx"), advance="f_chunk",
                                  ordering=APPEND, shape=("batch", "dim", None)),),
                  call_frames=("f_chunk",), call_input="x", call_dim=2, admission="f_chunk")


class PositionBuffer(nn.Module):
    """Advances a position buffer in place every call (a frame counter, a rotary offset)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(8, 8, 3)
        self.register_buffer("pos", torch.zeros(1))

    def forward(self, x, cache):
        xc = torch.cat([cache, x], 2)
        y = self.conv(xc) + self.pos
        self.pos.add_(x.shape[2])
        return y, xc[:, :, -2:]


class PositionAttribute(PositionBuffer):
    """The same counter held in a plain attribute (streaming state, as Moshi keeps it)."""

    def __init__(self):
        super().__init__()
        del self.pos
        self.pos = torch.zeros(1)

    def to(self, device):
        super().to(device)
        self.pos = self.pos.to(device)
        return self


class HostBranch(PositionBuffer):
    def forward(self, x, cache):
        if float(x.sum().item()) > 1e9:  # Python control flow on a value: cannot be traced
            x = x * 2
        return super().forward(x, cache)


def _loop(step, xs, device="cpu"):
    cache, ys = torch.zeros(1, 8, 2, device=device), []
    for x in xs:
        with torch.no_grad():
            y, cache = step(x, cache)
        ys.append(y.clone())
    return ys, cache.clone()


def _xs(widths, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 8, w, generator=g).to(device) for w in widths]


def test_fallback_in_mid_stream_keeps_module_buffers_in_step():
    xs = _xs([4, 4, 6, 4, 4])  # the 6-frame call is not admitted: it runs the stock step
    ref = _loop(PositionBuffer(), xs)
    compiled = cadence_fx.compile(PositionBuffer(), ADAPTER)
    got = _loop(compiled, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (4, 1)
    assert k.reasons == {"call width 6 is neither a declared call width [4] nor admitted "
                         "(admission f_chunk = 4); declare a clock of 6 in `call_frames`, or an "
                         "`admission` clock of at least 6 for partial calls": 1}


def test_module_state_attribute_is_advanced_once_per_call():
    xs = _xs([4] * 5)
    stock, model = PositionAttribute(), PositionAttribute()
    ref = _loop(stock, xs)
    compiled = cadence_fx.compile(model, ADAPTER)
    got = _loop(compiled, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert torch.equal(stock.pos, model.pos)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (5, 0)


def test_untraceable_class_runs_stock_with_the_reason():
    xs = _xs([4] * 3)
    ref = _loop(HostBranch(), xs)
    compiled = cadence_fx.compile(HostBranch(), ADAPTER)
    got = _loop(compiled, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert compiled.counters.traces == 0 and compiled.counters.fallbacks == 3
    assert any("could not be traced" in r for r in compiled.counters.reasons)
    with pytest.raises(cadence_fx.TraceError), torch.no_grad():
        cadence_fx.compile(HostBranch(), ADAPTER, strict=True)(xs[0], torch.zeros(1, 8, 2))


def test_catalog_too_wide_runs_stock():
    wide = ADAPTER.with_clocks(ctx=200)
    wide = Adapter(**{**{f: getattr(wide, f) for f in ("name", "clocks", "call_frames",
                                                       "call_input", "call_dim", "admission")},
                      "regions": (Region(name="c", input="cache", output="1", dim=2,
                                         retention=SlidingWindow("ctx"), advance="unit",
                                         ordering=APPEND, shape=("batch", "dim", None)),),
                      "clocks": {**wide.clocks, "unit": 1}})
    compiled = cadence_fx.compile(PositionBuffer(), wide)
    xs = _xs([4])
    assert torch.equal(_loop(PositionBuffer(), xs)[0][0], _loop(compiled, xs)[0][0])
    assert compiled.counters.traces == 0
    assert any("K = 201" in r and "Criterion 3.5" in r for r in compiled.counters.reasons)
    with pytest.raises(GuardError, match="width limit"):
        cadence_fx.compile(PositionBuffer(), wide, strict=True)


class SharedAndLazy(nn.Module):
    """One submodule registered under two names, and a buffer registered lazily on first use
    (Mimi's codebook cache does this): tracing must leave the user's module as it found it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(8, 8, 3)
        self.alias = self.conv
        self.register_buffer("scale_sum", torch.full((8,), 4.0))
        self.register_buffer("_scale", None, persistent=False)

    @property
    def scale(self):
        if self._scale is None:
            s = self.scale_sum / 2
            self.register_buffer("_scale", s, persistent=False)
            return s
        return self._scale

    def forward(self, x, cache):
        xc = torch.cat([cache, x], 2)
        return self.alias(xc) * self.scale.view(1, -1, 1), xc[:, :, -2:]


def test_tracing_leaves_shared_weights_and_lazy_buffers_real():
    xs = _xs([4] * 4)
    ref = _loop(SharedAndLazy(), xs)
    model = SharedAndLazy()
    compiled = cadence_fx.compile(model, ADAPTER)
    got = _loop(compiled, xs)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert compiled.counters.traces == 1 and compiled.counters.fallbacks == 0
    fake = torch._subclasses.FakeTensor
    assert not any(isinstance(t, fake) for t in [*model.parameters(), *model.buffers()])
    assert model._scale is None or not isinstance(model._scale, fake)
    # and the stock module still runs eagerly afterwards, with the same result
    assert torch.equal(_loop(model, xs)[0][-1], ref[0][-1])


def test_real_tracing_mode_is_refused():
    with pytest.raises(ValueError, match="use 'fake'"):
        cadence_fx.compile(PositionBuffer(), ADAPTER, tracing_mode="real")




@pytest.mark.parametrize("cls", [PositionBuffer, PositionAttribute])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_does_not_advance_state_on_cuda(cls):
    xs = _xs([4] * 6, "cuda")
    ref = _loop(cls().to("cuda"), xs, "cuda")
    compiled = cadence_fx.compile(cls().to("cuda"), ADAPTER)
    got = _loop(compiled, xs, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert compiled.counters.replays == len(xs)


class HostOffset(RingToy):
    """A host copy of the offset first: an eager piece splits the graph, so the carry view and
    the write into it reach the next piece as inputs."""

    def forward(self, x, kv, offset):
        host = offset.cpu()
        y, kv, off = super().forward(x, kv, offset)
        return y, kv, off, host


@pytest.mark.parametrize("cls,options", [(RingToy, {"state_rule": False}), (HostOffset, {})])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_place_writes_reach_their_owner_on_replay(cls, options):
    def stream(step):
        g = torch.Generator().manual_seed(0)
        kv = torch.zeros(2, 1, 2, 16, 16, device="cuda")
        off, ys = torch.zeros(1, dtype=torch.long, device="cuda"), []
        for _ in range(20):
            with torch.no_grad():
                r = step(torch.randn(1, 1, 32, generator=g).cuda(), kv, off)
            ys.append(r[0].clone())
            kv, off = r[1], r[2]
        return ys, kv.clone()

    torch.manual_seed(0)
    ref = stream(cls().cuda())
    torch.manual_seed(0)
    compiled = cadence_fx.compile(cls().cuda(), RING_ADAPTER, **options)
    got = stream(compiled)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0])) and torch.equal(ref[1], got[1])
    assert compiled.counters.replays > 0


def _prompt_stream(widths, reset_at):
    from cadence_fx.models.toy import PromptRetainedToy
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        _, st = PromptRetainedToy()(torch.randn(1, 24, 64, generator=g), None)
    prompt = {k: v.clone() for k, v in st.items()}
    xs = [torch.randn(1, w, 64, generator=g) for w in widths]

    def run(step):
        outs, state = [], prompt
        for i, x in enumerate(xs):
            if i == reset_at:
                state = prompt
            with torch.no_grad():
                y, state = step(x, state)
            outs.append(y.clone())
        return outs
    return run


def test_release_envelopes_frees_the_stock_buffer_and_restores_it_on_fallback():
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    run = _prompt_stream([8] * 5 + [10] + [8, 8], reset_at=6)
    ref = run(PromptRetainedToy())
    model = PromptRetainedToy()
    envelope = model.att_cache_buffer.untyped_storage().nbytes()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, release_envelopes=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, run(compiled)))
    assert compiled.counters.released_bytes == envelope > 0
    assert model.att_cache_buffer.untyped_storage().nbytes() == 0
    # a call outside the catalog runs the stock step: the envelope comes back, zero-filled
    run_odd = _prompt_stream([8, 13], reset_at=99)  # 13 frames: wider than any admitted call
    assert all(torch.equal(a, b) for a, b in zip(run_odd(PromptRetainedToy()), run_odd(compiled)))
    assert compiled.counters.fallbacks == 1 and compiled.counters.restored_bytes == envelope
    assert model.att_cache_buffer.untyped_storage().nbytes() == envelope


def test_trace_cache_is_shared_between_compiled_steps_of_one_module():
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    run = _prompt_stream([8] * 5 + [10] + [8, 8], reset_at=6)
    ref = run(PromptRetainedToy())
    model, cache = PromptRetainedToy(), {}
    first = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, trace_cache=cache)
    second = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, trace_cache=cache, verify=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, run(first)))
    assert all(torch.equal(a, b) for a, b in zip(ref, run(second)))   # rewritten from copies
    assert first.counters.traces == len(cache) > 0 and second.counters.traces == 0
    assert second.counters.retentions == first.counters.retentions > 0
    assert sum(second.auditor.comparisons.values()) > 0


def test_state_or_input_on_another_device_is_a_contract_error():
    compiled = cadence_fx.compile(PositionBuffer(), ADAPTER)
    x, cache = _xs([4])[0], torch.zeros(1, 8, 2)
    with pytest.raises(cadence_fx.ContractError, match=r"region 'c' state 'cache' is on meta, but "
                                                       r"the step's weights are on cpu"):
        compiled(x, cache.to("meta"))
    with pytest.raises(cadence_fx.ContractError, match=r"call input 'x' is on meta"):
        compiled(x.to("meta"), cache)
    assert compiled.counters.traces == 0   # refused before anything ran


def test_state_of_another_dtype_is_a_contract_error():
    compiled = cadence_fx.compile(PositionBuffer(), ADAPTER)
    x, cache = _xs([4])[0], torch.zeros(1, 8, 2)
    with pytest.raises(cadence_fx.ContractError,
                       match=r"region 'c' state 'cache' is torch.float64 \(8-byte elements\), but the "
                             r"region declares element_bytes=4 and the step's weights are "
                             r"torch.float32; cast it with .to\(torch.float32\)"):
        compiled(x, cache.double())
    assert compiled.counters.traces == 0
    with torch.no_grad():   # the declared width is honoured: the same call in float32 runs
        compiled(x, cache)
    assert (compiled.counters.compiled_calls, compiled.counters.fallbacks) == (1, 0)


def test_a_wrong_shaped_call_raises_torchs_error_without_a_fake_tensor_traceback(capfd, caplog):
    """The trace fails on fake tensors, the class runs the stock step with torch's message as
    its reason, and the stock step raises torch's own error: no fake-tensor traceback on stderr."""
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    model = PromptRetainedToy()
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64), None)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        with torch.no_grad():
            compiled(torch.randn(1, 8, 63), state)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fake_tensor" not in err
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    (reason,) = compiled.store.verdicts.values()
    assert "make_fx could not trace" in reason and "same reduction dim" in reason
    with torch.no_grad():   # the right shape still compiles and runs
        compiled(torch.randn(1, 8, 64), state)
    assert compiled.counters.compiled_calls == 1


# -- a donated starting state ----------------------------------------------------------------------

def test_a_donated_state_narrower_than_its_carry_is_copied_as_always():
    """``donate_state=True`` takes over only a state already in its carry's layout: the
    conformer's carries are wider than a prompt's state (room for the catalog's extents), so
    every region is copied, the donated tensors are not written, and the stream is stock's."""
    from streaming_conformer import (CONFORMER_ADAPTER, LAYERS, chunk_feats, clone_state,
                                     make_model, prompt_feats)
    stock_model, model = make_model(), make_model()
    with torch.no_grad():
        _, prompt = stock_model(prompt_feats(0), None)
    compiled = cadence_fx.compile(model, CONFORMER_ADAPTER, donate_state=True)
    ref_state, donated = clone_state(prompt), clone_state(prompt)
    ours_state = donated
    for n, x in enumerate(chunk_feats([8, 12, 8, 4], seed=11)):
        with torch.no_grad():
            torch.manual_seed(n)
            out, ours_state = compiled(x, ours_state)
            torch.manual_seed(n)
            ref, ref_state = stock_model(x, ref_state)
        assert torch.equal(out, ref) and all(torch.equal(ours_state[k], ref_state[k]) for k in ref_state)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.adoptions, k.absorptions) == (4, 0, 0, 3 * LAYERS)
    assert all(torch.equal(donated[k], prompt[k]) for k in prompt)


def test_without_donation_a_state_of_the_carrys_layout_is_copied_and_never_written():
    from streaming_conformer import CONFORMER_ADAPTER, LAYERS, chunk_feats, clone_state, make_model, prompt_feats
    model = make_model()
    with torch.no_grad():
        _, prompt = make_model()(prompt_feats(0), None)
    kept = clone_state(prompt)
    compiled = cadence_fx.compile(model, CONFORMER_ADAPTER)
    with torch.no_grad():
        compiled(chunk_feats([8], seed=2)[0], prompt)
    assert compiled.counters.adoptions == 0 and compiled.counters.absorptions == 3 * LAYERS
    assert all(torch.equal(prompt[k], kept[k]) for k in kept)


def test_a_session_pool_refuses_a_step_that_takes_its_states_over():
    from cadence_fx.errors import ContractError
    from cadence_fx.sessions import SessionPool
    from streaming_conformer import CONFORMER_ADAPTER, make_model
    compiled = cadence_fx.compile(make_model(), CONFORMER_ADAPTER, donate_state=True)
    with pytest.raises(ContractError, match="donate_state"):
        SessionPool(compiled)


def test_preparing_a_donating_step_copies_the_example_and_never_takes_it_over():
    """``prepare`` compiles from an example, which is not the stream's state: with
    ``donate_state=True`` it is still copied into the carries and left as it was."""
    m = RingToy()
    compiled = cadence_fx.compile(m, RING_ADAPTER, donate_state=True)
    example = torch.zeros(2, 1, 2, 16, 16)
    with torch.no_grad():
        assert compiled.prepare(torch.randn(1, 1, 32), example, torch.tensor([0]))
    assert compiled.carries["kv"].tensor.data_ptr() != example.data_ptr()
    with torch.no_grad():
        compiled(torch.randn(1, 1, 32), torch.zeros(2, 1, 2, 16, 16), torch.tensor([0]))
    assert not example.any()


def test_the_signature_reads_tf32_through_the_api_torch_now_has():
    """After the new ``fp32_precision`` API was used, reading the legacy ``allow_tf32`` raises;
    every call reads the signature, so it reads the new one, and a change makes a new class.
    (Set and put back by hand: the switch is a property of torch's module object, which
    pytest's monkeypatch since 9.2 takes for an attribute to delete afterwards.)"""
    from cadence_fx.signature import global_signature
    matmul = torch.backends.cuda.matmul
    before, kept = global_signature(), matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert global_signature() != before
        m = RingToy()
        compiled = cadence_fx.compile(m, RING_ADAPTER)
        with torch.no_grad():
            compiled(torch.randn(1, 1, 32), torch.zeros(2, 1, 2, 16, 16), torch.tensor([0]))
        assert compiled.counters.compiled_calls == 1
    finally:
        matmul.fp32_precision = kept
    assert matmul.fp32_precision == kept


def test_an_envelope_naming_no_buffer_is_refused_at_compile_time_with_the_buffers():
    """A misspelt ``envelope`` would keep the stock buffer's memory and leave its readers
    unguarded without a word: compile refuses it, listing the module's buffers."""
    import dataclasses

    from cadence_fx.errors import ContractError
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    region = dataclasses.replace(PROMPT_RETAINED_ADAPTER.regions[0], envelope="att_cache_bufer")
    bad = dataclasses.replace(PROMPT_RETAINED_ADAPTER, regions=(region,))
    with pytest.raises(ContractError, match=r"region 'att'.*envelope 'att_cache_bufer'.*no buffer "
                                            r"of that name \(its buffers: att_cache_buffer\); did "
                                            r"you mean 'att_cache_buffer'\? fix `envelope`"):
        cadence_fx.compile(PromptRetainedToy(), bad)
    # the right name, as the last component or the full dotted path, compiles
    holder = nn.Module()
    holder.toy = PromptRetainedToy()
    dotted = dataclasses.replace(PROMPT_RETAINED_ADAPTER, regions=(dataclasses.replace(
        region, envelope="toy.att_cache_buffer"),))
    assert cadence_fx.compile(holder.toy.forward, dotted, module=holder).counters.calls == 0
    assert cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER).counters.calls == 0


def test_a_misspelt_state_key_is_refused_at_the_first_call_that_hands_the_state_over():
    """compile time sees the step's arguments, not the keys of a state dict: a misspelt
    argument is refused there, a misspelt key at the first call that passes the state. With one
    region, no key found once passed for a priming pass (a class compiled on every call)."""
    import dataclasses

    from cadence_fx.errors import ContractError
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    (region,) = PROMPT_RETAINED_ADAPTER.regions
    for path in ("cahce.att", "cache.atr"):
        bad = dataclasses.replace(PROMPT_RETAINED_ADAPTER, regions=(dataclasses.replace(
            region, input=path),))
        if path.startswith("cahce"):
            with pytest.raises(ContractError, match=r"region 'att' reads 'cahce.att', but the "
                                                    r"step's arguments are \['x', 'cache'\]"):
                cadence_fx.compile(PromptRetainedToy(), bad)
            continue
        compiled = cadence_fx.compile(PromptRetainedToy(), bad)
        with torch.no_grad():
            y, state = compiled(torch.randn(1, 24, 64), None)   # priming: no state to check
            with pytest.raises(ContractError, match=r"region 'att' of adapter 'toy-prompt-retained' "
                                                    r"reads 'cache.atr', but the step's 'cache' "
                                                    r"holds \['att'\]; fix the region's `input` "
                                                    r"\(to prime, pass 'cache' as None"):
                compiled(torch.randn(1, 8, 64), state)
        k = compiled.counters
        assert (k.calls, k.compiled_calls, k.traces, k.fallbacks) == (2, 1, 1, 0)
    # the right key: a state whose entry is None primes too (the None is no state to absorb)
    compiled = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER)
    with torch.no_grad():
        y, state = compiled(torch.randn(1, 24, 64), {"att": None})
        compiled(torch.randn(1, 8, 64), state)
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.traces, k.fallbacks) == (2, 2, 2, 0)
