"""The CUDA graph lowering itself (``cadence_fx/cudagraphs.py``): one pool per backend, staging of
every dtype, write-back of staged inputs, the side-stream warm-up, exact failure reasons and log
lines, and the capture accounting. Each test pins a behaviour the mutation run of that file
(``bench/mutation_gpu.py``) found unpinned. Skipped without CUDA; run on the device."""
import logging
import time
import types

import pytest
import torch

import cadence_fx
import cadence_fx.cudagraphs as cg
from cadence_fx.cudagraphs import CudaGraphBackend, _capture_failed
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER
from cadence_fx.replay import GuardedPiece
from test_gpu import _equal, _stream, _toy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


def _pieces(compiled):
    return [m for e in compiled.classes.values() for m in e.gm.modules()
            if isinstance(m, GuardedPiece)]


def _piece(fn, fixed, mutated, escaping, name="piece_0"):
    """What ``lower`` reads of a piece, around a plain function."""
    return types.SimpleNamespace(module=fn, piece_name=name, fixed=fixed, mutated=mutated,
                                 escaping=escaping, staging_bytes=0)


def test_a_new_backend_starts_from_nothing():
    b = CudaGraphBackend()
    assert b.copy_outputs is True and b.warm_up is False
    assert (b.captured, b.warmups, b.staging_bytes) == (0, 0, 0)
    assert (b.capture_seconds, b.warmup_seconds) == (0.0, 0.0)
    assert (b.graph_allocated_bytes, b.graph_reserved_bytes) == (0, 0)


def test_a_default_backend_keeps_held_outputs():
    model, prompt_state, xs = _toy()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, backend=CudaGraphBackend())
    _, _, held = _stream(compiled, prompt_state, xs, hold=True)
    assert compiled.counters.replays == len(xs)
    assert all(torch.equal(obj, copy) for obj, copy in held)


def test_every_class_of_a_step_captures_into_one_pool():
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    ours, _, _ = _stream(compiled, prompt_state, xs)
    assert _equal(stock, ours) and compiled.counters.replays == len(xs)
    graphs = [p.replay.graph for p in _pieces(compiled) if p.replay is not None]
    assert len(graphs) == compiled.backend.captured >= 3
    assert len({g.pool() for g in graphs}) == 1


def test_capture_accounting_sums_every_capture(monkeypatch):
    """Timing and memory deltas are summed over captures: fixed fakes make each capture add
    exactly one known amount."""
    class Event(torch.cuda.Event):
        def elapsed_time(self, end):
            return 250.0                                   # ms

    ticks = {"allocated": 0, "reserved": 0}

    def counter(kind, step):
        def read(*args, **kwargs):
            ticks[kind] += step
            return ticks[kind]
        return read

    model, prompt_state, xs = _toy()
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "memory_allocated", counter("allocated", 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", counter("reserved", 4096))
    _stream(compiled, prompt_state, xs)
    b = compiled.backend
    assert b.captured >= 3 and compiled.counters.replays == len(xs)
    assert b.capture_seconds == pytest.approx(0.25 * b.captured, rel=0, abs=1e-12)
    assert b.graph_allocated_bytes == 1000 * b.captured
    assert b.graph_reserved_bytes == 4096 * b.captured


class _InWarmUp(cg.TensorSnapshot):
    """The warm-up takes its snapshot first and restores it last: a flag for the window."""
    active = False

    def __init__(self, tensors):
        super().__init__(tensors)
        _InWarmUp.active = True

    def restore(self):
        _InWarmUp.active = False
        super().restore()


def test_the_warm_up_runs_on_a_side_stream_and_is_timed(monkeypatch):
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)
    streams, captures = [], []

    def hook(module, args):
        if isinstance(module, torch.fx.GraphModule) and torch.cuda.is_current_stream_capturing():
            captures.append(torch.cuda.current_stream())
        if _InWarmUp.active and isinstance(module, torch.fx.GraphModule):
            streams.append(torch.cuda.current_stream())
            time.sleep(0.05)                                # each warm-up takes >= 50 ms

    monkeypatch.setattr(cg, "TensorSnapshot", _InWarmUp)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER,
                                      backend=CudaGraphBackend(warm_up=True))
        start = time.perf_counter()
        ours, _, _ = _stream(compiled, prompt_state, xs)
        wall = time.perf_counter() - start
    finally:
        handle.remove()
    b = compiled.backend
    assert _equal(stock, ours) and compiled.counters.replays == len(xs)
    assert b.warmups == b.captured >= 3 and streams
    assert all(s != torch.cuda.default_stream() for s in streams)
    # one side stream for all of them: each stream the BLAS libraries run on keeps a workspace
    assert len({s.cuda_stream for s in streams}) == 1
    # and the captures run on it too (not on torch.cuda.graph's own stream)
    assert captures and {s.cuda_stream for s in captures} == {s.cuda_stream for s in streams}
    assert 0.05 * b.warmups <= b.warmup_seconds <= b.capture_seconds <= wall


