"""Torch's own tools against the hand-written rewrites: ``torch.func.functionalize`` (tracing to
functional ops), ``torch.fx.passes.reinplace`` (functional ops back into in-place writes) and
torch.export's functionalization, on steps shaped like the product's (a carry written in place, a
concatenation copied into a buffer, in-place arithmetic on a temporary) and on the test models'
graphs. Each test states what it shows and asserts the behaviour that keeps the hand-written pass
(``carry_retention``, ``cats_in_place``, ``functional_temporaries``) in place: a test here fails
when torch's tool starts doing the job, and then the pass it names can be replaced by it.

Bytes are counted per call as what the copying ops write (``copy_``'s destination, the result of
``copy``, ``*_scatter``, ``index_put``, ``cat``, ``clone``)."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.reinplace import reinplace
from torch.func import functionalize
from torch.utils._python_dispatch import TorchDispatchMode

import cadence_fx
from cadence_fx.passes.fx_utils import aten
from cadence_fx.passes.cat_in_place import write_cats_in_place
from cadence_fx.passes.region_writes import functional_temporaries
from cadence_fx.tracing import trace_step

import streaming_conformer as conformer
import streaming_decoder as decoder
from helpers import depformer_offsets
from streaming_conformer import one_thread  # noqa: F401 - fixture: one intra-op thread

COPYING = {aten.copy_.default, aten.copy.default, aten.slice_scatter.default,
           aten.select_scatter.default, aten.index_put.default, aten.index_put_.default,
           aten.cat.default, aten.clone.default}
SCATTERS = {aten.slice_scatter.default, aten.select_scatter.default, aten.index_put.default}


class _Copied(TorchDispatchMode):
    """Bytes written by the copying ops of one call, by op."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPYING:
            t = out if isinstance(out, torch.Tensor) else args[0]
            self.bytes[str(func)] += t.numel() * t.element_size()
        return out


def _run(gm, *args):
    """(outputs, bytes written by copying ops by op) of one call of ``gm``."""
    with _Copied() as c, torch.no_grad():
        out = gm(*args)
    return out, dict(c.bytes)


def _ops(gm) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _written_whole(gm):
    """The placeholders a ``copy_`` writes whole (functionalization's write-back of an input)."""
    ph = set(_placeholders(gm))
    return [n.args[0] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in ph]


def _scatters_into(gm, node):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SCATTERS
            and n.args[0] is node]


def _functional(f, *args):
    return make_fx(functionalize(f))(*[a.clone() for a in args])


