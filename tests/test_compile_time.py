"""What makes the cold compile fast changes nothing it produces, on the real CFM loop: the carry
pass recomputes fake values on the meta tensors under the fakes and gets node for node what fake
dispatch gives; the Python code of the 10k-node piece is generated once per class, not once per
GraphModule built around it."""
import importlib

import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from graph_compare import difference
from stock_packages import TOKEN2WAV, require

carry_pass = importlib.import_module("cadence_fx.passes._carry_graph")  # where fake values are recomputed
require(*TOKEN2WAV)   # skips only when a third-party package is absent
from cadence_fx.models import token2wav  # noqa: E402 - the project's own: must import

token2wav.import_stock()


def _compile_stream(cfm):
    """Compile and run a prompt chunk and a wider one (two classes); returns the compiled step
    and its mels."""
    step, spks, prompt, chunks = cfm
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    compiled = cadence_fx.compile(step, adapter)
    state, mels = prompt, []
    for mu, cond in chunks:
        with torch.inference_mode():
            mel, state = compiled(mu, spks, cond, state)
        mels.append(mel)
    return compiled, mels


@pytest.fixture(scope="module")
def fast(cfm):
    """The stream compiled as shipped, recording the ops recomputed on meta tensors and the size
    of every graph whose code is generated."""
    on_meta, python_code = carry_pass._on_meta, torch.fx.Graph.python_code
    ran, generated = [], []

    def counting(graph, *args, **kwargs):
        generated.append(len(graph.nodes))
        return python_code(graph, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(carry_pass, "_on_meta", lambda *a: ran.append(a[0]) or on_meta(*a))
        mp.setattr(torch.fx.Graph, "python_code", counting)
        compiled, mels = _compile_stream(cfm)
    return compiled, mels, ran, generated


def test_carry_fake_values_on_meta_equal_fake_dispatch(cfm, fast, monkeypatch):
    compiled, mels, ran, _ = fast
    monkeypatch.setattr(carry_pass, "_ON_META", frozenset())   # every op through fake dispatch
    plain, plain_mels = _compile_stream(cfm)
    assert len(ran) > 100 and {torch.ops.aten.cat.default, torch.ops.aten.select.int} <= set(ran)
    assert compiled.classes.keys() == plain.classes.keys() and len(compiled.classes) == 2
    for key, entry in compiled.classes.items():
        assert any(r.kind == "envelope" for r in entry.records.rewrites)
        assert difference(entry.records.graph, plain.classes[key].records.graph) is None, key
    assert all(torch.equal(x, y) for x, y in zip(mels, plain_mels))


def test_the_piece_code_is_generated_once_per_class(fast):
    compiled, _, _, generated = fast
    big = [n for n in generated if n > 1000]
    assert len(big) == len(compiled.classes) == 2, generated
    # the deferred code is still there to read and to run
    entry = next(iter(compiled.classes.values()))
    assert "copy_" in entry.gm.piece_0.module.code
    assert "aten.linear" in entry.traced.gm.code or "aten.mm" in entry.traced.gm.code
