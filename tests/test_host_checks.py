"""istft's host check on a constant window made once per class (passes/host_checks.py): the call
becomes its aten ops, bit-exact against stock over whole streams, and the graph is one piece. A
window whose envelope fails the check, or one that is module state not declared constant, keeps
the stock call with the reason.

Each stream compares every output and the state with ``torch.equal`` against the stock module and
asserts that the compiled path ran (every call compiled, no fallback) and what the pass did."""
import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.contract import Adapter
from cadence_fx.passes.fx_utils import aten
from cadence_fx.passes.pipeline import Options
from helpers import stream, window_adapter

W = 8
ADAPTER = window_adapter("vocoder", (1, "bins", None), w=W, c=4, region="ctx", clocks={"bins": 9},
                         constants=("window",))
ISTFT_KEPT = "istft checks its window on the host (not capturable)"


class Vocoder(nn.Module):
    """A streaming vocoder tail: a magnitude/phase head over the left context, then an inverse
    STFT (n_fft 16, hop 4) with a window held in a plain attribute, as HiFT holds its own."""

    def __init__(self, window: torch.Tensor, hop: int = 4, center: bool = True):
        super().__init__()
        self.head = nn.Conv1d(9, 18, 3)
        self.window = window
        self.hop, self.center = hop, center

    def forward(self, x, cache):
        full = torch.cat([cache["ctx"], x], 2)
        h = self.head(nn.functional.pad(full, (2, 0)))
        mag, phase = h[:, :9].exp().clamp(max=1e2), h[:, 9:]
        spec = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))
        y = torch.istft(spec, 16, self.hop, 16, window=self.window.to(x.device),
                        center=self.center)
        return y, {"ctx": full[:, :, -W:]}


def _stream(step, xs):
    return stream(step, xs, lambda: {"ctx": torch.zeros(1, 9, 0, device=xs[0].device)}, "ctx")


def _run(window, device="cpu", calls=10, adapter=ADAPTER, cache_dir=None, **options):
    torch.manual_seed(0)
    model = Vocoder(window).to(device)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 9, 4, generator=g).to(device) for _ in range(calls)]
    stock = _stream(model, xs)
    compiled = cadence_fx.compile(model, adapter, options=Options(**options), cache_dir=cache_dir)
    ours = _stream(compiled, xs)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(stock, ours))
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (len(xs), len(xs), 0)
    return compiled


def _istfts(compiled) -> int:
    return sum(n.target is aten.istft.default for e in compiled.classes.values()
               for n in e.records.graph.graph.nodes)


@pytest.mark.parametrize("name", ["hann", "hamming", "blackman"])
def test_istft_on_a_constant_window_is_its_aten_ops_in_one_piece_and_bit_exact(name):
    window = getattr(torch, f"{name}_window")(16)
    compiled = _run(window)
    assert _istfts(compiled) == 0
    for e in compiled.classes.values():
        assert [(p.kind, list(p.reasons)) for p in e.records.pieces] == [("graph", [])]
        assert [w.kind for w in e.records.rewrites].count("host_check") == 1
        # the envelope (1, samples) reads only the window: hoisted, computed once
        assert any(len(c.shape) == 2 and c.shape[0] == 1 for c in e.records.constants)


def test_without_the_pass_istft_splits_the_graph_around_an_eager_piece():
    compiled = _run(torch.hann_window(16), host_checks=False)
    assert _istfts(compiled) == len(compiled.classes)
    for e in compiled.classes.values():
        assert [p.kind for p in e.records.pieces] == ["graph", "eager", "graph"]
        assert list(e.records.pieces[1].reasons) == [ISTFT_KEPT]


