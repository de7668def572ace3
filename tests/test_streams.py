"""Whole streams of the three toy models, compiled against stock eager, call by call.

Every output and every state tensor is compared with ``torch.equal`` at every call (bit-exactness is
the product). Streams cross turn resets (the caller hands back the prompt/initial state) and end a
turn with a partial chunk where the adapter admits one; widths it does not admit fall back to the
stock step with a recorded reason. Counters are asserted exactly where the stream determines them.

Stock and compiled run on two modules built with the same seed: the prompt-retained toy writes its
module buffer (the stock envelope) in place, so a shared module would let one side see the other's
writes.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import cadence_fx
from cadence_fx.admission import _extent_fix
from cadence_fx.catalog import build_catalog
from cadence_fx.models.toy import (CONV_ADAPTER, PROMPT_RETAINED_ADAPTER, RING_ADAPTER,
                                   ConvLeftContextToy, PromptRetainedToy, RingToy)
from schedule_share import CompiledShare


# -- the three toys, as stream drivers ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Toy:
    name: str
    make: Callable[[], torch.nn.Module]        # a seeded module; two calls give identical weights
    adapter: cadence_fx.Adapter
    f_chunk: int                               # steady call width
    admitted: Tuple[int, ...]                  # widths the adapter admits (for a turn's last call)
    rejected: Tuple[int, ...]                  # widths it does not admit
    x_shape: Callable[[int], Tuple[int, ...]]  # call input of width w
    initial: Callable[[], tuple]               # the state a turn starts from (after x)
    advance: Callable[[tuple, int], tuple]     # extents after a call of width w (admitted or
                                               # not: the stock step keeps the same state)
    start: tuple                               # catalog extents at a turn start
    retains: Callable[[tuple, int], int]       # regions whose retention fires in a call at these
                                               # extents of width w

    def call(self, step, x, state):
        """One call: (every tensor to compare, the state to hand back, the region state tensors)."""
        out = step(x, *state)
        if self.name == "prompt":
            y, cache = out
            return (y, cache["att"]), (cache,), (cache["att"],)
        if self.name == "ring":
            y, kv, offset = out
            return (y, kv, offset), (kv, offset), (kv,)
        y, conv, att = out
        return (y, conv, att), (conv, att), (conv, att)


@functools.lru_cache(maxsize=None)
def _prompt_state():
    """The prompt state a turn reset restores: the priming pass of a separate module, cloned."""
    with torch.no_grad():
        prompt = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(7))
        _, cache = PromptRetainedToy()(prompt)
    return {"att": cache["att"].clone()}


_P, _R = 24, 16  # the prompt-retained toy's prompt and retained frames

TOYS = {
    "prompt": Toy(
        name="prompt", make=PromptRetainedToy, adapter=PROMPT_RETAINED_ADAPTER, f_chunk=8,
        admitted=tuple(range(1, 9)) + (10,), rejected=(9, 11, 13),
        x_shape=lambda w: (1, w, 64), initial=lambda: (_prompt_state(),),
        advance=lambda e, w: (min(e[0] + w, _P + _R),), start=(_P,),
        retains=lambda e, w: e[0] + w > _P + _R),
    "ring": Toy(
        name="ring", make=RingToy, adapter=RING_ADAPTER, f_chunk=1, admitted=(1,), rejected=(2, 3),
        x_shape=lambda w: (1, w, 32),
        initial=lambda: (torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long)),
        advance=lambda e, w: (16,), start=(16,), retains=lambda e, w: False),
    "conv": Toy(
        name="conv", make=ConvLeftContextToy, adapter=CONV_ADAPTER, f_chunk=4,
        admitted=(1, 2, 3, 4), rejected=(5, 6),
        x_shape=lambda w: (1, 32, w), initial=lambda: (torch.zeros(1, 32, 2), torch.zeros(1, 64, 0)),
        # the conv context drops frames on every call; the attention window once it is full
        advance=lambda e, w: (2, min(e[1] + w, 4)), start=(2, 0),
        retains=lambda e, w: 1 + (e[1] + w > 4)),
}


@dataclasses.dataclass
class StreamLog:
    calls: int = 0
    admitted: int = 0
    fallbacks: int = 0
    turn_absorptions: int = 0          # turn starts whose first call is admitted
    retentions: int = 0                # admitted calls where retention fires
    classes: List[tuple] = dataclasses.field(default_factory=list)  # (extents, width), in order
    compiled_ptrs: List[set] = dataclasses.field(default_factory=list)  # per region
    stock_ptrs: List[set] = dataclasses.field(default_factory=list)
    rejected_widths: List[int] = dataclasses.field(default_factory=list)
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@functools.lru_cache(maxsize=None)
def _catalog(name):
    return build_catalog(TOYS[name].adapter)


def _refusal(toy: Toy, extents: tuple, w: int) -> Optional[str]:
    """Why admission must send a call at these extents of width w to the stock step (the
    runtime's reason, word for word), or None when a compiled class must run it."""
    ad, catalog = toy.adapter, _catalog(toy.name)
    for r, e in zip(ad.regions, extents):
        known = catalog.region(r.name).extents
        if e not in known:   # (the fix's wording is test_error_fixes.py's)
            return (f"region {r.name!r} extent {e} is not in the catalog {sorted(known)} derived "
                    "from its retention clocks; " + _extent_fix(ad, r, e, sorted(known)))
    if tuple(extents) not in {e for e, _ in catalog.classes}:
        return (f"region extents {tuple(extents)} never occur together in the catalog; pass the "
                "states of one stream (every region's from the same call), or fix the regions' "
                "`advance` clocks so that they move together as the stream does")
    if w not in toy.admitted:
        return (f"call width {w} is neither a declared call width {list(ad.call_widths())} nor "
                f"admitted (admission {ad.admission} = {ad.clocks[ad.admission]}); declare a "
                f"clock of {w} in `call_frames`, or an `admission` clock of at least {w} for "
                "partial calls")
    return None


def _run_lockstep(toy: Toy, compiled, stock: torch.nn.Module, turns: Sequence[Sequence[int]],
                  seed: int) -> StreamLog:
    """Run ``turns`` (each a list of call widths, starting with a turn reset) through both steps,
    asserting every tensor equal at every call. Returns what the stream did: which calls must have
    run a compiled class, and the reasons the others must have run the stock step with."""
    g = torch.Generator().manual_seed(seed)
    log = StreamLog()
    for turn in turns:
        ref_state, got_state, extents = toy.initial(), toy.initial(), toy.start
        for k, w in enumerate(turn):
            x = torch.randn(toy.x_shape(w), generator=g)
            with torch.no_grad():
                want, ref_state, ref_regions = toy.call(stock, x, ref_state)
                got, got_state, got_regions = toy.call(compiled, x, got_state)
            log.calls += 1
            where = f"{toy.name} call {log.calls} (width {w}, extents {extents})"
            assert len(got) == len(want), where
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: output {i}"
                assert torch.equal(a, b), f"{where}: output {i} differs from stock"
            reason = _refusal(toy, extents, w)
            if reason is None:
                log.admitted += 1
                log.turn_absorptions += k == 0
                log.retentions += toy.retains(extents, w)
                log.classes.append((extents, w))
                log.compiled_ptrs = log.compiled_ptrs or [set() for _ in got_regions]
                log.stock_ptrs = log.stock_ptrs or [set() for _ in ref_regions]
                for ptrs, t in zip(log.compiled_ptrs, got_regions):
                    ptrs.add(t.data_ptr())
                for ptrs, t in zip(log.stock_ptrs, ref_regions):
                    ptrs.add(t.data_ptr())
            else:
                log.fallbacks += 1
                log.rejected_widths.append(w)
                log.reasons[reason] += 1
            extents = toy.advance(extents, w)
    return log


# -- deterministic streams --------------------------------------------------------------------------

STREAMS = {
    # 14 calls: a turn ending on the f_call width (10), a reset, a turn ending on a partial chunk.
    "prompt": [[8] * 7 + [10], [8] * 5 + [5]],
    # 20 calls, wrapping the 16-slot ring; the adapter admits only single frames.
    "ring": [[1] * 12, [1] * 8],
    # 19 calls, each turn ending on a partial chunk.
    "conv": [[4] * 10 + [3], [4] * 6 + [2]],
}


@pytest.mark.parametrize("name", sorted(TOYS))
def test_stream_bit_exact_with_exact_counters(name):
    toy = TOYS[name]
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    log = _run_lockstep(toy, c, toy.make(), STREAMS[name], seed=1)
    n_regions = len(toy.adapter.regions)
    k = c.counters
    assert log.calls >= 12 and log.fallbacks == 0
    assert (k.calls, k.compiled_calls, k.fallbacks, dict(k.reasons)) == (log.calls, log.calls, 0, {})
    assert k.traces == len(set(log.classes)) == len(c.classes)
    assert k.absorptions == len(STREAMS[name]) * n_regions     # one copy-in per region per turn start
    assert k.retentions == log.retentions
    assert (k.invalidations, k.replays) == (0, 0)              # CPU: no device graphs to replay
    assert k.carry_addresses == 1
    assert all(len(p) == 1 for p in log.compiled_ptrs)         # one address for the whole stream
    assert set(k.addresses) == {r.name for r in toy.adapter.regions}
    # verify mode: each carry write was compared once with its stock value, and all matched
    assert k.applications == sum(c.auditor.comparisons.values())


def test_prompt_stream_retention_count_and_classes():
    toy = TOYS["prompt"]
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    log = _run_lockstep(toy, c, toy.make(), STREAMS["prompt"], seed=2)
    # turn 1: extents 24, 32, then 40 for six calls; turn 2: 24, 32, then 40 for four calls
    assert log.retentions == c.counters.retentions == 10
    assert sorted(set(log.classes)) == [((24,), 8), ((32,), 8), ((40,), 5), ((40,), 8), ((40,), 10)]
    assert c.counters.traces == 5
    assert c.counters.applications == 10 and c.auditor.comparisons["att"] == 10
    kinds = {_class_of(entry, toy.adapter): [r.kind for r in entry.records.rewrites]
             for entry in c.classes.values()}
    assert kinds[((24,), 8)] == ["envelope", "in_place"]
    assert kinds[((40,), 8)] == ["envelope", "retention"]
    assert all(not entry.records.near_misses for entry in c.classes.values())


def test_prompt_stream_retaining_from_the_stock_buffer():
    """The prompt-retained toy declared without its envelope and its room: the carry holds no
    room for a call, so the stock buffer stays (a private copy) and retention copies the prompt
    and the last frames from it into the carry, ``C[:P] = X[:P]; C[P:P+R] = X[L-R:L]``, where the
    envelope form moves them within the carry. Both reads must take exactly the stock frames.
    With the room declared and no envelope, the room is honoured: the buffer fits the carry and
    is replaced by it, as with the envelope declared."""
    toy = TOYS["prompt"]
    (region,) = toy.adapter.regions
    roomy = dataclasses.replace(toy.adapter, regions=(dataclasses.replace(region, envelope=None),))
    c = cadence_fx.compile(toy.make(), roomy)
    log = _run_lockstep(toy, c, toy.make(), STREAMS["prompt"], seed=2)
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (log.calls, 0)
    assert c.carries["att"].extent == 24 + 16 + 10
    assert all([r.kind for r in e.records.rewrites][0] == "envelope" for e in c.classes.values())
    adapter = dataclasses.replace(toy.adapter, name="toy-prompt-retained-no-room",
                                  regions=(dataclasses.replace(region, envelope=None, room=None),))
    c = cadence_fx.compile(toy.make(), adapter, verify=True)
    log = _run_lockstep(toy, c, toy.make(), STREAMS["prompt"], seed=2)
    k = c.counters
    assert (k.compiled_calls, k.fallbacks, k.retentions) == (log.calls, 0, 10)
    assert c.auditor.comparisons["att"] == 10 and k.carry_addresses == 1
    kinds = {_class_of(entry, adapter): [r.kind for r in entry.records.rewrites]
             for entry in c.classes.values()}
    assert kinds[((24,), 8)] == ["envelope", "in_place"]          # fits the carry until full
    assert kinds[((40,), 8)] == kinds[((40,), 10)] == kinds[((40,), 5)] == ["retention"]


def _class_of(entry, adapter) -> tuple:
    """(extents, width) of a compiled class, read from the argument signatures in its key."""
    parts = dict(entry.key[1])  # path -> (shape, stride, dtype, device, offset)
    extents = tuple(parts[r.input][0][r.dim] for r in adapter.regions)
    return extents, parts[adapter.call_input][0][adapter.call_dim]


@pytest.mark.parametrize("name", ["prompt", "conv"])
def test_stock_state_moves_while_compiled_state_stays(name):
    toy = TOYS[name]
    c = cadence_fx.compile(toy.make(), toy.adapter)
    log = _run_lockstep(toy, c, toy.make(), STREAMS[name], seed=3)
    assert [len(p) for p in log.compiled_ptrs] == [1] * len(toy.adapter.regions)
    assert max(len(p) for p in log.stock_ptrs) > 1
    assert c.counters.carry_addresses == 1


def test_prompt_state_is_copy_on_write():
    toy = TOYS["prompt"]
    prompt = _prompt_state()
    pristine = prompt["att"].clone()
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    _run_lockstep(toy, c, toy.make(), STREAMS["prompt"], seed=4)
    assert torch.equal(prompt["att"], pristine)
    carry = c.carries["att"].tensor
    assert carry.untyped_storage().data_ptr() != prompt["att"].untyped_storage().data_ptr()


def test_ring_initial_state_is_copy_on_write():
    """Stock writes the ring in place; the compiled step copies the caller's tensor in once and
    never writes it (the same ``kv0`` object restores every turn)."""
    toy = TOYS["ring"]
    kv0, off0 = torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long)
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    stock = toy.make()
    g = torch.Generator().manual_seed(5)
    for turn in STREAMS["ring"]:
        state, ref = (kv0, off0), (kv0.clone(), off0.clone())
        for _ in turn:
            x = torch.randn(1, 1, 32, generator=g)
            with torch.no_grad():
                got, state, _ = toy.call(c, x, state)
                want, ref, _ = toy.call(stock, x, ref)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not kv0.any() and not off0.any()
    assert c.counters.absorptions == 2


