"""Session pools: many conversations over one compiled step. A session's outputs never depend on
which sessions ran between its chunks (bit-exact against the session run alone), whatever the
interleaving, turn resets and calls outside the catalog; bad ids get a clear error."""
import collections
import os
import random
import re
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import cadence_fx
from cadence_fx.admission import _extent_fix
from cadence_fx.catalog import build_catalog
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from helpers import stream
from replay_stand_in import StandInBackend
from schedule_share import CompiledShare

SEED_WIDTHS = (8, 8, 8, 10, 8, 4)   # 8: steady, 10: the longer last call, 4: a partial flush
# The long run (on the device: CADENCE_FX_SCHEDULES=10000 CADENCE_FX_DEVICE=cuda) uses the same test.
SCHEDULES = int(os.environ.get("CADENCE_FX_SCHEDULES", "25"))
DEVICE = os.environ.get("CADENCE_FX_DEVICE", "cpu")


@pytest.fixture(scope="module")
def toy():
    model = PromptRetainedToy().to(DEVICE)
    g = torch.Generator().manual_seed(11)
    prompts = []
    for _ in range(3):   # three speakers, three prompt states
        with torch.no_grad():
            _, state = model(torch.randn(1, 24, 64, generator=g).to(DEVICE), None)
        prompts.append({k: v.clone() for k, v in state.items()})
    return model, prompts


@pytest.fixture(scope="module")
def shared(toy):
    """One compiled step for every generated schedule, as a server keeps one: classes are traced
    (and captured) once, each schedule opens a new pool on it."""
    return cadence_fx.compile(toy[0], PROMPT_RETAINED_ADAPTER)


def _chunks(n, seed, widths=SEED_WIDTHS, first=None):
    """``n`` chunks of widths drawn from ``widths``; ``first`` fixes the first one's."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    drawn = [rng.choice(widths) for _ in range(n)]
    if first is not None:
        drawn[0] = first
    return [torch.randn(1, w, 64, generator=g).to(DEVICE) for w in drawn]


# What admission must do with each chunk of a session, from the adapter's numbers: the extent
# follows the stock retention (prompt + last frames), and a call runs a compiled class only at a
# catalog extent with a width the adapter admits; otherwise the stock step, with this reason.
_CATALOG = build_catalog(PROMPT_RETAINED_ADAPTER)
_EXTENTS = sorted(_CATALOG.region("att").extents)                        # [24, 32, 40]
_WIDTHS = list(PROMPT_RETAINED_ADAPTER.call_widths())                     # [8, 10]
_ADMITTED = set(range(1, PROMPT_RETAINED_ADAPTER.clocks["f_chunk"] + 1)) | set(_WIDTHS)


def _refusal(extent: int, width: int) -> Optional[str]:
    if extent not in _EXTENTS:   # (the fix's wording is test_error_fixes.py's)
        return (f"region 'att' extent {extent} is not in the catalog {_EXTENTS} derived from its "
                "retention clocks; " + _extent_fix(PROMPT_RETAINED_ADAPTER,
                                                   PROMPT_RETAINED_ADAPTER.regions[0], extent, _EXTENTS))
    if width not in _ADMITTED:
        return (f"call width {width} is neither a declared call width {_WIDTHS} nor admitted "
                f"(admission f_chunk = {PROMPT_RETAINED_ADAPTER.clocks['f_chunk']}); declare a "
                f"clock of {width} in `call_frames`, or an `admission` clock of at least {width} "
                "for partial calls")
    return None


def _admission(chunks, resets):
    """Per chunk of one session: ``(class, reason)``, the class ``(extent, width)`` a compiled
    call runs, or the reason the stock step runs it (the other is None)."""
    plan, extent = [], _EXTENTS[0]
    for i, x in enumerate(chunks):
        if i in resets:
            extent = _EXTENTS[0]
        w = x.shape[1]
        reason = _refusal(extent, w)
        plan.append((None if reason else (extent, w), reason))
        extent = min(extent + w, _EXTENTS[-1])
    return plan


@pytest.fixture
def share(request):
    """The share of each schedule's calls on the compiled path; one summary line per test."""
    tally = CompiledShare(request.node.name)
    yield tally
    print(tally.summary())