def test_a_window_that_fails_the_check_raises_as_stock_does():
    """A rectangular window of 4 on an n_fft of 16 with a hop of 8 leaves gaps in the envelope:
    the envelope the pass computes fails the kernel's bound where stock's check fails, and the
    compiled step raises stock's error (from the probationary call) instead of compiling it."""
    from cadence_fx.passes.host_checks import NOLA_EPS, _envelope
    window = torch.zeros(16)
    window[:4] = 1.0
    spec = torch.zeros(1, 9, 6, dtype=torch.complex64)
    for w, hop, fails in ((window, 8, True), (torch.hann_window(16), 4, False)):
        lowest = _envelope(w, spec, {"n_fft": 16, "hop_length": hop, "win_length": 16})
        assert bool(lowest.abs().min() < NOLA_EPS) == fails
        if fails:
            with pytest.raises(RuntimeError):
                torch.istft(spec, 16, hop, 16, window=w)
        else:
            torch.istft(spec, 16, hop, 16, window=w)
    model = Vocoder(window, hop=8)
    x, state = torch.randn(1, 9, 4), {"ctx": torch.zeros(1, 9, 0)}
    with pytest.raises(RuntimeError) as stock:
        model(x, state)
    compiled = cadence_fx.compile(model, ADAPTER)
    with pytest.raises(RuntimeError) as ours:
        compiled(x, state)
    assert str(ours.value).splitlines()[0] == str(stock.value).splitlines()[0]


def test_a_window_in_module_state_not_declared_constant_keeps_the_stock_call():
    undeclared = Adapter(**{**ADAPTER.__dict__, "name": "vocoder-undeclared", "constants": ()})
    compiled = _run(torch.hann_window(16), adapter=undeclared)
    assert _istfts(compiled) == len(compiled.classes)
    misses = [m.detail for e in compiled.classes.values() for m in e.records.near_misses]
    assert misses and all("is not a constant of the class (declare the tensor it comes from in "
                          "Adapter.constants" in m for m in misses)
    assert all(list(p.reasons) == [ISTFT_KEPT] for e in compiled.classes.values()
               for p in e.records.pieces if p.kind == "eager")


def test_a_restarted_vocoder_loads_its_decomposed_istft_and_takes_a_retry(tmp_path):
    """Restart on a filled compile cache: every class loads compiled (the hoisted envelope is a
    constant stored with it), streams bit-exact, and takes a retry from a cloned older state."""
    first = _run(torch.hann_window(16), cache_dir=tmp_path)
    restarted = _run(torch.hann_window(16), cache_dir=tmp_path)
    k = restarted.counters
    assert (k.traces, k.compiled_loads) == (0, len(first.classes))
    assert all(_istfts_left(e) == 0 for e in restarted.classes.values())
    torch.manual_seed(0)
    model = Vocoder(torch.hann_window(16))      # the weights _run's model had
    g = torch.Generator().manual_seed(8)
    x, older = torch.randn(1, 9, 4, generator=g), {"ctx": torch.randn(1, 9, W, generator=g)}
    step = cadence_fx.compile(model, ADAPTER, cache_dir=tmp_path)
    with torch.no_grad():
        y, _ = step(x, {"ctx": older["ctx"].clone()})
        retried, _ = step(x, {"ctx": older["ctx"].clone()})     # the retry, from the clone
        want, _ = model(x, {"ctx": older["ctx"].clone()})
    assert torch.equal(y, want) and torch.equal(retried, want)
    assert (step.counters.traces, step.counters.compiled_loads) == (0, 1)


def _istfts_left(entry) -> int:
    """istft calls in a loaded class's code (it has no graph)."""
    return sum(m.code.count("aten.istft") for m in entry.gm.modules() if hasattr(m, "code"))


class DirectWindow(Vocoder):
    """Hands its window attribute to istft as it is (no ``.to``): the graph reads it directly."""

    def forward(self, x, cache):
        full = torch.cat([cache["ctx"], x], 2)
        h = self.head(nn.functional.pad(full, (2, 0)))
        spec = torch.complex(h[:, :9].exp().clamp(max=1e2), h[:, 9:])
        return torch.istft(spec, 16, self.hop, 16, window=self.window), {"ctx": full[:, :, -W:]}