def _on(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# -- a carry written in place (the form carry_retention leaves) ---------------------------------

L, C_NEW, W = 24, 8, 24            # frames held, new frames per call, frames kept
CARRY = (4, 64, 40)                # 40,960 bytes of fp32; one call's frames are 8,192


def _window_step(C, x):
    """The carry pass's window form: the new frames into the carry's room, a reader of the
    window, the kept frames moved down (through a temporary), the state a view of the carry."""
    C[:, :, L:L + C_NEW].copy_(x)
    y = C[:, :, :L + C_NEW].sum(2)
    C[:, :, :W].copy_(C[:, :, L + C_NEW - W:L + C_NEW].clone())
    return y, C[:, :, :W]


def _carry_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(*CARRY, generator=g), torch.randn(*CARRY[:2], C_NEW, generator=g)


def test_functionalize_turns_each_carry_write_into_a_whole_carry_scatter_and_a_copy_back():
    """(a) The carry's writes do not stay in place: each becomes a ``slice_scatter`` that makes a
    new carry-sized tensor, the step ends with ``C.copy_(last scatter)``, and the state returned
    is a view of a temporary, no longer of the carry. Values are the same bits; the bytes are
    not: 57,344 per call in place (32,768 copied, 24,576 the move's temporary), 180,224
    functionalized: three whole carries (3 x 40,960) more."""
    C, x = _carry_inputs()
    stock = make_fx(_window_step)(C.clone(), x)
    f = _functional(_window_step, C, x)
    carry = _placeholders(f)[0]
    assert _ops(stock)["aten.slice_scatter.default"] == 0
    assert len(_scatters_into(f, carry)) == 1 and _ops(f)["aten.slice_scatter.default"] == 2
    assert _written_whole(f) == [carry]
    mine, theirs = C.clone(), C.clone()
    (y0, s0), b0 = _run(stock, mine, x)
    (y1, s1), b1 = _run(f, theirs, x)
    assert torch.equal(y0, y1) and torch.equal(s0, s1) and torch.equal(mine, theirs)
    assert _on(s0, mine) and not _on(s1, theirs)          # the fixed address is gone
    whole = C.numel() * C.element_size()
    assert b0 == {"aten.copy_.default": 32768, "aten.clone.default": 24576}
    assert b1["aten.slice_scatter.default"] == 2 * whole and b1["aten.copy_.default"] == whole
    assert sum(b1.values()) - sum(b0.values()) == 3 * whole


def test_functionalize_turns_an_index_put_into_the_carry_into_a_whole_carry_copy():
    """(a) A ring write by index (``C.index_put_((idx,), x)``) becomes ``index_put`` (a new
    carry-sized tensor) and a whole-carry ``copy_`` back: 2 x 10,240 bytes per call for 2,048
    bytes of new frames."""
    def ring(C, x, idx):
        C.index_put_((idx,), x)
        return C[:4] * 1.0,

    C, x, idx = torch.randn(40, 64), torch.randn(8, 64), torch.arange(8) + 24
    f = _functional(ring, C, x, idx)
    carry = _placeholders(f)[0]
    assert len(_scatters_into(f, carry)) == 1 and _written_whole(f) == [carry]
    mine, theirs = C.clone(), C.clone()
    _, b = _run(f, theirs, x, idx)
    ring(mine, x, idx)
    assert torch.equal(mine, theirs)
    assert b == {"aten.index_put.default": 10240, "aten.copy_.default": 10240}


def test_reinplace_never_writes_a_program_input_so_the_carry_stays_copied():
    """(b) ``reinplace`` turns a scatter back into a slice ``copy_`` only when its base is not a
    program input (its step 1b, a TODO in torch's source). The carry is an input: its scatter
    and the whole-carry copy back stay, and the state is still not a carry view: 139,264 bytes
    per call against the in-place form's 57,344, two whole carries more."""
    C, x = _carry_inputs()
    r = reinplace(_functional(_window_step, C, x), C.clone(), x)
    carry = _placeholders(r)[0]
    assert len(_scatters_into(r, carry)) == 1 and _written_whole(r) == [carry]
    mine, theirs = C.clone(), C.clone()
    (_, s), b = _run(r, mine, x)
    _window_step(theirs, x)
    assert torch.equal(mine, theirs) and not _on(s, mine)
    assert sum(b.values()) == 139264 and b["aten.slice_scatter.default"] == C.numel() * 4


def test_on_the_conformers_carry_graph_every_carry_is_copied_whole_each_call():
    """(a)+(b) on the product's graph: the conformer's steady class after the carry pass (nine
    carries, 67,584 bytes, retention on each). Functionalized, every carry gets a whole copy
    back and none of the nine states is a carry view; reinplace takes back only scatters over
    temporaries. Bytes per call: 109,824 as the carry pass leaves it, 312,576 functionalized
    (three whole carries more), 244,992 reinplaced (two more); the same bits. (Built without constant hoisting: see the next test.)"""
    c = cadence_fx.compile(conformer.make_model(), conformer.CONFORMER_ADAPTER, constants=False)
    with torch.no_grad():
        state = conformer.prime(c, 0)
        for x in conformer.chunk_feats([8, 8], 1):
            _, state = c(x, state)
    (entry,) = [e for e in c.classes.values()
                if {r.kind for r in e.records.rewrites} == {"retention"}]
    g = entry.records.graph
    ph = _placeholders(g)
    carries = [n for n, s in zip(ph, entry.inputs) if s.kind == "carry"]
    gen = torch.Generator().manual_seed(0)
    flat = [torch.randn(n.meta["val"].shape, generator=gen) if n.meta["val"].is_floating_point()
            else torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype) for n in ph]
    idx = [i for i, n in enumerate(ph) if n in carries]
    f = _functional(g, *flat)
    r = reinplace(_functional(g, *flat), *[t.clone() for t in flat])
    runs = []
    for gm in (g, f, r):
        args = [t.clone() for t in flat]
        torch.manual_seed(1)                       # the dither draws device randomness
        out, b = _run(gm, *args)
        runs.append((out, args, b, sum(any(_on(o, args[i]) for i in idx) for o in out)))
    (o0, a0, b0, on0), (o1, a1, b1, on1), (o2, a2, b2, on2) = runs
    assert len(carries) == 9 and (on0, on1, on2) == (9, 0, 0)
    for o, a in ((o1, a1), (o2, a2)):
        assert all(torch.equal(p, q) for p, q in zip(o0, o))
        assert all(torch.equal(p, q) for p, q in zip(a0, a))
    whole = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in carries)
    assert whole == 67584
    for gm in (f, r):                              # the carries, by position
        assert {_placeholders(gm).index(n) for n in _written_whole(gm)} == set(idx)
    assert (sum(b0.values()), sum(b1.values()), sum(b2.values())) == (109824, 312576, 244992)
    assert sum(b1.values()) - sum(b0.values()) == 3 * whole
    assert sum(b2.values()) - sum(b0.values()) == 2 * whole


