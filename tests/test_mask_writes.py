"""Masked writes of one value (``x[mask] = v``) become selects on the device (passes/mask_writes.py):
bit-exact against stock over whole streams, for every form the pass takes, and the graph is no
longer split around a host sync. Forms it does not take stay eager with the boolean-mask reason.

Each stream compares every output and the state with ``torch.equal`` against the stock module and
asserts that the compiled path ran (every call compiled, no fallback) and what the pass did."""
import pytest
import torch

import cadence_fx
from cadence_fx.passes.fx_utils import aten
from cadence_fx.passes.pipeline import Options
from helpers import same, stream
from streaming_window import Window, window_step_adapter

BOOL_MASK = "boolean-mask indexing (aten::index_put_) syncs with the host through nonzero"
ADAPTER = window_step_adapter(batch=3, name="blank")
REWRITTEN = ["rows", "inner", "full", "tensor-value", "out-of-place", "int", "nan", "bf16"]
KEPT = ["accumulate", "many-values"]


class Blank(Window):
    """A window step that blanks part of its result under a boolean mask, in one of the forms."""

    def __init__(self, form: str):
        super().__init__("slice")
        self.blank = form

    def forward(self, x, cache):
        full, new = self.window(x, cache, "slice")
        h = full * 2
        rows = h.sum((1, 2, 3)) > 0                      # one flag per batch row: [3]
        f = self.blank
        if f == "rows":                                  # Moshi's out[mask, :, :] = token
            h[rows, :, :] = 7.0
        elif f == "inner":                               # a mask on dim 1, after a full slice
            h[:, h.sum((0, 2, 3)) > 0] = -1.5
        elif f == "full":
            h[h < 0] = 0.0
        elif f == "tensor-value":                        # the value is computed on the device
            h[rows] = x.amax()
        elif f == "out-of-place":
            h = h.index_put((rows,), x.amin())
        elif f == "int":
            tokens = (h * 10).long()
            tokens[rows] = -2
            return tokens, {"k": new}
        elif f == "nan":
            h[rows] = float("nan")
        elif f == "bf16":
            h = h.to(torch.bfloat16)
            h[rows] = 3.140625
        elif f == "accumulate":
            h.index_put_((rows,), torch.tensor(1.0), accumulate=True)
        elif f == "many-values":                         # one value per last-dim element
            h[rows] = torch.arange(4.0)
        return h, {"k": new}


def _stream(step, xs):
    return stream(step, xs, lambda: {"k": torch.zeros(3, 2, 0, 4, device=xs[0].device)}, "k")


def _inputs(calls=10):
    g = torch.Generator().manual_seed(7)
    # rows with all-negative inputs make the masks vary: all true, mixed, none
    return [torch.randn(3, 2, 2, 4, generator=g) + torch.tensor([-3.0, 0.0, 3.0])[i % 3]
            for i in range(calls)]


def _index_puts(compiled) -> int:
    return sum(1 for e in compiled.classes.values() for gm in e.gm.modules()
               if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
               if n.target in (aten.index_put_.default, aten.index_put.default))


def _run(form, device="cpu", **options):
    torch.manual_seed(0)
    model = Blank(form).to(device)
    xs = [x.to(device) for x in _inputs()]
    stock = _stream(model, xs)
    compiled = cadence_fx.compile(model, ADAPTER, options=Options(**options))
    ours = _stream(compiled, xs)
    k = compiled.counters
    assert (k.calls, k.compiled_calls, k.fallbacks) == (len(xs), len(xs), 0)
    return stock, ours, compiled


@pytest.mark.parametrize("form", REWRITTEN)
def test_a_masked_write_of_one_value_is_a_select_and_bit_exact(form):
    stock, ours, compiled = _run(form)
    assert same(stock, ours, bits=True)
    masks = [bool((o[0] == o[0]).all()) for o in stock]   # NaN rows differ from themselves
    if form == "nan":
        assert not all(masks)
    for e in compiled.classes.values():
        assert [(p.kind, list(p.reasons)) for p in e.records.pieces] == [("graph", [])]
        assert [w.kind for w in e.records.rewrites].count("mask_write") == 1
    assert _index_puts(compiled) == 0


def test_the_masks_of_the_stream_are_mixed():
    """The stream's masks are not vacuous: some calls blank every row, some leave rows alone."""
    torch.manual_seed(0)
    model, state, flags = Blank("rows"), {"k": torch.zeros(3, 2, 0, 4)}, []
    for x in _inputs():
        with torch.no_grad():
            y, state = model(x, state)
        flags.append((y == 7.0).flatten(1).all(1).tolist())
    assert any(all(f) for f in flags) and any(not any(f) for f in flags)


@pytest.mark.parametrize("form", KEPT)
def test_other_masked_writes_stay_eager_with_the_reason(form):
    stock, ours, compiled = _run(form)
    assert same(stock, ours, bits=True)
    for e in compiled.classes.values():
        assert [(p.kind, list(p.reasons)) for p in e.records.pieces] == \
            [("graph", []), ("eager", [BOOL_MASK]), ("graph", [])]
        assert "mask_write" not in [w.kind for w in e.records.rewrites]
    assert compiled.counters.eager_pieces == len(stock)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["rows", "int", "tensor-value", "bf16"])
def test_on_the_device_a_masked_write_replays_in_one_graph(form):
    """On CUDA ``h[rows] = 7.0`` writes a host literal: the pass copies it to the device once, so
    the class is one graph, replayed on every call, bit-exact."""
    stock, ours, compiled = _run(form, device="cuda")
    assert same(stock, ours, bits=True)
    k = compiled.counters
    assert (k.replays, k.eager_pieces) == (len(stock), 0)
    for e in compiled.classes.values():
        assert [(p.kind, list(p.reasons)) for p in e.records.pieces] == [("graph", [])]
    assert _index_puts(compiled) == 0


def test_the_switch_turns_the_pass_off():
    stock, ours, compiled = _run("rows", mask_writes=False)
    assert same(stock, ours, bits=True)
    for e in compiled.classes.values():
        assert [p.kind for p in e.records.pieces] == ["graph", "eager", "graph"]
    assert _index_puts(compiled) == len(compiled.classes)


@pytest.mark.parametrize("name,rewritten", [("_cadence_const_0", True), ("_tensor_constant0", False)])
def test_a_host_value_is_written_by_a_select_only_when_it_is_a_hoisted_constant(name, rewritten):
    """A device target and a host value: a constant ``hoist_constants`` made is the same on every
    call (copied to the device once); any other tensor attribute the trace captured is module
    state that may change between calls, so the write stays as it is."""
    from cadence_fx.passes.mask_writes import mask_of
    g = torch.fx.Graph()
    x, m, v = g.placeholder("x"), g.placeholder("m"), g.get_attr(name)
    put = g.call_function(aten.index_put_.default, (x, [m], v))
    x.meta["val"] = torch.empty(3, 4, device="meta")
    m.meta["val"] = torch.empty(3, dtype=torch.bool, device="meta")
    v.meta["val"] = torch.tensor(7.0)
    assert mask_of(put) == ([3, 1] if rewritten else None)
