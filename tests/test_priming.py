"""Compiled priming: the prompt lengths an adapter declares are priming classes. capture_catalog
prepares them; whole streams with turn resets (each turn primed again) replay them, bit-exact
against stock; a declared length not prepared runs stock once while its class compiles in the
background, then replays; a length not declared runs stock with the reason; bad declarations
are refused with the fix. The streaming decoder of tests/streaming_decoder.py is the model."""
import dataclasses

import pytest
import torch

import cadence_fx
from cadence_fx.errors import ContractError
from replay_stand_in import StandInBackend
from stock_packages import TOKEN2WAV, missing
from streaming_decoder import CHUNK, CALL, DECODER_ADAPTER, PROMPT, chunks, make_decoder, prompt

ADAPTER = dataclasses.replace(DECODER_ADAPTER, prompt_lengths=(PROMPT, 12))
# turns: (prompt length, chunk widths), each starting with a priming pass. A 12-frame prompt only
# primes: the chunk catalog's retention keeps PROMPT prompt frames, so its chunks would run stock.
# The 5-frame partial flush is admitted and compiled at its first call, as before.
TURNS = [(PROMPT, [CHUNK, CHUNK, CHUNK, CALL]), (12, []), (PROMPT, [CHUNK, 5, CHUNK])]


def _prompt(length, speaker):
    # contiguous strides in every dim (a class key holds the strides, size-1 dims' too)
    return prompt(speaker)[:, :length].clone(memory_format=torch.contiguous_format)


def _stream(step, turns=TURNS, speaker=0):
    """Every call's output and state, priming passes included."""
    results = []
    with torch.inference_mode():
        for t, (length, widths) in enumerate(turns):
            out, state = step(_prompt(length, speaker + t), None)
            results.append((out.clone(), {k: v.clone() for k, v in state.items()}))
            for x in chunks(widths, seed=10 * speaker + t):
                out, state = step(x, state)
                results.append((out.clone(), {k: v.clone() for k, v in state.items()}))
    return results


def _equal(a, b):
    return len(a) == len(b) and all(
        torch.equal(oa, ob) and oa.shape == ob.shape and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa) for (oa, sa), (ob, sb) in zip(a, b))


def _compiled(adapter=ADAPTER):
    model = make_decoder()
    return model, cadence_fx.compile(model, adapter, backend=StandInBackend())


def _catalog(cs, model):
    with torch.inference_mode():
        _, state = model(_prompt(PROMPT, 0), None)
        return cs.capture_catalog(chunks([CHUNK], 1)[0], state)


def test_capture_catalog_prepares_every_declared_prompt_length():
    model, cs = _compiled()
    prep = _catalog(cs, model)
    priming = [r for r in prep.rows if r["class"][0] == (None, None)]
    assert [(r["class"][1], r["how"]) for r in priming] == [(12, "traced"), (PROMPT, "traced")]
    assert not any("priming" in line for line in prep.not_prepared)
    assert cs.counters.calls == 0   # preparing is not traffic
    stock = _stream(model)
    assert _equal(_stream(cs), stock)
    k = cs.counters
    assert k.traces == 1 and k.background_compiles == 0   # only the partial flush's class
    assert k.fallbacks == 0 and k.compiled_calls == k.calls == len(TURNS) + 7
    assert k.replays == k.calls and k.carry_addresses == 1


def test_undeclared_length_runs_stock_with_the_fix():
    model, cs = _compiled()
    _catalog(cs, model)
    with torch.inference_mode():
        out, _ = cs(_prompt(10, 3), None)
        ref, _ = model(_prompt(10, 3), None)
    assert torch.equal(out, ref)
    (reason,) = cs.counters.reasons
    assert "prompt length 10 is not among" in reason and "`prompt_lengths`" in reason


def test_unprepared_length_runs_stock_once_then_replays():
    model, cs = _compiled()
    stock = _stream(model, TURNS[:1])
    with torch.inference_mode():
        first = cs(_prompt(PROMPT, 0), None)
    k = cs.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (1, 0, 1)
    (reason,) = k.reasons
    assert f"prompt length {PROMPT} is compiling in the background" in reason
    assert cs.wait_background(120) and k.background_compiles == 1
    assert torch.equal(first[0], stock[0][0])
    replays = k.replays
    assert _equal(_stream(cs, TURNS[:1]), stock)
    assert k.fallbacks == 1 and k.compiled_calls == 1 + len(TURNS[0][1])
    assert k.replays > replays and k.reasons[reason] == 1


