"""Lanes on the real Token2Wav code: a conversation on every lane of a flow pool and a HiFT pool
(the vocoder draws device randomness), each chunk's mel and PCM compared with ``torch.equal``
against the same speaker alone through stock; lanes 1.. thaw lane 0's compiled classes
(``lanes.py``) or, with the sharing refused, compile them from the shared traces. On the CPU the
graphs are the stand-in backend's; on CUDA real captures and replays (``pytest -m gpu``)."""
from __future__ import annotations

import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from cadence_fx.class_store import ClassStore
from replay_stand_in import StandInBackend
from stock_packages import TOKEN2WAV, require

require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

pytestmark = pytest.mark.gpu   # on CUDA where it is there (the device's -m gpu), else the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNKS = 4   # 302 -> 352 -> 402 retained frames, then 402 again: every steady class


@pytest.fixture(scope="module")
def steps():
    """Flow and HiFT; on CUDA with deterministic kernels pinned for this module only (stock HiFT is
    not reproducible without them there; the settings are process-wide and the modes are part of
    class keys, so later tests get the process's own back)."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    if DEVICE == "cuda":
        cadence_fx.pin_deterministic_kernels()
    flow = token2wav.FlowStep(token2wav.build_flow(1, blocks=(1, 1), device=DEVICE))
    hift = token2wav.HiFTStep(token2wav.build_hift(device=DEVICE))
    yield flow, hift
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def _autocast():
    return torch.autocast(DEVICE, dtype=torch.float32, enabled=DEVICE == "cuda")


def _tokens(speaker):
    g = torch.Generator().manual_seed(50_000 + speaker)
    return [torch.randint(0, 6561, (1, 28), generator=g).to(DEVICE) for _ in range(CHUNKS)]


def _alone(flow, hift, speaker):
    """The speaker alone through stock: each chunk's (mel, PCM) on the host."""
    return token2wav.stock_conversation(
        flow, hift, token2wav.prompt_call(flow, seed=speaker, device=DEVICE), _tokens(speaker),
        seed=1000 + speaker, device=DEVICE)


def _served(fpool, hpool, flow, speaker, lane):
    """The speaker through both pools on ``lane``: primed by the flow's priming class."""
    tokens, mel_p, spk = token2wav.prompt_call(flow, seed=speaker, device=DEVICE)
    fid = fpool.open(None, seed=1000 + speaker, lane=lane)
    hid = hpool.open(token2wav.empty_hift_cache(DEVICE), seed=1000 + speaker, lane=lane)
    stream = fpool.lanes[lane].stream
    out = []
    with torch.inference_mode():
        with _autocast():
            fpool.step(fid, tokens, spk, prompt_mel=mel_p)
        for tok in _tokens(speaker):
            with _autocast():
                mel, _ = fpool.step(fid, tok, spk)
            with torch.cuda.stream(stream) if stream is not None else _Null():
                pcm = hpool.step(hid, mel)[0]
                if stream is not None:   # HiFT ran on its own pool's lane stream
                    stream.wait_event(hpool.done(hid))
                out.append((mel.cpu(), pcm.cpu()))
    fpool.close(fid)
    hpool.close(hid)
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("classes", ["thawed", "traced"])
def test_every_lane_serves_token2wav_bit_exact(steps, classes, monkeypatch):
    flow, hift = steps
    if classes == "traced":   # the lanes compile from lane 0's traces, as before sharing
        monkeypatch.setattr(ClassStore, "shared_class", lambda self, key: None)
    backend = (lambda i: StandInBackend()) if DEVICE == "cpu" else None
    adapter = adapters.get("minicpmo-token2wav-flow").with_clocks(conformer_layers=2)
    cflow = cadence_fx.compile(flow, adapter, backend=backend and backend(0))
    chift = cadence_fx.compile(hift, "minicpmo-token2wav-hift", backend=backend and backend(0))
    fpool = cadence_fx.SessionPool(cflow, lanes=2, backend_for_lane=backend)
    hpool = cadence_fx.SessionPool(chift, lanes=2, backend_for_lane=backend)
    tokens, mel_p, spk = token2wav.prompt_call(flow, device=DEVICE)
    with torch.inference_mode(), _autocast():   # every flow class and the priming class
        state = {k: v.clone() for k, v in flow(tokens, spk, None, prompt_mel=mel_p)[1].items()}
        preps = fpool.capture_catalog(torch.zeros(1, 28, dtype=torch.long, device=DEVICE), spk,
                                      state, priming_example=lambda n: ((tokens, spk, None),
                                                                        {"prompt_mel": mel_p}))
    thawed = classes == "thawed"
    assert [(p.work["lane_loads"], p.work["trace_copies"]) for p in preps] == [
        (0, 0), (4, 0) if thawed else (0, 4)], preps
    diffs = []
    for lane in (0, 1, 1, 0):   # each lane twice: its classes met, then steady
        speaker = 7 + len(diffs) + 10 * lane
        got, want = _served(fpool, hpool, flow, speaker, lane), _alone(flow, hift, speaker)
        for i, ((m, p), (wm, wp)) in enumerate(zip(got, want)):
            for name, a, b in (("mel", m, wm), ("pcm", p, wp)):
                if not torch.equal(a, b):
                    diffs.append(f"lane {lane} speaker {speaker} chunk {i} {name}: max |diff| "
                                 f"{(a.double() - b.double()).abs().max().item():.3e}")
        diffs.append(None)   # one conversation done
    assert not [d for d in diffs if d], "\n".join(d for d in diffs if d)
    # HiFT's classes compiled in traffic (the flow's preparation moves no counters)
    assert hpool.lanes[1].compiled.counters.lane_loads == (2 if thawed else 0)
    for pool in (fpool, hpool):   # compiled and replayed on both lanes, nothing fell back
        for lane in pool.lanes:
            k = lane.compiled.counters
            assert k.compiled_calls > 0 and k.replays > 0 and k.fallbacks == 0, dict(k.reasons)