def _alone(model, prompt, chunks, resets):
    """The session run by itself through the stock step."""
    outs, state = [], prompt
    for i, x in enumerate(chunks):
        if i in resets:
            state = prompt
        with torch.no_grad():
            y, state = model(x, state)
        outs.append(y.clone())
    return outs


def _interleaved(pool, prompts, chunks, resets, order, before=None, fresh=False):
    """``before(k)`` runs before the k-th chunk overall; ``fresh`` resets with a newly allocated
    copy of the prompt state (the caller re-allocated the region: same values, new address)."""
    ids = [pool.open(p) for p in prompts]
    pos = [0] * len(ids)
    outs = [[] for _ in ids]
    for k, s in enumerate(order):
        i = pos[s]
        if before is not None:
            before(k)
        if i in resets[s]:
            pool.reset(ids[s], {n: t.clone() for n, t in prompts[s].items()} if fresh else prompts[s])
        with torch.no_grad():
            y, _ = pool.step(ids[s], chunks[s][i])
        outs[s].append(y.clone())
        pos[s] += 1
    return outs, ids


def _events(start, counters):
    """What a schedule exercised, for ``--hypothesis-show-statistics``: replays, classes
    invalidated by a moved address, eager fallbacks by reason."""
    after = counters.as_dict()
    for name in ("replays", "invalidations"):
        if after[name] > start[name]:
            event(f"{name} > 0")
    for reason, n in after["reasons"].items():
        if n > start["reasons"].get(reason, 0):
            event("fallback: " + re.sub(r"\d+", "N", reason.split(":")[0])[:60])


def _order(lengths, seed):
    rng = random.Random(seed)
    order = [s for s, n in enumerate(lengths) for _ in range(n)]
    rng.shuffle(order)
    return order


def test_interleaved_sessions_equal_each_session_alone(toy):
    model, prompts = toy
    chunks = [_chunks(6, seed=s, widths=(8,)) for s in range(3)]   # steady chunks: all in the catalog
    resets = [{3}, set(), {2, 5}]
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER))
    outs, ids = _interleaved(pool, prompts, chunks, resets, _order([6, 6, 6], seed=1))
    for s in range(3):
        alone = _alone(model, prompts[s], chunks[s], resets[s])
        assert [torch.equal(a, b) for a, b in zip(alone, outs[s])] == [True] * 6
    k = pool.compiled.counters
    assert k.compiled_calls == 18 and k.fallbacks == 0
    assert pool.swaps > 0 and k.carry_addresses == 1   # one set of carries, graphs shared
    assert all(pool.snapshot_bytes(i) <= pool.compiled.carries["att"].tensor.nbytes for i in ids)


def test_prompt_state_is_never_written(toy):
    model, prompts = toy
    before = {k: v.clone() for k, v in prompts[0].items()}
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER))
    a, b = pool.open(prompts[0]), pool.open(prompts[0])   # two sessions, one prompt
    xs = _chunks(4, seed=3)
    with torch.no_grad():   # (with grad on, weights that require grad send every call to stock)
        for x in xs:
            pool.step(a, x)
            pool.step(b, x)
        assert all(torch.equal(before[k], prompts[0][k]) for k in before)
        assert torch.equal(pool.step(a, _chunks(1, 9)[0])[0], pool.step(b, _chunks(1, 9)[0])[0])
    plan = _admission(xs + _chunks(1, 9), set())
    k = pool.compiled.counters
    assert k.compiled_calls == 2 * sum(cls is not None for cls, _ in plan) > 0
    assert k.reasons == collections.Counter(r for _, r in plan + plan if r)