def test_conv_partial_chunk_classes():
    toy = TOYS["conv"]
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    log = _run_lockstep(toy, c, toy.make(), STREAMS["conv"], seed=6)
    assert sorted(set(log.classes)) == [((2, 0), 4), ((2, 4), 2), ((2, 4), 3), ((2, 4), 4)]
    assert c.counters.traces == 4
    # every call writes both regions once (the tail slice of a concatenation is materialized)
    assert c.auditor.comparisons == {"conv": log.calls, "att": log.calls}


def test_priming_pass_is_a_compiled_class():
    """No input state yet: the prompt's priming pass is a class of its own; its state is the
    carry, so the next call absorbs nothing."""
    c = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER)
    x = torch.randn(1, 24, 64)
    with torch.no_grad():
        y, cache = c(x, None)
        y_ref, cache_ref = PromptRetainedToy()(x, None)
    assert torch.equal(y, y_ref) and torch.equal(cache["att"], cache_ref["att"])
    k = c.counters
    assert (k.fallbacks, k.compiled_calls, dict(k.reasons), k.carry_addresses) == (0, 1, {}, 1)
    assert c.carries["att"].holds(cache["att"])


@pytest.mark.parametrize("name", sorted(TOYS))
def test_rejected_width_falls_back_bit_exact(name):
    toy = TOYS[name]
    w = toy.rejected[0]
    turns = [[toy.f_chunk] * 3 + [w], [toy.f_chunk] * 2]
    c = cadence_fx.compile(toy.make(), toy.adapter, verify=True)
    log = _run_lockstep(toy, c, toy.make(), turns, seed=8)
    assert c.counters.fallbacks == log.fallbacks == 1
    (reason,) = c.counters.reasons
    assert f"call width {w} is neither a declared call width" in reason
    assert c.counters.compiled_calls == log.calls - 1
    assert c.counters.carry_addresses == 1


