"""What many test files need: running a step over a stream with a turn reset, and comparing
results bit for bit.

* ``stream(step, xs, start, key)``: ``y, state = step(x, state)`` for every chunk under
  ``torch.no_grad()`` (or ``mode=torch.inference_mode``), from ``start`` (a state, or a callable
  making a fresh one) and back to it at ``reset_at`` (a turn reset; the middle of the stream by
  default); returns ``[(y, state[key])]`` (the whole state where ``key`` is None), cloned
  (``clone``: nested results, detached).
* ``same(a, b)``: nested outputs (tensors, dicts, lists, tuples, None, numbers) equal: the same
  structure, dict keys and lengths, and ``torch.equal`` on every pair of tensors. With
  ``bits=True`` floats are compared by their bit patterns (``bits``): ``torch.equal`` calls -0.0
  and +0.0 equal and finds a NaN unequal to itself.
* ``side_by_side(ours, stock, xs, start)``: each chunk through a compiled step and the stock
  module, each from its own last state, yielding both results per chunk.
* ``window_adapter(name, shape, w=, c=)``: the small adapter most hand-written steps need, one
  region ``k`` kept as a sliding window of ``W`` frames, read from ``cache.k``, returned as
  ``1.k``, ``c`` frames per call of ``x``.
* ``seed_weights(module, seed)``: every parameter drawn from one seeded generator, scaled so that
  a stack of layers keeps its activations near unit size (the hand-written models' weights).
* ``StandInBackend``: the CPU stand-in of the device-graph backend
  (``cadence_fx/replay_stand_in.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from cadence_fx.contract import APPEND, Adapter, Region, SlidingWindow
from cadence_fx.replay_stand_in import Capture, StandInBackend

__all__ = ["stream", "clone", "side_by_side", "same", "bits", "window_adapter", "seed_weights",
           "StandInBackend", "Capture"]

_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def stream(step, xs, start, key: Optional[str], *, reset_at: Optional[int] = None,
           before: Optional[Callable[[int], None]] = None, mode=torch.no_grad):
    """Outputs and states (``state[key]``, or the whole state where ``key`` is None), cloned, of
    ``step`` over ``xs`` under ``mode()`` with one turn reset at ``reset_at`` (default
    ``len(xs) // 2``); ``before(i)`` runs before chunk ``i``."""
    fresh = start if callable(start) else (lambda: start)
    reset_at = len(xs) // 2 if reset_at is None else reset_at
    state, outs = fresh(), []
    for i, x in enumerate(xs):
        if before is not None:
            before(i)
        if i == reset_at:
            state = fresh()
        with mode():
            y, state = step(x, state)
        outs.append(clone((y, state if key is None else state[key])))
    return outs


def clone(x):
    """A detached copy of a nested result: its tensors cloned, dicts, lists and tuples rebuilt."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(clone(v) for v in x)
    return x


def side_by_side(ours, stock, xs, start, *, state_at: int = 1):
    """``ours(x, state)`` and ``stock(x, state)`` for every chunk under ``torch.no_grad()``, each
    from its own last state (its result's ``state_at``-th item), both from ``start``: yields
    ``(got, want)`` per chunk before the next call, so a test may check or change them."""
    got_state = want_state = start
    for x in xs:
        with torch.no_grad():
            got, want = ours(x, got_state), stock(x, want_state)
        yield got, want
        got_state, want_state = got[state_at], want[state_at]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (floats viewed as integers of their width), NaN payloads and
    the sign of zero included."""
    return t.contiguous().view(_INT[t.dtype]) if t.dtype in _INT else t


def same(a, b, *, bits: bool = False) -> bool:
    """``a`` and ``b`` equal bit for bit, structure included (see the module docstring)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return torch.equal(_bits(a), _bits(b)) if bits else torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same(a[k], b[k], bits=bits) for k in a))
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same(x, y, bits=bits) for x, y in zip(a, b)))
    return a == b


_bits = bits


def window_adapter(name: str, shape, *, w: int, c: int, region: str = "k", order: str = APPEND,
                   dim: int = 2, clocks=None, **adapter) -> Adapter:
    """One region ``region`` kept as a sliding window of ``W = w`` frames along ``dim`` (its
    ``shape`` with ``None`` there), ``c`` frames per call; ``clocks`` adds named sizes, ``adapter``
    more of the adapter's fields (``constants=...``)."""
    return Adapter(
        name=name, clocks={"W": w, "c": c, **(clocks or {})},
        regions=(Region(name=region, input=f"cache.{region}", output=f"1.{region}", dim=dim,
                        retention=SlidingWindow("W"), advance="c", ordering=order, shape=shape),),
        call_frames=("c",), call_input="x", call_dim=dim, **adapter)


def seed_weights(module: torch.nn.Module, seed: int) -> None:
    """Every parameter of ``module`` from one generator seeded ``seed``, in ``named_parameters``
    order: matrices by ``1 / sqrt(fan_in)``, biases near 0, other vectors (norm scales) near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(r / max(1, p[0].numel()) ** 0.5 if p.dim() > 1
                    else (0.05 * r if name.endswith("bias") else 1 + 0.1 * r))


def depformer_offsets(x):
    """Moshi's depformer offsets: a fresh int64 counter stepped in place between its readers."""
    t = torch.zeros(1, dtype=torch.long)
    a = t.add_(1)
    y = x + a * 3
    a.add_(1)
    return y * t, t + 1


def talk_at_once(plans, timeout: float = 300.0) -> None:
    """Each ``(talker, [(turn, chunks), ...])`` says its turns from a thread of its own, all at
    once, as a replica's worker threads run their sessions' requests; an error in any thread is
    raised here."""
    import threading
    errors = []

    def talk(talker, turns):
        try:
            for turn, chunks in turns:
                talker.say(turn, chunks)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=talk, args=plan) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), f"a talker still runs after {timeout} s"