def test_bad_session_ids_and_state_arguments(toy):
    model, prompts = toy
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER))
    a = pool.open(prompts[0])
    pool.close(a)
    with pytest.raises(KeyError, match=r"no session 0 in this pool \(open: \[\]\)"):
        pool.step(a, _chunks(1, 0)[0])
    with pytest.raises(KeyError, match="no session 41"):
        pool.reset(41, prompts[0])
    b = pool.open(prompts[0])
    with pytest.raises(TypeError, match=f"without {pool.state_arg!r}"):
        pool.step(b, _chunks(1, 0)[0], **{pool.state_arg: prompts[0]})


def test_a_call_outside_the_pool_is_detected_not_silently_mixed_in(toy):
    model, prompts = toy
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER)
    pool = cadence_fx.SessionPool(compiled)
    a = pool.open(prompts[0])
    x = _chunks(1, 5, widths=(8,))[0]
    with torch.no_grad():   # (with grad on, weights that require grad send every call to stock)
        pool.step(a, x)
        compiled(x, prompts[1])          # the same compiled step, used directly
        b = pool.open(prompts[1])
        with pytest.raises(cadence_fx.GuardError, match="ran outside this pool after session 0"):
            pool.step(b, x)
        with pytest.raises(cadence_fx.GuardError, match=r"session 0 lost its state.*pool.reset\(0"):
            pool.step(a, x)
        pool.step(b, x)                  # the other sessions go on
        pool.reset(a, prompts[0])
        assert torch.equal(pool.step(a, x)[0], model(x, prompts[0])[0])
    assert compiled.counters.fallbacks == 0


def _schedule(seed, lengths, odd):
    """Chunks and resets of each session; session 0 starts with a steady chunk, so every
    schedule has a call the compiled path must run."""
    widths = SEED_WIDTHS + ((13, 3) if odd else ())
    rng = random.Random(seed)
    chunks = [_chunks(n, seed + s, widths, first=8 if s == 0 else None)
              for s, n in enumerate(lengths)]
    resets = [{i for i in range(1, n) if rng.random() < 0.25} for n in lengths]
    return chunks, resets


def _delta(counted, counters):
    """Counters gained since ``counted`` (an ``as_dict()``), reasons as a Counter."""
    now = counters.as_dict()
    gained = {k: now[k] - counted[k] for k in ("calls", "compiled_calls", "replays", "fallbacks",
                                              "invalidations")}
    reasons = collections.Counter(now["reasons"])
    gained["reasons"] = reasons - collections.Counter(counted["reasons"])
    return gained


@settings(max_examples=SCHEDULES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       odd=st.booleans())
def test_random_schedules_stay_bit_exact(toy, shared, share, seed, lengths, odd):
    """Random interleavings, resets and widths; ``odd`` adds widths outside the catalog (the
    stock step runs them) -- every session still equals itself run alone, and each chunk ran
    the compiled class or the stock step (with the reason) exactly as its extent and width imply."""
    model, prompts = toy
    chunks, resets = _schedule(seed, lengths, odd)
    pool = cadence_fx.SessionPool(shared)
    counted = shared.counters.as_dict()
    outs, _ = _interleaved(pool, prompts[:len(lengths)], chunks, resets, _order(lengths, seed))
    for s, n in enumerate(lengths):
        alone = _alone(model, prompts[s], chunks[s], resets[s])
        assert all(torch.equal(a, b) for a, b in zip(alone, outs[s]))
    plan = [step for s in range(len(lengths)) for step in _admission(chunks[s], resets[s])]
    compiled = sum(cls is not None for cls, _ in plan)
    got = _delta(counted, shared.counters)
    share.add(got["compiled_calls"], len(plan))
    assert (got["calls"], got["compiled_calls"]) == (len(plan), compiled)
    assert got["reasons"] == collections.Counter(r for _, r in plan if r)
    assert got["fallbacks"] == len(plan) - compiled
    assert got["replays"] == (compiled if DEVICE == "cuda" else 0)   # one graph per class
    _events(counted, shared.counters)


