"""The demo a new user runs first: on the CPU it is Token2Wav's real classes at a smaller size
(DiT depth 2, encoder 1 + 1 blocks) unless ``--full``, which stays CUDA's default; its JSON leads
with exactness and memory and nests the CPU's times under ``timing``; every chunk of every pass
shows on stderr with what is left. And ``cadence-fx --help`` reads as plain text."""
import io
import pathlib

import pytest
import torch

from cadence_fx import progress
from cadence_fx.cli import main
from stock_packages import TOKEN2WAV, require


class _Built(Exception):
    """Stops a demo builder once the model's size is known."""


def _sizes(monkeypatch):
    """``build_flow`` replaced by one that records ``(depth, blocks, device)`` and stops."""
    require(*TOKEN2WAV)
    from cadence_fx.models import token2wav
    seen = []

    def build_flow(depth=16, *, blocks=(6, 4), seed=0, device="cpu"):
        seen.append((depth, tuple(blocks), torch.device(device).type))
        raise _Built
    monkeypatch.setattr(token2wav, "build_flow", build_flow)
    return seen


@pytest.mark.parametrize("device,full,size", [
    ("cpu", None, (2, (1, 1))), ("cpu", False, (2, (1, 1))), ("cpu", True, (16, (6, 4))),
    ("cuda", None, (16, (6, 4))), ("cuda", False, (2, (1, 1)))])
def test_token2wav_size_by_device_and_full(monkeypatch, device, full, size):
    from cadence_fx.demo_streams import BUILDERS
    seen = _sizes(monkeypatch)
    with pytest.raises(_Built):   # stops before anything runs on the device
        BUILDERS["token2wav"](torch.device(device), 4, full=full)
    assert seen == [(*size, device)]


@pytest.mark.parametrize("argv,full", [([], None), (["--full"], True), (["--no-full"], False)])
def test_the_cli_passes_full_through(monkeypatch, capsys, argv, full):
    from cadence_fx import demo
    calls = []

    def run_demo(**kwargs):
        calls.append(kwargs)
        return {"bit_exact": True, "timing": {"speedup_p50": 1.0}}
    monkeypatch.setattr(demo, "run_demo", run_demo)
    assert main(["demo", "--quiet", *argv]) == 0
    assert calls == [{"model": "token2wav", "device": "cpu", "chunks": None, "full": full}]
    assert "timing.speedup_p50: 1.0" in capsys.readouterr().out   # nested times, one line each


@pytest.mark.parametrize("argv", [[], ["analyze"], ["explain"], ["report"], ["demo"], ["cache"]])
def test_the_help_is_plain_text(capsys, argv):
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: cadence-fx")
    assert "`" not in out, [ln for ln in out.splitlines() if "`" in ln]
    if argv == ["demo"]:
        assert "--full" in out and "--no-full" in out


@pytest.mark.slow
def test_the_default_cpu_demo_is_small_exact_and_leads_with_exactness_and_memory(monkeypatch):
    require(*TOKEN2WAV)
    from cadence_fx.demo import run_demo
    from cadence_fx.models import token2wav
    built, stock_build = [], token2wav.build_flow

    def build_flow(*args, **kwargs):   # what ran, read off the module itself
        flow = stock_build(*args, **kwargs)
        built.append((len(flow.decoder.estimator.blocks),
                      [len(flow.encoder.encoders), len(flow.encoder.up_encoders)]))
        return flow
    monkeypatch.setattr(token2wav, "build_flow", build_flow)
    err = io.StringIO()
    progress.show(err)
    try:
        d = run_demo()
    finally:
        progress.hide()
    assert built == [(2, [1, 1])]
    assert (d["config"]["size"], d["config"]["dit_depth"], d["config"]["encoder_blocks"]) == \
        ("small", 2, [1, 1])
    assert d["config"]["full_size"] == "DiT depth 16, conformer encoder 6 + 4 blocks"
    assert list(d)[:7] == ["bit_exact", "bit_exact_chunks", "chunks", "stock_peak_bytes",
                           "compiled_peak_bytes", "peak_bytes_kind", "carry_addresses"]
    assert d["bit_exact"] is True and d["bit_exact_chunks"] == d["chunks"] == 4
    assert d["peak_bytes_kind"] == "resident_state" and d["carry_addresses"] == 1
    # the stock buffers keep 16 DiT slots at any depth: the real configuration's state
    assert d["stock_peak_bytes"] > 3 * d["compiled_peak_bytes"] > 0
    assert d["per_invocation"]["setup_cache"]["eager"] == 1 and d["fallbacks"] == 0
    assert d["traces"] == 4 and d["retentions"] > 0
    t = d["timing"]
    assert not {"speedup_p50", "stock_ms_p50", "note", "timed_passes"} & set(d)
    assert t["timed_passes"] == 1 and "not the speed-up" in t["note"] and t["speedup_p50"] > 0
    # every chunk of every pass on stderr, each with what is left until the path's last chunk
    lines = err.getvalue().splitlines()
    for path, passes in (("stock", 1), ("compiled", 2)):
        chunks = [ln for ln in lines if f"demo token2wav {path}: chunk " in ln]
        assert len(chunks) == 4 * passes, lines
        assert all(" left" in ln for ln in chunks[:-1]) and " left" not in chunks[-1]
    assert "compiling any new class" in next(ln for ln in lines if "(compiling)" in ln)


def test_the_layout_leads_with_the_times_on_cuda_and_with_exactness_on_the_cpu():
    from cadence_fx.demo import CPU_TIMING_NOTE, _layout
    where = {"model": "token2wav", "device": "cuda", "config": {"size": "full"}}
    exact = {"bit_exact": True, "bit_exact_chunks": 16, "chunks": 16}
    memory = {"stock_peak_bytes": 5, "compiled_peak_bytes": 4, "peak_bytes_kind": "x",
              "carry_addresses": 1}
    counters = {"retentions": 3, "per_invocation": {}}
    timing = {"timed_passes": 2, "stock_ms_p50": 2.0, "compiled_ms_p50": 1.0, "speedup_p50": 2.0}
    cuda = _layout("cuda", where, exact, memory, counters, timing)
    assert list(cuda)[:7] == ["model", "device", "config", "bit_exact", "bit_exact_chunks",
                              "chunks", "timed_passes"]
    assert cuda["speedup_p50"] == 2.0 and "timing" not in cuda and "note" not in cuda
    cpu = _layout("cpu", where, exact, memory, counters, timing)
    assert list(cpu) == [*exact, *memory, *where, *counters, "timing"]
    assert cpu["timing"] == {"note": CPU_TIMING_NOTE, **timing} and "speedup_p50" not in cpu
    # every key of either layout is documented in docs/benchmarks.md ("The demo's JSON")
    doc = pathlib.Path(__file__).resolve().parents[1].joinpath("docs", "benchmarks.md").read_text()
    table = doc.split("## The demo's JSON")[1].split("\n## ")[0]
    assert not [k for k in [*cuda, *cpu, *cpu["timing"], "size", "full_size"]
                if f"`{k}`" not in table]
