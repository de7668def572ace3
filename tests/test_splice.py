"""Repeated calls traced once (``Adapter.repeated``, ``cadence_fx.splice``): the copied graph is node
for node the graph a full trace gives -- same ops, arguments, fake geometry and storage sharing --
on the real CFM loop; a method that reads hidden inputs or changes Python state is traced in full."""
import pytest
import torch

import cadence_fx
from cadence_fx import adapters
from cadence_fx.contract import Adapter, PromptRetained, Region
from cadence_fx.errors import ContractError
from cadence_fx.passes.pipeline import Options
from cadence_fx.tracing import bind_arguments, trace_step
from graph_compare import difference
from stock_packages import TOKEN2WAV, missing


# -- the real CFM loop ----------------------------------------------------------------------------
_ABSENT = missing(*TOKEN2WAV)   # third-party only: the project's own module must import
needs_stock = pytest.mark.skipif(bool(_ABSENT), reason=f"needs {', '.join(_ABSENT)}")
if not _ABSENT:
    from cadence_fx.models import token2wav
    token2wav.import_stock()


@pytest.fixture(scope="module")
def steady_cfm(cfm):
    """conftest's ``cfm`` with its first chunk and the state after it: ``(step, spks, prompt,
    steady, mu, cond)``."""
    step, spks, prompt, ((mu, cond), _) = cfm
    with torch.inference_mode():
        _, steady = step(mu, spks, cond, prompt)
    return step, spks, prompt, steady, mu, cond


@needs_stock
@pytest.mark.parametrize("which", ["prompt", "steady", "first", "autocast"])
def test_copied_calls_give_the_full_trace_node_for_node(steady_cfm, which):
    step, spks, prompt, steady, mu, cond = steady_cfm
    state = {"prompt": prompt, "steady": steady, "first": None, "autocast": prompt}[which]
    named = bind_arguments(step.forward, (mu, spks, cond, state), {})
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=which == "autocast"):
        full = trace_step(step, step.forward, named)
        copied = trace_step(step, step.forward, named, repeated=[(step.cfm.estimator, "forward_chunk")])
    assert (full.copied_calls, copied.copied_calls, copied.refused) == (0, 9, {})
    assert difference(full.gm, copied.gm) is None


@needs_stock
def test_the_comparison_can_fail(steady_cfm):
    step, spks, prompt, steady, mu, cond = steady_cfm
    with torch.inference_mode():
        a = trace_step(step, step.forward, bind_arguments(step.forward, (mu, spks, cond, prompt), {}))
        b = trace_step(step, step.forward, bind_arguments(step.forward, (mu, spks, cond, steady), {}))
    assert difference(a.gm, b.gm) is not None
    # same ops, one storage shared differently: a view re-pointed at a fresh storage
    with torch.inference_mode():
        c = trace_step(step, step.forward, bind_arguments(step.forward, (mu, spks, cond, prompt), {}))

    def shares(n):
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and any(
            isinstance(a.meta.get("val"), torch.Tensor)
            and a.meta["val"].untyped_storage() is v.untyped_storage() for a in n.all_input_nodes)
    node = next(n for n in c.gm.graph.nodes if n.op == "call_function" and shares(n))
    v = node.meta["val"]
    with v.fake_mode:
        node.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
    assert "storage" in difference(a.gm, c.gm) or "geometry" in difference(a.gm, c.gm)


@needs_stock
def test_compiled_stream_copies_nine_of_ten_estimator_calls_and_stays_bit_exact(steady_cfm):
    step, spks, prompt, _, _, _ = steady_cfm
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    assert adapter.repeated == ("estimator.forward_chunk",)
    g = torch.Generator().manual_seed(5)
    chunks = [(torch.randn(1, 80, w, generator=g), torch.zeros(1, 80, w)) for w in (50, 50, 56)]
    compiled = {flag: cadence_fx.compile(step, adapter, options=Options(repeated=flag))
                for flag in (True, False)}
    states = {"stock": prompt, True: prompt, False: prompt}
    for mu, cond in chunks:
        with torch.inference_mode():
            ref, states["stock"] = step(mu, spks, cond, states["stock"])
            for flag, c in compiled.items():
                mel, states[flag] = c(mu, spks, cond, states[flag])
                assert torch.equal(mel, ref), f"repeated={flag}"
    on, off = compiled[True].counters, compiled[False].counters
    assert on.traces == off.traces >= 2
    assert (on.copied_calls, off.copied_calls) == (9 * on.traces, 0)


