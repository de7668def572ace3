"""Per-layer K/V windows kept by concatenation and joined into one state tensor (stacked, as the
Freeze-Omni encoder does, or catted per layer along the layer and head-dim axes, as WeNet-style
encoders do): each layer's window becomes in-place writes on its slice of one carry, and the kept
frames move once for all layers. Every output and the state are compared with ``torch.equal``
against the stock module over a whole stream (growing window, steady state, a turn reset), and
the compiled path is asserted: every call compiled, the rewrite kinds, no concatenation left."""
import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow
from helpers import stream

W, LAYERS, HEADS, D, CHUNK = 6, 3, 2, 4, 2
FORMS = ["stack", "stack-inside", "stack-outside", "cat-wenet"]
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


class StackedKV(nn.Module):
    """``LAYERS`` attention layers over a window of ``W`` frames each. ``form`` says how the
    per-layer windows are joined into the state:

    * ``stack``: ``stack([stack([k, v])[..., -W:, :] per layer])`` (Freeze-Omni), state
      ``(layers, 2, 1, heads, frames, d)``;
    * ``stack-inside``: the window taken of ``k`` and ``v`` before they are stacked;
    * ``stack-outside``: the window taken once, after both stacks;
    * ``cat-wenet``: state ``(layers, heads, frames, 2d)``; each layer's ``att[i:i+1]`` is split
      into ``k``/``v`` along the last dim and ``cat((k, v), -1)[:, :, -W:]`` catted on dim 0.
    """

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.qkv = nn.ModuleList(nn.Linear(HEADS * D, 3 * HEADS * D) for _ in range(LAYERS))

    def forward(self, x, cache):
        caches = []
        for i, lin in enumerate(self.qkv):
            q, k, v = lin(x).view(1, -1, 3, HEADS, D).permute(2, 0, 3, 1, 4)
            if self.form == "cat-wenet":
                old_k, old_v = cache["kv"][i:i + 1].split(D, dim=-1)
            else:
                old_k, old_v = cache["kv"][i][0], cache["kv"][i][1]
            k = torch.cat([old_k, k], dim=2)
            v = torch.cat([old_v, v], dim=2)
            att = (q @ k.transpose(-1, -2)).softmax(-1) @ v
            x = x + att.transpose(1, 2).reshape(1, -1, HEADS * D)
            if self.form == "stack" or (self.form == "uneven" and i != 1):
                caches.append(torch.stack([k, v])[:, :, :, -W:])
            elif self.form == "uneven":   # layer 1 keeps its first W frames
                caches.append(torch.stack([k, v])[:, :, :, :W])
            elif self.form == "stack-inside":
                caches.append(torch.stack([k[:, :, -W:], v[:, :, -W:]]))
            elif self.form == "stack-outside":
                caches.append(torch.stack([k, v]))
            else:
                caches.append(torch.cat((k, v), dim=-1)[:, :, -W:])
        if self.form == "cat-wenet":
            return x, {"kv": torch.cat(caches, dim=0)}
        state = torch.stack(caches)
        return x, {"kv": state[:, :, :, :, -W:] if self.form == "stack-outside" else state}


def _adapter(form: str) -> Adapter:
    if form == "cat-wenet":
        dim, shape = 2, ("layers", "heads", None, "d2")
    else:
        dim, shape = 4, ("layers", 2, 1, "heads", None, "d")
    return Adapter(
        name=f"stacked-{form}", clocks={"W": W, "c": CHUNK, "layers": LAYERS, "heads": HEADS,
                                        "d": D, "d2": 2 * D},
        regions=(Region(name="kv", input="cache.kv", output="1.kv", dim=dim,
                        retention=SlidingWindow("W"), advance="c", ordering=APPEND, shape=shape),),
        call_frames=("c",), call_input="x", call_dim=1)


def _empty(form, device):
    if form == "cat-wenet":
        return {"kv": torch.zeros(LAYERS, HEADS, 0, 2 * D, device=device)}
    return {"kv": torch.zeros(LAYERS, 2, 1, HEADS, 0, D, device=device)}


def _stream(step, form, xs, device):
    return stream(step, xs, lambda: _empty(form, device), "kv")


def _count(compiled, op) -> int:
    return sum(n.target is op for e in compiled.classes.values()
               for m in e.gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
def test_stacked_windows_are_written_in_place_on_one_carry(form, device):
    torch.manual_seed(0)
    model = StackedKV(form).to(device)
    xs = [torch.randn(1, CHUNK, HEADS * D, device=device) for _ in range(12)]
    compiled = cadence_fx.compile(model, _adapter(form))
    ours, stock = _stream(compiled, form, xs, device), _stream(model, form, xs, device)
    assert [torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, stock)] \
        == [True] * len(xs)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks, k.carry_addresses) == (len(xs), 0, 1)
    writes = [w for e in compiled.classes.values() for w in e.records.rewrites
              if w.region == "kv"]
    assert {w.kind for w in writes} == {"append", "retention"}
    assert all(f"{2 * LAYERS} windows" in w.detail for w in writes)
    aten = torch.ops.aten
    assert _count(compiled, aten.cat.default) == 0 and _count(compiled, aten.stack.default) == 0
    if device == "cuda":
        assert k.replays == len(xs)


@pytest.mark.parametrize("form", ["stack", "cat-wenet"])
def test_the_shadow_auditor_checks_every_stacked_write(form):
    model = StackedKV(form)
    compiled = cadence_fx.compile(model, _adapter(form), verify=True)
    xs = [torch.randn(1, CHUNK, HEADS * D) for _ in range(8)]
    ours, stock = _stream(compiled, form, xs, "cpu"), _stream(model, form, xs, "cpu")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(ours, stock))
    assert compiled.auditor.comparisons["kv"] == len(xs) == compiled.counters.compiled_calls


def test_steady_state_moves_the_kept_frames_once_for_every_layer():
    """At the full window each layer writes its chunk into the carry's room (one copy per layer
    and k/v), and one move brings the window down for all layers at once: the 6 kept frames
    move down by 2, overlapping, so through one temporary (one more copy), not one per layer."""
    model = StackedKV("stack")
    compiled = cadence_fx.compile(model, _adapter("stack"))
    _stream(compiled, "stack", [torch.randn(1, CHUNK, HEADS * D) for _ in range(10)], "cpu")
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((W,), CHUNK)]
    nodes = [n for m in steady.gm.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes]
    aten = torch.ops.aten
    assert sum(n.target is aten.copy_.default for n in nodes) == 2 * LAYERS + 1
    assert sum(n.target is aten.clone.default for n in nodes) == 1


def test_parts_that_keep_different_windows_are_copied_with_the_reason():
    """A layer keeping another window (its first ``W`` frames, not its last) makes the state no
    single window of the carry: the full-window class copies it once (materialize), exact, with
    the parts that differ in the reason."""
    model = StackedKV("uneven")
    compiled = cadence_fx.compile(model, _adapter("uneven"))
    xs = [torch.randn(1, CHUNK, HEADS * D) for _ in range(8)]
    ours, stock = _stream(compiled, "uneven", xs, "cpu"), _stream(model, "uneven", xs, "cpu")
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ours, stock))
    (steady,) = [e for key, e in compiled.classes.items() if key[0] == ((W,), CHUNK)]
    (write,) = [w for w in steady.records.rewrites if w.region == "kv"]
    assert write.kind == "materialize"
    assert "part [1, 0] keeps frames [0, 6) of 6 + 2, part [0, 0] [2, 8)" in write.detail
    assert compiled.counters.fallbacks == 0