def test_background_compile_runs_in_the_callers_modes():
    """Grad, inference and autocast modes are thread-local and part of the class key: the
    background thread compiles the class of the call that started it."""
    model, cs = _compiled()
    with torch.no_grad():
        cs(_prompt(12, 0), None)
    cs.wait_background(120)
    with torch.no_grad():
        cs(_prompt(12, 0), None)
    assert (cs.counters.compiled_calls, cs.counters.fallbacks) == (1, 1)


@pytest.mark.parametrize("lengths, message", [
    (range(8, 8), "is empty"),
    (range(16, 8, -4), "positive step"),
    ((0,), "not positive"),
    ((1.5,), "neither a size nor a clock"),
    (("no_such_clock",), "names clock 'no_such_clock'"),
    (range(1, 200), "over the width limit"),
])
def test_bad_prompt_lengths_are_refused_with_the_fix(lengths, message):
    with pytest.raises(ContractError, match=message):
        dataclasses.replace(DECODER_ADAPTER, prompt_lengths=lengths).validate()


def test_prompt_lengths_as_a_range_and_clock_names():
    ranged = dataclasses.replace(DECODER_ADAPTER, prompt_lengths=range(8, 17, 4)).validate()
    assert ranged.prompt_widths() == (8, 12, 16)
    named = dataclasses.replace(DECODER_ADAPTER, prompt_lengths=("prompt", 12)).validate()
    assert named.prompt_widths() == (12, PROMPT)
    with pytest.raises(ContractError, match="no call_input"):
        dataclasses.replace(DECODER_ADAPTER, call_input=None, call_frames=(),
                            admission=None, prompt_lengths=(8,)).validate()


@pytest.mark.skipif(bool(missing(*TOKEN2WAV)), reason="needs minicpmo==0.1.2 (stock_packages)")
def test_token2wav_flow_priming_is_a_compiled_class():
    """The real flow (1 + 1 encoder blocks, DiT depth 1): the declared 154-token prompt primes
    through the compiled step, bit-exact with the stock setup_cache, and its chunks follow."""
    from cadence_fx import adapters
    from cadence_fx.models import token2wav
    step = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1)))
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2)
    assert adapter.prompt_widths() == (154,)
    cs = cadence_fx.compile(step, adapter)
    tokens, mel, spk = token2wav.prompt_call(step, seed=4)
    with torch.inference_mode():
        prep = cs.capture_catalog(torch.zeros(1, 28, dtype=torch.long), spk,
                                  token2wav.prime_flow(step)[1],
                                  priming_example=lambda n: ((tokens, spk, None),
                                                             {"prompt_mel": mel}))
        stock = {k: v.clone() for k, v in step.flow.setup_cache(tokens, mel, spk).items()}
        _, ours = cs(tokens, spk, None, prompt_mel=mel)
    assert prep[((None, None, None), 154)]
    assert (cs.counters.compiled_calls, cs.counters.fallbacks) == (1, 0)
    for k, v in stock.items():   # the carry holds the declared rows; stock's others stay zero
        cut = tuple(slice(0, s) for s in ours[k].shape)
        assert torch.equal(v[cut], ours[k]) and v.count_nonzero() == v[cut].count_nonzero(), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device graphs captured in a thread need CUDA")
def test_a_background_capture_lets_the_serving_thread_use_the_device():
    """The priming class compiles and captures its CUDA graphs in a background thread while the
    serving thread keeps allocating and polling events (what the scheduler does). Captures are
    thread-local: neither thread's CUDA calls fail the other's, and the class then replays,
    bit-exact with stock."""
    model = make_decoder().cuda()
    cs = cadence_fx.compile(model, ADAPTER)
    x = _prompt(PROMPT, 0).cuda()
    with torch.inference_mode():
        ref, _ = model(x, None)
        first, _ = cs(x, None)          # stock, while the class compiles in the background
        polls = 0
        while cs.background.pending:
            blocks = [torch.empty((k + 1) << 20, dtype=torch.uint8, device="cuda") for k in range(8)]
            event = torch.cuda.Event()
            event.record()
            event.query()
            del blocks
            polls += 1
        assert cs.wait_background(300)
        again, _ = cs(x, None)
    torch.cuda.synchronize()
    k = cs.counters
    assert not cs.background.failures, cs.background.failures
    assert k.background_compiles == 1 and k.replays > 0 and polls > 0, k.as_dict()
    assert torch.equal(first, ref) and torch.equal(again, ref)