# -- property tests over random schedules ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _shared(name):
    """One compiled step (and one stock module) per toy, reused across examples: compiled steps keep
    per-stream state only in their carries, and every example starts with a turn reset."""
    toy = TOYS[name]
    return cadence_fx.compile(toy.make(), toy.adapter, verify=True), toy.make(), set()


@pytest.fixture
def share(request):
    """The share of each schedule's calls on the compiled path; one summary line per test."""
    tally = CompiledShare(request.node.name)
    yield tally
    print(tally.summary())


@st.composite
def schedules(draw, toy: Toy, max_turn: int):
    """Turns of steady calls (at least one); a turn may end on a partial chunk, admitted or not."""
    turns = []
    for _ in range(draw(st.integers(1, 3))):
        widths = [toy.f_chunk] * draw(st.integers(1, max_turn))
        last = draw(st.one_of(st.none(), st.sampled_from(toy.admitted), st.sampled_from(toy.rejected)))
        if last is not None:
            widths.append(last)
        turns.append(widths)
    return turns


def _check_schedule(name, turns, seed, share):
    toy = TOYS[name]
    c, stock, seen = _shared(name)
    before = dataclasses.replace(c.counters, reasons=c.counters.reasons.copy())
    log = _run_lockstep(toy, c, stock, turns, seed=seed)
    k = c.counters
    new_classes = set(log.classes) - seen
    seen.update(log.classes)
    share.add(k.compiled_calls - before.compiled_calls, log.calls)
    assert k.calls - before.calls == log.calls
    assert k.compiled_calls - before.compiled_calls == log.admitted
    assert k.fallbacks - before.fallbacks == log.fallbacks
    assert k.reasons - before.reasons == log.reasons   # partial chunks the adapter does not admit
    assert set(log.rejected_widths) <= set(toy.rejected)
    assert k.absorptions - before.absorptions == log.turn_absorptions * len(toy.adapter.regions)
    assert k.retentions - before.retentions == log.retentions
    assert k.traces - before.traces == len(new_classes)
    assert k.invalidations == 0 and k.replays == 0
    assert k.carry_addresses == 1
    assert [len(p) for p in log.compiled_ptrs] == [1] * len(toy.adapter.regions)


