"""Many conversations on one compiled step: each session owns its state, the graphs are shared.

A ``CompiledStep`` binds its captured graphs to the fixed addresses of its carries. A
``SessionPool`` time-multiplexes sessions over that one set of graphs, in the order their chunks
arrive: the session whose chunk runs has its region state in the carries (it is *resident*); when
another session's chunk comes, the resident session's regions are copied out into that session's
own snapshot buffers (allocated once, at the carry's declared size), and the arriving session's
snapshot is copied in by the ordinary absorption of foreign state. A session that runs twice in a
row costs no copy at all. Every other piece of state (offsets, small caches) lives in the
session's own tensors. Hence a session's outputs never depend on which sessions ran between its
chunks, and the resident memory of one more session is its snapshot, not another set of graphs.

    pool = SessionPool(compiled)            # compiled = cadence_fx.compile(step, adapter)
    a = pool.open(prompt_state)             # the session's starting state (never written)
    mel, state = pool.step(a, mu, spks, cond)   # the step's arguments, without the state
    pool.reset(a, prompt_state)             # turn boundary
    pool.close(a)

``step`` returns what the compiled step returns. Region results in it are views of the shared
carries: valid until another session's chunk runs (the pool keeps the session's own copy).

``SessionPool(compiled, lanes=L)`` keeps L independent sets of carries and graphs (``lanes.py``):
a session is placed on the lane with the fewest sessions when it opens and stays there; each
lane time-multiplexes its own sessions as above, and chunks of different lanes run on their own
CUDA streams, concurrently. On CUDA ``step`` returns once the chunk is queued on its lane's
stream; ``pool.done(sid)`` gives an event to poll (``cadence_fx.scheduler`` does).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .cudagraphs import GLOBAL_STATE
from .effects import drawing_from
from .errors import ContractError, GuardError
from .lanes import Lane, make_lanes

__all__ = ["SessionPool", "warm_lanes"]

_DRAWS = threading.RLock()   # one pooled draw at a time: sessions swap the process's generator


def _locate(tree: Any, path: str) -> Optional[Tuple[Any, Any]]:
    """``(container, key)`` of the leaf at ``path`` ("a.b" walks dicts, lists and tuples; a dict
    key may itself contain dots)."""
    if isinstance(tree, dict) and path in tree:
        return tree, path
    head, _, rest = path.partition(".")
    if isinstance(tree, dict) and head in tree and rest:
        return _locate(tree[head], rest)
    if isinstance(tree, (list, tuple)) and head.isdigit() and rest:
        return _locate(tree[int(head)], rest)
    if isinstance(tree, (list, tuple)) and path.isdigit():
        return tree, int(path)
    return None


class _Session:
    def __init__(self, state, rng, lane: Lane):
        self.state = state
        self.lane = lane        # for life
        self.rng = rng          # its own generator state when the step draws randomness
        self.snapshots: Dict[str, torch.Tensor] = {}
        self.chunks = 0
        self.lost = False       # its state was in the carries when another caller ran the step


class SessionPool:
    """Sessions over one ``CompiledStep`` (see the module docstring)."""

    def __init__(self, compiled, lanes: int = 1, backend_for_lane=None):
        """``lanes``: independent sets of carries and graphs (``lanes.py``); lane 0 is
        ``compiled`` itself. ``backend_for_lane(i)``: lane ``i``'s backend (default: each lane
        chooses its own at its first class)."""
        if compiled.config.donate_state:
            raise ContractError(
                "a session pool keeps every starting state unwritten (one speaker's prompt may "
                "open many sessions), but this step was compiled with donate_state=True, which "
                "takes the first state over as its carry; compile it without donate_state")
        self.compiled = compiled
        self.adapter = compiled.adapter
        args = list(compiled.arguments.parameters)
        heads = {r.input.split(".", 1)[0] for r in self.adapter.regions}
        outs = {r.output.split(".", 1)[0] for r in self.adapter.regions}
        if len(heads) != 1 or len(outs) != 1 or not next(iter(outs)).isdigit():
            raise ContractError(
                f"adapter {self.adapter.name!r}: a session pool needs every region in one state "
                f"argument and one result (inputs {sorted(heads)}, outputs {sorted(outs)}); "
                "keep the step's state in one argument returned as one result (a dict), or "
                "serve each stream through a compiled step of its own")
        self.state_arg = heads.pop()
        if self.state_arg not in args:
            raise ContractError(f"the step has no argument {self.state_arg!r} (its arguments: "
                                f"{args}); fix the regions' `input` paths to name one of them")
        self.state_out = int(outs.pop())
        self._sessions: Dict[int, _Session] = {}
        self._ids = itertools.count()
        self._counts = threading.Lock()   # the lanes' session counts
        self.lanes: List[Lane] = make_lanes(compiled, lanes, backend_for_lane)
        for lane in self.lanes:   # a session keeps a stock call's state past the next one
            lane.compiled.keep_stock_results = True
        self._generator = None   # the device generator sessions draw from (device randomness)

    @property
    def resident(self) -> Optional[int]:
        """The session whose regions are in lane 0's carries."""
        return self.lanes[0].resident

    @property
    def swaps(self) -> int:
        """Resident sessions copied out to their snapshots, all lanes."""
        return sum(lane.swaps for lane in self.lanes)

    # -- the API -----------------------------------------------------------------------------
    def open(self, state=None, seed: Optional[int] = None, lane: Optional[int] = None) -> int:
        """A new session starting from ``state`` (e.g. the prompt state); returns its id. With
        ``state=None`` the session's first chunk is its priming pass: ``step`` hands the step
        ``None`` as the state, and the compiled step runs it as the priming class.

        When the adapter declares device randomness, every session draws from its own generator
        state (swapped in around its chunks), started from ``seed`` -- or from the generator's
        current state when no seed is given -- so its samples never depend on other sessions.
        The session lives on ``lane`` (default: the lane with the fewest sessions) for life."""
        if lane is None:
            home = min(self.lanes, key=lambda x: (x.sessions, x.index))
        elif isinstance(lane, int) and 0 <= lane < len(self.lanes):
            home = self.lanes[lane]
        else:
            raise ValueError(f"lane {lane!r}: this pool has lanes 0..{len(self.lanes) - 1}")
        sid = next(self._ids)
        self._sessions[sid] = _Session(self._own(state), self._rng_start(state, seed), home)
        with self._counts:   # (a scheduler's lane thread may close one meanwhile)
            home.sessions += 1
        return sid

    def reset(self, sid: int, state=None) -> None:
        """Turn boundary: the session restarts from ``state`` (its generator runs on), or with
        ``None`` from a new priming pass (its next chunk)."""
        session = self._get(sid)
        session.state = self._own(state)
        session.lost = False
        if session.lane.resident == sid:
            session.lane.resident = None   # its old data in the carries is no longer wanted

    def close(self, sid: int) -> None:
        session = self._get(sid)
        del self._sessions[sid]
        with self._counts:
            session.lane.sessions -= 1
        if session.lane.resident == sid:
            session.lane.resident = None

    def step(self, sid: int, *args, **kwargs):
        """Run one chunk of session ``sid``: the step's arguments without the state. On CUDA it
        is queued on the session's lane stream (``done(sid)`` is its event)."""
        session = self._get(sid)
        if self.state_arg in kwargs:
            raise TypeError(f"pass the step's arguments without {self.state_arg!r}: the pool "
                            "holds each session's state")
        lane = session.lane
        self._check_lane(lane)
        if session.lost:
            raise GuardError(f"session {sid} lost its state (see the earlier error); call "
                             f"pool.reset({sid}, state) to restart it")
        kwargs[self.state_arg] = session.state
        compiled = lane.compiled
        compiled_before = compiled.counters.compiled_calls
        met, start = lane.classes_met(), time.perf_counter()
        with lane.running():
            if lane.resident is not None and lane.resident != sid:
                self._save(self._sessions[lane.resident])
            result = self._call(session, args, kwargs)
        lane.note_compiles(sid, session.chunks, met, time.perf_counter() - start)
        session.chunks += 1
        lane.calls_seen = compiled.counters.calls
        if compiled.counters.compiled_calls > compiled_before:
            session.state = result[self.state_out]
            lane.resident = sid
        else:
            # The stock step ran (a call outside the catalog). Its state may be views of the
            # module's own scratch buffers, which the next stock call of any session (of any
            # lane, in any thread) overwrites: the step copied what it returned before another
            # could run (``CompiledStep.keep_stock_results``), and no session is resident in the
            # carries.
            session.state = result[self.state_out]
            lane.resident = None
        return result

    def _call(self, session: _Session, args, kwargs):
        """The compiled step of the session's lane, the session's generator state loaded into
        the lane's (``Lane.generator``: lanes after the first draw from states of their own, so
        their drawing chunks overlap on the device)."""
        if session.rng is None:
            return session.lane.compiled(*args, **kwargs)
        gen = self._generator
        # one default generator for the process: one such chunk queued at a time (_DRAWS), and
        # none while a class compiles or a graph captures (GLOBAL_STATE, shared). The lane's
        # step lock first, then _DRAWS, then GLOBAL_STATE: a compile inside the call gives the
        # shared hold back while it waits, and no thread waits for _DRAWS holding it
        with session.lane.compiled.lock, _DRAWS, GLOBAL_STATE.shared(), \
                drawing_from(session.lane.generator):
            outside = gen.get_state()
            gen.set_state(session.rng)
            try:
                return session.lane.compiled(*args, **kwargs)
            finally:
                session.rng = gen.get_state()
                gen.set_state(outside)

    def _check_lane(self, lane: Lane) -> None:
        """The lane's carries still hold its resident session (nobody called its step outside)."""
        if lane.resident is not None and lane.compiled.counters.calls != lane.calls_seen:
            lost, lane.resident = lane.resident, None
            self._sessions[lost].state, self._sessions[lost].lost = None, True
            raise GuardError(
                f"the compiled step ran outside this pool after session {lost}'s last chunk, so "
                f"the carries no longer hold that session's state: pool.reset({lost}, state) "
                "restarts it. Serve every stream of a compiled step through one pool")

    def done(self, sid: int):
        """An event recorded after the session's queued chunks on its lane (None on the CPU,
        where ``step`` returns when the chunk is done)."""
        return self._get(sid).lane.done()

    def lane_of(self, sid: int) -> int:
        return self._get(sid).lane.index

    @property
    def compiles(self) -> int:
        """Classes met for the first time during traffic (compiled or left stock), all lanes:
        each one held its lane's chunk for the compile. ``lane.compile_log`` says which chunk."""
        return sum(len(lane.compile_log) for lane in self.lanes)

    def compiling(self, lane: int) -> bool:
        """Whether a priming class of lane ``lane`` compiles in a background thread: it holds
        the lane's step, so a chunk dispatched to that lane now would wait for it."""
        return bool(self.lanes[lane].compiled.background.pending)

    def capture_catalog(self, *args, **kwargs) -> list:
        """``capture_catalog`` on every lane (each on its stream), from one example call of the
        step (with its state); returns each lane's ``Preparation``."""
        out = []
        for lane in self.lanes:
            with lane.running():
                out.append(lane.compiled.capture_catalog(*args, **kwargs))
            lane.calls_seen = lane.compiled.counters.calls
        return out

    def memory(self) -> dict:
        """Bytes held per lane (carries, private buffers, graph pools) and per session (its
        snapshots and own state tensors outside the carries)."""
        per_lane = [lane.memory() for lane in self.lanes]
        per_session = {sid: self._session_bytes(s) for sid, s in self._sessions.items()}
        return {"lanes": per_lane, "sessions": per_session,
                "lane_bytes": [sum(m.values()) - m["graphs_allocated"] for m in per_lane],
                "session_bytes_mean": (sum(per_session.values()) / len(per_session)
                                       if per_session else 0)}

    def _session_bytes(self, session: _Session) -> int:
        snaps = sum(t.untyped_storage().nbytes() for t in session.snapshots.values())
        carries = [c for c in session.lane.compiled.carries.values()]
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in pytree.tree_leaves(session.state) if isinstance(t, torch.Tensor)
               and not any(c.holds(t) for c in carries)
               and not any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                           for s in session.snapshots.values())}
        return snaps + sum(own.values())

    @property
    def sessions(self) -> List[int]:
        return sorted(self._sessions)

    def state(self, sid: int):
        """The session's current state (region entries may be views of the shared carries)."""
        return self._get(sid).state

    def snapshot_bytes(self, sid: int) -> int:
        return sum(t.numel() * t.element_size() for t in self._get(sid).snapshots.values())

    # -- internals ---------------------------------------------------------------------------
    def _rng_start(self, state, seed):
        if not self.adapter.effects.device_rng:
            return None
        if getattr(self, "_generator", None) is None:
            weights = next(self.compiled.module.parameters(), None)   # a priming session has no state
            device = next((t.device for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)),
                          weights.device if weights is not None else torch.device("cpu"))
            self._generator = (torch.cuda.default_generators[device.index or 0]
                               if device.type == "cuda" else torch.default_generator)
        if seed is None:   # the generator's state now, never another session's swapped in
            with _DRAWS:
                return self._generator.get_state()
        # a generator of its own, seeded: the process's is never touched (nor waited for)
        own = torch.Generator(self._generator.device)
        own.manual_seed(seed)
        return own.get_state()

    def _get(self, sid: int) -> _Session:
        if sid not in self._sessions:
            raise KeyError(f"no session {sid!r} in this pool (open: {self.sessions}); "
                           "open one with pool.open(state)")
        return self._sessions[sid]

    def _own(self, state):
        """The session's copy of a starting state: region tensors are absorbed by copy (never
        written), every other tensor is cloned, so sessions never share a written tensor."""
        region_leaves = set()
        for r in self.adapter.regions:
            found = _locate({self.state_arg: state}, r.input)
            if found is not None:
                region_leaves.add(id(found[0][found[1]]))
        flat, spec = pytree.tree_flatten(state)
        own = [t if not isinstance(t, torch.Tensor) or id(t) in region_leaves else t.clone()
               for t in flat]
        return pytree.tree_unflatten(own, spec)

    def _save(self, session: _Session) -> None:
        """Copy the resident session's regions out of its lane's carries into its snapshots."""
        root = {self.state_arg: session.state}
        for r in self.adapter.regions:
            carry = session.lane.compiled.carries.get(r.name)
            found = _locate(root, r.input)
            if carry is None or found is None:
                continue
            container, key = found
            t = container[key]
            if not (isinstance(t, torch.Tensor) and carry.holds(t)):
                continue   # already the session's own tensor
            snap = session.snapshots.get(r.name)
            if snap is None:
                with torch.inference_mode(False):   # written under any later mode
                    snap = session.snapshots[r.name] = torch.empty_like(carry.tensor)
            frames = t.shape[r.dim]
            with torch.no_grad():
                snap.narrow(r.dim, 0, frames).copy_(t)
            view = snap.narrow(r.dim, 0, frames)
            if isinstance(container, tuple):
                raise ContractError(f"region {r.name!r} sits in a tuple, which the pool cannot "
                                    "write; keep the state in a dict or a list")
            container[key] = view
        session.state = root[self.state_arg]   # the state itself may be the region's tensor
        session.lane.swaps += 1