def test_a_failed_warm_up_names_the_exception(monkeypatch):
    model, prompt_state, xs = _toy()
    stock, _, _ = _stream(model, prompt_state, xs)

    def hook(module, args):
        if _InWarmUp.active and isinstance(module, torch.fx.GraphModule):
            raise RuntimeError("lazy init not allowed here")

    monkeypatch.setattr(cg, "TensorSnapshot", _InWarmUp)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER,
                                      backend=CudaGraphBackend(warm_up=True))
        ours, _, _ = _stream(compiled, prompt_state, xs)
    finally:
        handle.remove()
    c = compiled.counters
    assert _equal(stock, ours) and c.replays == 0 and c.compiled_calls == len(xs)
    assert c.reasons and all("warm-up failed: RuntimeError: lazy init not allowed here" in r
                             for r in c.reasons)


def test_a_capture_retried_after_a_warm_up_logs_why(failing_capture, caplog):
    model, prompt_state, xs = _toy()
    failing_capture(RuntimeError("operation not permitted when stream is capturing\ndetails"),
                    when=lambda n: n == 1)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    with caplog.at_level(logging.DEBUG, logger="cadence_fx.cudagraphs"):
        _stream(compiled, prompt_state, xs)
    assert compiled.counters.replays == len(xs)
    lines = [r.getMessage() for r in caplog.records if r.name == "cadence_fx.cudagraphs"]
    first = _pieces(compiled)[0].piece_name
    assert lines[0] == (f"{first}: capture failed: RuntimeError: operation not permitted when "
                        "stream is capturing; warming up and capturing again")
    captured = lines[1:]
    assert len(captured) == compiled.backend.captured
    for p in _pieces(compiled):
        if p.replay is not None:
            line = f"{p.piece_name} captured: {len(p._staged)} staged inputs ({p.staging_bytes} bytes)"
            assert line in captured and p.staging_bytes > 0


def test_capture_failure_reasons_keep_the_first_line():
    assert _capture_failed(RuntimeError("first\nsecond")) == "capture failed: RuntimeError: first"
    assert _capture_failed(RuntimeError("")) == "capture failed: RuntimeError: "


def test_a_piece_without_cuda_inputs_is_not_lowered():
    piece = _piece(lambda n, x: (x * n,), [False, False], [False, False], [True])
    assert CudaGraphBackend().lower(piece, (3, torch.ones(4))) == \
        (None, "no CUDA tensor among the piece's inputs")


def test_staged_inputs_of_every_dtype_and_python_scalars():
    """int64 tokens and bf16 features are staged in their own dtypes, strides kept; a Python
    scalar argument is passed through, not staged; staging bytes add up over the inputs."""
    emb = torch.randn(50, 8, device=DEV)

    def fn(scale, tokens, feats):
        return (emb[tokens] * scale + feats.float(),)

    tokens = torch.randint(0, 50, (3, 5), device=DEV)
    feats = torch.randn(5, 3, 8, device=DEV, dtype=torch.bfloat16).transpose(0, 1)
    piece = _piece(fn, [False, False, False], [False, False, False], [True])
    replay, reason = CudaGraphBackend().lower(piece, (2, tokens, feats))
    assert reason is None
    assert piece.staging_bytes == tokens.untyped_storage().nbytes() + feats.untyped_storage().nbytes()
    for _ in range(3):
        tokens.random_(0, 50)
        feats.normal_()
        assert torch.equal(replay((2, tokens, feats))[0], fn(2, tokens, feats)[0])


def test_a_staged_input_written_in_place_is_written_back():
    def fn(x, w):
        x.mul_(w)
        return (x.sum(),)

    w = torch.full((6,), 2.0, device=DEV)
    piece = _piece(fn, [False, True], [True, False], [True])
    x = torch.arange(6.0, device=DEV)
    replay, reason = CudaGraphBackend().lower(piece, (x.clone(), w))
    assert reason is None
    y = torch.arange(6.0, device=DEV)
    (s,) = replay((y, w))
    assert torch.equal(y, torch.arange(6.0, device=DEV) * 2) and s.item() == 30.0


def test_a_large_snapshot_is_kept_on_the_host_and_put_back_bit_for_bit():
    """The compile's snapshots (probationary call, warm-ups) of a large carry take no device
    memory beside it, and restore every bit, NaN payloads and -0 included; small tensors are
    cloned on the device."""
    from cadence_fx.effects import HOST_SNAPSHOT_BYTES, TensorSnapshot
    big = torch.randn(HOST_SNAPSHOT_BYTES // 4 * 8, device=DEV)
    big[:3] = torch.tensor([-0.0, float("nan"), float("inf")])
    big.view(torch.int32)[1] |= 0x1234   # a NaN with a payload
    small = torch.randn(16, device=DEV)
    bits = big.view(torch.int32).clone(), small.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    snapshot = TensorSnapshot([big, small, big])
    big.fill_(1.0)     # what the probe writes
    small.fill_(2.0)
    held = torch.cuda.max_memory_allocated() - before
    assert held < big.numel() * big.element_size(), f"{held} bytes held on the device"
    assert [c.device.type for _, c in snapshot.saved] == ["cpu", "cuda"]
    snapshot.restore()
    torch.cuda.synchronize()
    assert torch.equal(big.view(torch.int32), bits[0]) and torch.equal(small, bits[1])