MOVED = "piece_0: fixed-address input(s) ['param inp.weight'] moved (invalidated)"
OOM = "CUDA out of memory (injected by the test)"
FAILED = f"piece_0: capture failed: OutOfMemoryError: {OOM}"


class _Fragile:
    """The compiled step of the property below, kept apart from ``shared``: its classes get
    invalidated and some captures fail. A class whose capture failed stays eager for good (as
    it should), so after such a schedule the step is compiled afresh over the same traces
    (``trace_cache``) and later schedules replay again. On the CPU its pieces are captured and
    replayed by the stand-in backend (``replay_stand_in``), on CUDA as device graphs.

    ``graphs`` is what the replay guard must find for each class ``(extent, width)``: captured at
    the current addresses (``live``), captured before the weight moved (``stale``), or a failed
    capture (``failed``); a class never captured is absent.

    With failing captures, a schedule's captures fail once it has replayed a graph (the first
    capture before that succeeds), so every schedule replays at least one graph and the failures
    still hit the classes it reaches later."""

    def __init__(self, model):
        self.model, self.traces = model, {}
        self._compile()

    def _compile(self):
        backend = StandInBackend() if DEVICE == "cpu" else None   # None: CUDA graphs
        self.step = cadence_fx.compile(self.model, PROMPT_RETAINED_ADAPTER, trace_cache=self.traces,
                                       backend=backend)
        self.graphs = {}
        # Weights moved away from while this step's graphs may have bound them. Kept alive, so a
        # moved weight never lands on an address a stale graph bound (the caching allocator would
        # hand it back; the guard then rightly finds the address valid and replays, which
        # ``expect`` cannot foresee). Dropped with the step.
        self.retired = []

    @property
    def captured(self) -> int:
        return getattr(self.step.backend, "captured", 0)

    def renew(self):
        self.step.close()
        self._compile()

    def expect(self, calls, move_at, fail):
        """What the guard must do over ``calls`` (``(class, reason)`` in call order, see
        ``_admission``) when the weight moves before call ``move_at`` and, with ``fail``, every
        capture after the schedule's first replay fails: counts of compiled calls, replays,
        invalidations and captures, and the reasons of every fallback."""
        want = collections.Counter()
        reasons = collections.Counter()
        for k, (cls, reason) in enumerate(calls):
            if k == move_at:
                self.graphs = {c: "stale" if g == "live" else g for c, g in self.graphs.items()}
            if reason:
                reasons[reason] += 1
                continue
            want["compiled"] += 1
            graph = self.graphs.get(cls)
            if graph is None and fail and want["replays"]:
                self.graphs[cls] = "failed"
                reasons[FAILED] += 1
            elif graph is None:
                self.graphs[cls] = "live"
                want["captures"] += 1
                want["replays"] += 1
            elif graph == "live":
                want["replays"] += 1
            elif graph == "stale":   # invalidated: eager now, captured again at its next call
                del self.graphs[cls]
                want["invalidations"] += 1
                reasons[MOVED] += 1
            else:
                reasons[FAILED] += 1
        return want, reasons


@pytest.fixture(scope="module")
def fragile(toy):
    return _Fragile(toy[0])


@settings(max_examples=SCHEDULES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       odd=st.booleans(), move_weight_at=st.none() | st.integers(0, 17), fresh=st.booleans(),
       fail_captures=st.booleans())
