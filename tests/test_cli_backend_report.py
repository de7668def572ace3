"""The CLI's JSON contract, the torch.compile backend and the report."""
import json
import pathlib

import pytest
import torch

import cadence_fx
from cadence_fx.cli import main
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_analyze_token2wav(capsys):
    d = _json(capsys, ["analyze", "minicpmo-token2wav", "--json"])
    assert {"adapter", "catalog_size", "regions"} <= set(d)
    est = next(r for r in d["regions"] if r["name"] == "estimator_att_cache")
    assert est["extents"] == [302, 352, 402] and est["K"] == 3 and est["admissible"]
    assert est["stock_bytes"] == 16 * 16 * 2 * 8 * 1000 * 128 * 4
    assert est["declared_bytes"] == 10 * 16 * 2 * 8 * 458 * 128 * 4


@pytest.mark.parametrize("name,region,K,admissible", [
    ("moshi", "lm_kv", 1, True), ("freeze-omni", "att_cache", 2, True), ("llm-backbone", "kv", 2001, False)])
def test_analyze_widths(capsys, name, region, K, admissible):
    d = _json(capsys, ["analyze", name, "--json"])
    r = next(r for r in d["regions"] if r["name"] == region)
    assert (r["K"], r["admissible"]) == (K, admissible)


def test_analyze_unknown_adapter(capsys):
    assert main(["analyze", "no-such-model"]) == 2
    assert "no adapter named 'no-such-model'" in capsys.readouterr().err


def test_demo_toy_cpu(capsys):
    d = _json(capsys, ["demo", "--model", "toy", "--device", "cpu", "--chunks", "12", "--json"])
    keys = {"model", "device", "chunks", "bit_exact", "carry_addresses", "retentions", "replays",
            "fallbacks", "invalidations", "stock_peak_bytes", "compiled_peak_bytes", "timing"}
    assert keys <= set(d)
    # on the CPU: exactness and memory first, the times nested under `timing`
    assert list(d)[:4] == ["bit_exact", "bit_exact_chunks", "chunks", "stock_peak_bytes"]
    assert d["bit_exact"] is True and d["chunks"] >= 12
    assert d["carry_addresses"] == 1 and d["stock_state_addresses"] > 1
    assert d["retentions"] > 0 and d["fallbacks"] == 0
    assert d["compiled_peak_bytes"] < d["stock_peak_bytes"]
    # one timed pass on the CPU, its p50, and the speedup against stock's
    t = d["timing"]
    assert not {"stock_ms_p50", "speedup_p50", "note"} & set(d)
    assert t["timed_passes"] == len(t["stock_ms_p50_per_pass"]) == len(t["compiled_ms_p50_per_pass"]) == 1
    low, high = t["speedup_p50_spread"]
    assert 0 < low == high and t["stock_ms_p50"] > 0 and "expect about stock speed" in t["note"]
    # every key is documented in docs/benchmarks.md ("The demo's JSON"), and every step's too
    doc = pathlib.Path(__file__).resolve().parents[1].joinpath("docs", "benchmarks.md").read_text()
    table = doc.split("## The demo's JSON")[1].split("\n## ")[0]
    assert not [k for k in list(d) + list(t) if f"`{k}`" not in table]
    inner = {k for v in d["per_invocation"].values() for k in list(v) + list(v.get("memory", {}))}
    assert "carry_bytes" in inner and not [k for k in inner if f"`{k}`" not in table]


def test_demo_bad_input_is_a_clean_error(capsys):
    assert main(["demo", "--model", "toy", "--chunks", "2"]) == 2
    assert "at least 4 chunks" in capsys.readouterr().err


def _toy_stream(step, prompt_state, xs, reset_at):
    outs, addresses, state = [], set(), prompt_state
    for i, x in enumerate(xs):
        if i == reset_at:
            state = prompt_state
        with torch.no_grad():
            y, state = step(x, state)
        addresses.add(state["att"].data_ptr())
        outs.append((y.clone(), state["att"].clone()))
    return outs, addresses


def test_torch_compile_backend_is_bit_exact_and_keeps_the_carry():
    torch._dynamo.reset()
    model = PromptRetainedToy()
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64), None)
    prompt_state = {k: v.clone() for k, v in state.items()}
    xs = [torch.randn(1, 8, 64) for _ in range(12)]
    stock, stock_addresses = _toy_stream(model, prompt_state, xs, 6)
    compiled = torch.compile(model, backend="cadence", dynamic=False,
                             options={"adapter": PROMPT_RETAINED_ADAPTER, "verify": True})
    ours, addresses = _toy_stream(compiled, prompt_state, xs, 6)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(stock, ours))
    assert len(addresses) == 1 and len(stock_addresses) > 1


def test_backend_needs_an_adapter():
    from cadence_fx.backend import cadence_backend
    from cadence_fx.errors import ContractError
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ContractError, match='needs the adapter.*pass torch.compile\\(..., '
                                            'options=\\{"adapter": ADAPTER\\}\\)'):
        cadence_backend(gm, [torch.randn(1, 2)])


def test_report_shows_catalog_rewrites_and_graph():
    model = PromptRetainedToy()
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64), None)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    state = {k: v.clone() for k, v in state.items()}
    for _ in range(3):
        with torch.no_grad():
            _, state = compiled(torch.randn(1, 8, 64), state)
    report = compiled.report()
    text = str(report)
    assert "extents [24, 32, 40]" in text and "retention" in text and "envelope" in text
    html = compiled._repr_html_()
    assert "<table>" in html and "carry write" in html
    assert any(line.endswith("<- carry write") for line in report.graph_lines(2))
    assert report.as_dict()["memory"]["carry_bytes"] < report.as_dict()["memory"]["stock_envelope_bytes"]