def test_reinplace_fails_on_a_graph_holding_a_real_tensor_constant():
    """(b) ``reinplace`` runs its own fake-tensor propagation without ``allow_non_fake_inputs``:
    a graph that holds a real tensor (what ``hoist_constants`` leaves, a ``get_attr`` of a
    module buffer) stops it with an AssertionError."""
    w = torch.randn(4)
    g = make_fx(lambda x: (x * w + 1.0,))(torch.randn(4))
    assert any(n.op == "get_attr" for n in g.graph.nodes)
    with pytest.raises(AssertionError, match="allow_non_fake_inputs"):
        reinplace(g, torch.randn(4))


# -- the trace itself ---------------------------------------------------------------------------

def test_functionalize_under_a_pre_dispatch_trace_bakes_the_values_in():
    """(a) The product traces with ``make_fx(..., pre_dispatch=True)`` (composites kept, the
    kernels eager runs: cadence_fx/tracing.py). ``torch.func.functionalize`` does not compose
    with it: the graph holds the traced values as constants and ignores its inputs."""
    def step(C, x):
        C[:, 4:6].copy_(x)
        return C[:, :4] * 2.0

    C, x = torch.randn(3, 8), torch.randn(3, 2)
    gm = make_fx(functionalize(step), pre_dispatch=True)(C.clone(), x)
    assert sum(n.op == "get_attr" for n in gm.graph.nodes) > 0
    C2, x2 = torch.randn(3, 8), torch.randn(3, 2)
    assert not torch.equal(gm(C2.clone(), x2), step(C2.clone(), x2))


@pytest.fixture(scope="module")
def decoder_trace():
    m = decoder.make_decoder()
    with torch.no_grad():
        _, st = m(decoder.prompt(0), None)
        x = decoder.chunks([decoder.CHUNK], 1)[0]
        _, st = m(x, st)
    traced = trace_step(m, m.forward, {"x": x, "state": st})
    flat = (list(dict(m.named_parameters()).values()) + list(dict(m.named_buffers()).values())
            + [x, st["kv"], st["conv"], st["offset"]])
    return traced, flat


def test_functionalize_decomposes_the_composites_and_copies_the_workspaces_whole(decoder_trace):
    """(a) On the decoder's stock trace (118 nodes) a plain ``make_fx(functionalize(gm))``
    decomposes what the product keeps whole: ``linear`` becomes ``t`` + ``addmm``, attention
    the CPU flash kernel, ``conv1d`` and ``layer_norm`` their native ops (on CUDA ``linear``
    on a transposed input drifts by ~2e-6, cadence_fx/tracing.py). Its in-place writes into
    the two workspaces (``kv_buffer[i][..., :L] = kv``, ``conv_out.copy_``) become six scatters
    and a whole copy back of each workspace: 130,048 bytes per call become 395,264."""
    traced, flat = decoder_trace
    gm = traced.gm
    f = _functional(gm, *flat)
    stock, fn = _ops(gm), _ops(f)
    composites = ("aten.linear.default", "aten.scaled_dot_product_attention.default",
                  "aten.conv1d.default", "aten.layer_norm.default")
    assert [stock[k] for k in composites] == [6, 2, 2, 2]
    assert [fn[k] for k in composites] == [0, 0, 0, 0]
    assert (fn["aten.addmm.default"], fn["aten.native_layer_norm.default"]) == (6, 2)
    buffers = [n for n, s in zip(_placeholders(f), traced.inputs) if s.kind == "buffer"]
    assert sorted(n.name for n in _written_whole(f)) == sorted(n.name for n in buffers)
    assert fn["aten.slice_scatter.default"] + fn["aten.select_scatter.default"] == 6
    (o0, b0), (o1, b1) = (_run(g, *[t.clone() for t in flat]) for g in (gm, f))
    assert all(torch.equal(p, q) for p, q in zip(o0, o1))
    assert (sum(b0.values()), sum(b1.values())) == (130048, 395264)