# -- what is never copied -------------------------------------------------------------------------
class Inner(torch.nn.Module):
    def __init__(self, hidden=False, counter=False):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.hidden, self.counter = hidden, counter
        self.extra = None   # set by the caller before each call (a hidden input)
        self.calls = 0

    def step(self, x):
        if self.counter:
            self.calls += 1          # Python state the copies would not advance
        y = self.lin(x).relu()
        return y + self.extra if self.hidden else y


class Outer(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.inner = Inner(**kw)

    def forward(self, x, cache):
        for k in range(4):   # the first call reads the step's input; the others share a key
            if self.inner.hidden:
                self.inner.extra = x * (k + 1)
            x = self.inner.step(x)
        return x, {"att": torch.cat([cache["att"], x], dim=1)}


@pytest.mark.parametrize("kw, why", [({"hidden": True}, "neither an argument"),
                                     ({"counter": True}, "Python attributes")])
def test_a_method_with_hidden_inputs_or_python_effects_is_traced_in_full(kw, why):
    model = Outer(**kw)
    x, cache = torch.randn(1, 4, 8), {"att": torch.randn(1, 6, 8)}
    named = bind_arguments(model.forward, (x, cache), {})
    full = trace_step(model, model.forward, named)
    model.inner.calls = 0
    copied = trace_step(model, model.forward, named, repeated=[(model.inner, "step")])
    assert copied.copied_calls == 0
    assert why in copied.refused["Inner.step"]
    assert difference(full.gm, copied.gm) is None


def test_a_pure_method_is_copied_and_gives_the_full_trace():
    model = Outer()
    x, cache = torch.randn(1, 4, 8), {"att": torch.randn(1, 6, 8)}
    named = bind_arguments(model.forward, (x, cache), {})
    full = trace_step(model, model.forward, named)
    copied = trace_step(model, model.forward, named, repeated=[(model.inner, "step")])
    assert (copied.copied_calls, copied.refused) == (2, {})
    assert difference(full.gm, copied.gm) is None
    assert "step" not in vars(model.inner)   # the patch is gone after the trace


def _toy_adapter(repeated):
    att = Region(name="att", input="cache.att", output="1.att", dim=1,
                 retention=PromptRetained("p", "r"), advance="c", shape=("b", None, "w"))
    return Adapter(name="toy-repeated", clocks={"p": 6, "r": 2, "c": 4, "b": 1, "w": 8},
                   regions=(att,), repeated=repeated)


@pytest.mark.parametrize("decl, says", [("step", "is not '<submodule>.<method>'"),
                                        ("missing.step", "names no submodule called 'missing'"),
                                        ("inner.nothing", "has no method 'nothing'")])
def test_bad_repeated_declarations_name_the_fix(decl, says):
    with pytest.raises(ContractError, match="fix `repeated`") as e:
        cadence_fx.compile(Outer(), _toy_adapter((decl,)))
    assert says in str(e.value)


def test_a_copy_that_cannot_be_built_leaves_the_full_trace(monkeypatch):
    """Fake-tensor internals differ between torch releases: if a copy's values cannot be rebuilt,
    that call is traced in full instead, with the reason."""
    from cadence_fx import splice_plans

    def broken(self, leaves):
        raise RuntimeError("no such internal")
    monkeypatch.setattr(splice_plans.Plans, "build", broken)
    model = Outer()
    x, cache = torch.randn(1, 4, 8), {"att": torch.randn(1, 6, 8)}
    named = bind_arguments(model.forward, (x, cache), {})
    full = trace_step(model, model.forward, named)
    copied = trace_step(model, model.forward, named, repeated=[(model.inner, "step")])
    assert copied.copied_calls == 0
    assert "could not rebuild" in copied.refused["Inner.step"]
    assert difference(full.gm, copied.gm) is None