def test_random_schedules_survive_moved_regions_and_failed_captures(
        toy, fragile, share, seed, lengths, odd, move_weight_at, fresh, fail_captures):
    """The same random schedules, while the caller moves things under the compiled step: a weight
    re-allocated mid-schedule (same values, new address: captured classes that bound it are
    invalidated and re-captured), resets from a re-allocated prompt state (``fresh``: the carry
    does not move, nothing is invalidated), and, with ``fail_captures``, every capture in the
    schedule after its first replay raising ``torch.OutOfMemoryError`` (those classes stay eager
    with the reason). Every schedule replays at least one graph (the rare ones that could not,
    a single compiled call invalidated by the moved weight, are discarded before they run).
    Every session still equals itself run alone, and the compiled calls, replays,
    invalidations, captures and the reason of every fallback are exactly what the schedule
    implies."""
    model, prompts = toy
    chunks, resets = _schedule(seed, lengths, odd)
    order = _order(lengths, seed)
    plans = [iter(_admission(chunks[s], resets[s])) for s in range(len(lengths))]
    calls = [next(plans[s]) for s in order]

    def before(k):
        if k == move_weight_at:   # the old storage stays alive: the new one cannot take its address
            fragile.retired.append(model.inp.weight.data)
            model.inp.weight.data = model.inp.weight.data.clone()

    real_graph = torch.cuda.graph
    counted, captured = fragile.step.counters.as_dict(), fragile.captured
    graphs = dict(fragile.graphs)
    want, reasons = fragile.expect(calls, move_weight_at, fail_captures)
    if want["replays"] == 0:
        fragile.graphs = graphs
        assume(False)   # would replay nothing: proves nothing about the replay path

    def oom():
        replayed = fragile.step.counters.replays > counted["replays"]
        return torch.OutOfMemoryError(OOM) if replayed else None

    class OutOfMemory(real_graph):
        def __enter__(self):
            if oom() is not None:
                raise oom()
            return super().__enter__()

    if fail_captures:
        torch.cuda.graph = OutOfMemory
        if DEVICE == "cpu":
            fragile.step.backend.fail = oom
    try:
        pool = cadence_fx.SessionPool(fragile.step)
        outs, _ = _interleaved(pool, prompts[:len(lengths)], chunks, resets, order,
                               before=before, fresh=fresh)
    finally:
        torch.cuda.graph = real_graph
        if DEVICE == "cpu":
            fragile.step.backend.fail = None
    for s, n in enumerate(lengths):
        alone = _alone(model, prompts[s], chunks[s], resets[s])
        assert all(torch.equal(a, b) for a, b in zip(alone, outs[s]))
    got = _delta(counted, fragile.step.counters)
    share.add(got["compiled_calls"], len(calls))
    assert (got["calls"], got["compiled_calls"]) == (len(calls), want["compiled"])
    assert got["reasons"] == reasons and got["fallbacks"] == sum(reasons.values())
    assert (got["replays"], got["invalidations"], fragile.captured - captured) == \
        (want["replays"], want["invalidations"], want["captures"])
    assert got["replays"] >= 1
    _events(counted, fragile.step.counters)
    if FAILED in reasons:
        event("captures failed (injected OutOfMemoryError), those classes stayed eager")
        fragile.renew()


def test_sessions_draw_from_their_own_generators():
    """A step drawing device randomness (HiFT-style): each session has its own generator state,
    so interleaved sessions equal each session run alone from the same seed."""
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy
    model = NoisySourceToy()
    g = torch.Generator().manual_seed(2)
    xs = [[torch.randn(1, 16, 8, generator=g) for _ in range(5)] for _ in range(3)]
    zero = torch.zeros(1, 16, 2)

    refs = [[y for y, _ in stream(model, xs[s], zero, None, reset_at=len(xs[s]),
                                  before=lambda i, s=s: i or torch.manual_seed(100 + s))]
            for s in range(3)]
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, NOISY_ADAPTER))
    ids = [pool.open(zero, seed=100 + s) for s in range(3)]
    outs = [[] for _ in ids]
    for s in _order([5, 5, 5], seed=4):
        with torch.no_grad():
            y, _ = pool.step(ids[s], xs[s][len(outs[s])])
        outs[s].append(y.clone())
    for s in range(3):
        assert [torch.equal(a, b) for a, b in zip(refs[s], outs[s])] == [True] * 5
    k = pool.compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (15, 0) and pool.swaps > 0