def test_exports_functionalization_keeps_composites_and_hands_the_whole_buffer_back():
    """(a) torch.export's functionalization (``run_decompositions({})``) keeps ``linear`` but
    writes a buffer the same way: a ``slice_scatter`` over the whole buffer, returned as an
    output that the exported program copies back (``buffers_to_mutate``)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("C", torch.zeros(3, 40, 8))

        def forward(self, x):
            self.C[:, 24:32].copy_(self.lin(x))
            return self.C[:, :32].sum(1),

    ep = torch.export.export(M(), (torch.randn(3, 8, 8),)).run_decompositions({})
    ops = _ops(ep.graph_module)
    assert ops["aten.linear.default"] == 1 and ops["aten.slice_scatter.default"] == 1
    (scatter,) = [n for n in ep.graph_module.graph.nodes if n.target is aten.slice_scatter.default]
    assert tuple(scatter.meta["val"].shape) == (3, 40, 8)
    assert list(ep.graph_signature.buffers_to_mutate.values()) == ["C"]


# -- a concatenation copied into a buffer (cats_in_place) ---------------------------------------

def _cat_into_buffer(buf, a, b):
    buf[:, :, :12].copy_(torch.cat([a, b], 2))
    return buf[:, :, :12] + 1.0,


def test_reinplace_keeps_a_concatenation_copied_into_a_buffer():
    """(b) ``cat`` has no in-place variant, so ``reinplace`` leaves it, the scatter into the
    buffer and the whole-buffer copy back (106,496 bytes per call); ``cats_in_place`` copies
    the parts into the buffer's views (12,288 bytes, no ``cat``). Same bits."""
    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(4, 64, 40)
    a, b = torch.randn(4, 64, 4, generator=g), torch.randn(4, 64, 8, generator=g)
    r = reinplace(_functional(_cat_into_buffer, buf, a, b), buf.clone(), a, b)
    assert _ops(r)["aten.cat.default"] == 1 and _written_whole(r) == [_placeholders(r)[0]]
    ours = make_fx(_cat_into_buffer)(buf.clone(), a, b)
    FakeTensorProp(ours, FakeTensorMode(allow_non_fake_inputs=True)).propagate(buf.clone(), a, b)
    assert write_cats_in_place(ours, "cpu") == 1
    ours.recompile()
    assert _ops(ours)["aten.cat.default"] == 0 and _ops(ours)["aten.copy_.default"] == 2
    (o1, b1), (o2, b2) = _run(r, buf.clone(), a, b), _run(ours, buf.clone(), a, b)
    assert torch.equal(o1[0], o2[0])
    assert (sum(b1.values()), sum(b2.values())) == (106496, 12288)


# -- in-place arithmetic on a temporary (functional_temporaries) --------------------------------

def _faked(gm, *args):
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    return gm


def test_on_temporaries_alone_functionalize_gives_functional_temporaries_result():
    """(a) Where every write is on a temporary, ``functionalize`` gives the graph
    ``functional_temporaries`` gives (four ``add``, two ``mul``, no in-place op), and keeps that
    graph as it is. It cannot be used in its place for the trace reasons above, and because
    it also rewrites what the pass must leave alone (next test)."""
    x = torch.arange(6)
    ours = _faked(make_fx(depformer_offsets)(x), x)
    assert functional_temporaries(ours) == 2
    ours.recompile()
    theirs = _functional(depformer_offsets, x)
    assert _ops(ours) == _ops(theirs) == collections.Counter(
        {"aten.add.Tensor": 4, "aten.mul.Tensor": 2, "aten.zeros.default": 1})
    assert _ops(_functional(ours, x)) == _ops(ours)
    assert all(torch.equal(p, q) for p, q in zip(ours(x), theirs(x)))


def test_reinplace_undoes_functional_temporaries():
    """(b) ``reinplace`` runs the other way: given the functional form it makes the counter's
    ``add`` an ``add_`` again (and ``mul`` a ``mul_``), closing the fused regions at each write
    as before the pass. It is for memory, not for fusion."""
    x = torch.arange(6)
    ours = _faked(make_fx(depformer_offsets)(x), x)
    functional_temporaries(ours)
    ours.recompile()
    back = reinplace(make_fx(ours)(x), x)
    assert _ops(back)["aten.add_.Tensor"] == 3 and _ops(back)["aten.mul_.Tensor"] == 1


def test_functionalize_copies_where_functional_temporaries_leaves_a_write_alone():
    """(a) A write through a view of a temporary becomes a scatter over the whole temporary
    (16,384 bytes for a 2-element write), and a write into an input a whole copy back of it;
    ``functional_temporaries`` leaves both writes in place (none rewritten)."""
    def through_a_view(x, s):
        t = x * 2.0 + 1.0
        t[:2].add_(1.0)
        return t * s,

    def on_input(x, s):
        s.add_(1.0)
        return s * 2.0 + x,

    x, s = torch.randn(4096), torch.randn(4096)
    for f, copied in ((through_a_view, {"aten.slice_scatter.default": 16384}),
                      (on_input, {"aten.copy_.default": 16384})):
        theirs = _functional(f, x, s)
        assert _run(theirs, x, s.clone())[1] == copied, f.__name__
        ours = _faked(make_fx(f)(x, s.clone()), x, s.clone())
        assert functional_temporaries(copy.deepcopy(ours)) == 0, f.__name__