_PROPERTY = settings(max_examples=20, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow,
                                            HealthCheck.function_scoped_fixture])


@_PROPERTY
@given(turns=schedules(TOYS["prompt"], max_turn=7), seed=st.integers(0, 2**16))
def test_prompt_random_schedules(share, turns, seed):
    _check_schedule("prompt", turns, seed, share)


@_PROPERTY
@given(turns=schedules(TOYS["ring"], max_turn=20), seed=st.integers(0, 2**16))
def test_ring_random_schedules(share, turns, seed):
    _check_schedule("ring", turns, seed, share)


@_PROPERTY
@given(turns=schedules(TOYS["conv"], max_turn=6), seed=st.integers(0, 2**16))
def test_conv_random_schedules(share, turns, seed):
    _check_schedule("conv", turns, seed, share)


@st.composite
def ragged_schedules(draw, toy: Toy):
    """Turns whose calls may have any width, admitted or not, anywhere in the turn: a width off the
    catalog moves the extents off it too, so later calls fall back until retention brings them
    back (the prompt-retained toy) or the turn ends. The first call is a steady one, so every
    schedule runs the compiled path at least once."""
    widths = st.sampled_from((toy.f_chunk,) * 3 + toy.admitted + toy.rejected)
    turns = draw(st.lists(st.lists(widths, min_size=1, max_size=8), min_size=1, max_size=3))
    turns[0][0] = toy.f_chunk
    return turns


@pytest.mark.parametrize("name", sorted(TOYS))
@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ragged_schedules_stay_bit_exact(share, name, data):
    """Each call runs the compiled class or the stock step exactly as its extents and width
    imply, and a call sent to the stock step carries the reason for it."""
    toy = TOYS[name]
    turns = data.draw(ragged_schedules(toy), label="turns")
    c, stock, _ = _shared(name)
    before = dataclasses.replace(c.counters, reasons=c.counters.reasons.copy())
    log = _run_lockstep(toy, c, stock, turns, seed=data.draw(st.integers(0, 2**16), label="seed"))
    k = c.counters
    share.add(k.compiled_calls - before.compiled_calls, log.calls)
    assert k.calls - before.calls == log.calls
    assert k.compiled_calls - before.compiled_calls == log.admitted
    assert k.fallbacks - before.fallbacks == log.fallbacks
    assert k.reasons - before.reasons == log.reasons
    assert k.retentions - before.retentions == log.retentions
    assert k.carry_addresses == 1 and k.invalidations == 0