def warm_lanes(pools: Sequence[SessionPool], stream: Callable[[int], None], *,
               modes: Callable = torch.inference_mode) -> List[dict]:
    """Before traffic, run one throwaway conversation on every lane, so that every class a
    stream reaches is compiled there, not in the middle of a live chunk: ``capture_catalog``
    prepares the catalog's classes from one example, but classes whose inputs come from another
    step's output (Token2Wav's vocoder reads the flow's mel, in the layout the flow returns
    it), first chunks of a turn and partial flushes are only known exactly by running them.

    ``stream(lane)`` opens its sessions on lane ``lane`` of each pool (``open(..., lane=lane)``),
    sends its chunks through ``pool.step`` and closes them; it runs under ``modes()`` (the
    scheduler's), with priming classes compiled inline (not in background threads). Like
    ``prepare`` this is not traffic: the steps' counters are left as they were. Returns per
    lane: ``compiled`` (classes compiled now, all pools), ``stock`` (the reasons of calls that
    ran the stock step: classes that cannot be prepared), ``seconds``."""
    n = len(pools[0].lanes)
    if any(len(p.lanes) != n for p in pools):
        raise ValueError(f"pools with {[len(p.lanes) for p in pools]} lanes: a stream spanning "
                         "several pools runs on the same lane of each; give them one lane count")
    out = []
    for i in range(n):
        steps = [p.lanes[i].compiled for p in pools]
        kept = [copy.deepcopy(cs.counters) for cs in steps]
        met = [set(cs.classes) for cs in steps]
        logs = [len(p.lanes[i].compile_log) for p in pools]
        start = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack:
                for cs in steps:
                    stack.enter_context(cs.background.inline())
                stack.enter_context(modes())
                stream(i)
            if pools[0].lanes[i].stream is not None:
                torch.cuda.synchronize()
            stock = collections.Counter()
            for cs, k in zip(steps, kept):
                stock.update(cs.counters.reasons - k.reasons)
            out.append({"lane": i, "compiled": sum(len(set(cs.classes) - m) for cs, m in
                                                   zip(steps, met)),
                        "stock": dict(stock), "seconds": time.perf_counter() - start})
        finally:
            for p, cs, k, logged in zip(pools, steps, kept, logs):   # warming is not traffic
                for f in dataclasses.fields(k):
                    setattr(cs.counters, f.name, getattr(k, f.name))
                p.lanes[i].calls_seen = k.calls
                del p.lanes[i].compile_log[logged:]
    return out