def test_a_window_read_directly_from_undeclared_module_state_keeps_the_stock_call():
    """The user may change such a window between calls (here: in place, mid-stream), even to one
    that fails the check: the call keeps its stock form, so the compiled stream follows the
    change bit for bit, and raises where stock raises."""
    undeclared = Adapter(**{**ADAPTER.__dict__, "name": "vocoder-direct", "constants": ()})
    model = DirectWindow(torch.hann_window(16))
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 9, 4, generator=g) for _ in range(8)]

    def stream(step):
        model.window.copy_(torch.hann_window(16))
        state, outs = {"ctx": torch.zeros(1, 9, 0)}, []
        for i, x in enumerate(xs):
            if i == 4:
                model.window.copy_(torch.hamming_window(16))   # the user changes it
            with torch.no_grad():
                y, state = step(x, state)
            outs.append(y.clone())
        model.window.zero_()                                 # now a window that fails the check
        with pytest.raises(RuntimeError) as failed, torch.no_grad():
            step(xs[0], state)
        return outs, str(failed.value).splitlines()[0]

    stock = stream(model)
    compiled = cadence_fx.compile(model, undeclared)
    ours = stream(compiled)
    assert ours[1] == stock[1] and all(torch.equal(a, b) for a, b in zip(stock[0], ours[0]))
    k = compiled.counters   # the last call ran the compiled class; its kept istft raised
    assert (k.calls, k.compiled_calls, k.fallbacks) == (len(xs) + 1, len(xs), 0)
    assert _istfts(compiled) == len(compiled.classes)
    misses = [m.detail for e in compiled.classes.values() for m in e.records.near_misses]
    assert misses and all("is module state not declared constant (Adapter.constants)" in m
                          for m in misses)


def test_a_decomposition_that_cannot_be_traced_keeps_the_stock_call(monkeypatch):
    def refuses(*args, **kwargs):
        raise NotImplementedError("no decomposition here")
    monkeypatch.setattr(torch._refs, "istft", refuses)
    compiled = _run(torch.hann_window(16))
    assert _istfts(compiled) == len(compiled.classes)
    misses = [m.detail for e in compiled.classes.values() for m in e.records.near_misses]
    assert misses and all("its decomposition could not be traced (NotImplementedError: no "
                          "decomposition here)" in m for m in misses)


def test_the_pass_keeps_the_call_when_the_window_fails_its_check():
    """The pass on its own (the probationary stock call raises first in a compile): a constant
    window whose envelope fails the bound keeps its istft, with the reason."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from cadence_fx.passes.context import PassContext
    from cadence_fx.passes.host_checks import host_checks
    window = torch.zeros(16)
    window[:4] = 1.0
    holder = Vocoder(window, hop=8)
    gm = make_fx(lambda spec: torch.istft(spec, 16, 8, 16, window=holder.window),
                 tracing_mode="fake", pre_dispatch=True, _allow_non_fake_inputs=True)(
        torch.zeros(1, 9, 6, dtype=torch.complex64))
    ctx = PassContext(adapter=ADAPTER, class_key=None, inputs=[], regions=[], module_buffers={},
                      constant_ids={id(window)})
    assert not host_checks(gm, ctx).modified
    assert sum(n.target is aten.istft.default for n in gm.graph.nodes) == 1
    assert [m.detail.split(": ", 2)[-1] for m in ctx.records.near_misses] == [
        "its window envelope falls to 0, the stock call raises"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_whole_call_replays_one_graph_bit_exact():
    """cuFFT on both sides: the decomposition's ops are the kernel's, so the replayed stream is
    the stock stream bit for bit, one graph launch per call."""
    compiled = _run(torch.hann_window(16), device="cuda", calls=12)
    k = compiled.counters
    assert (k.replays, k.eager_pieces) == (12, 0) and _istfts(compiled) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("frames", [5, 37, 121, 481])
def test_the_decomposition_equals_the_kernel_on_cuda(frames):
    g = torch.Generator().manual_seed(frames)
    mag = (torch.rand(1, 9, frames, generator=g) * 1e2).cuda()
    phase = (torch.randn(1, 9, frames, generator=g) * 3).cuda()
    spec = torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))
    window = torch.hann_window(16, device="cuda")
    assert torch.equal(torch.istft(spec, 16, 4, 16, window=window),
                       torch._refs.istft(spec, 16, 4, 16, window=window))
