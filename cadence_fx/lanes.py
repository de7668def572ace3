"""Lanes: independent sets of carries and captured graphs of one compiled step, on one device.

A ``SessionPool`` time-multiplexes its sessions over one set of carries and graphs. A lane is one
more set: a ``CompiledStep`` over the same module and weights with carries, private buffers and a
backend of its own (on CUDA: its own capture stream, graph memory pool and, through that stream,
its own cuBLAS workspace), and a stream its calls run on. Every session lives on one lane for life;
chunks of different lanes replay concurrently on the device, the same kernels at the same shapes.

What lanes share: the module (weights are read only), the stock envelopes released by the first
lane (``release_envelopes``: one ``Envelopes`` lends them to every lane's compile and priming),
traces (a lane copies the first lane's traces instead of tracing again) and compiled classes:
each class a lane compiles once the pool exists is frozen as the compile cache stores it
(``stored_class``), and the other lanes thaw it (``counters.lane_loads``) instead of running the
passes and the probationary call again; only the capture is a lane's own. Every lane reads and
writes the first lane's compile cache (``cache_dir``): a class a lane compiles first is stored
for restarts, and a lane meeting a class no lane has in this process loads it from there (before
2026-12-03 lanes 1.. had no cache: a class only they met was never stored, and on a restart they
traced and compiled again every class lane 0 had loaded). On the H200 a lane of
the Token2Wav flow took 35-38 s to prepare from trace copies (f5290cd), 4.7-8.7 s thawed (f563547).

cuBLAS and bitwise results: cuBLAS gives bitwise-identical results for the same call on any
stream only when each stream has its own workspace and the workspace size is pinned
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``, ``cadence_fx.pin_deterministic_kernels``); torch keys its
workspaces by (handle, stream). A CUDA graph keeps the workspace of the stream it was captured on,
so two graphs captured on one stream and replayed concurrently would share one workspace: each
lane captures on its own stream, and replays its graphs on its own stream only.

Device randomness: a graph registers the generator state current at its capture and each replay
fills that state's seed and offset holder. Lanes 1.. of a step that draws device randomness
capture and run under a generator state of their own (``Lane.generator``), so their drawing
chunks overlap on the device instead of taking turns on one holder.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

__all__ = ["Lane", "make_lanes"]


class Lane:
    """One lane: its compiled step, its stream (None on the CPU) and the session in its carries."""

    def __init__(self, index: int, compiled, stream: Optional["torch.cuda.Stream"]):
        self.index = index
        self.compiled = compiled
        self.stream = stream
        self.resident: Optional[int] = None   # the session whose regions are in the carries
        self.calls_seen = compiled.counters.calls
        self.swaps = 0
        self.sessions = 0
        # classes this lane met for the first time in traffic: (session, its chunk, classes,
        # seconds the call took, compile included)
        self.compile_log: List[tuple] = []

    @property
    def generator(self) -> Optional[torch.Generator]:
        """The device generator state its graphs register and its calls draw from (lanes 1.. of
        a step drawing device randomness on CUDA; None: the default generator's own state)."""
        return self.compiled.generator

    def classes_met(self) -> int:
        """Classes the lane's step has seen: compiled, left stock, or compiling in the background."""
        cs = self.compiled
        return cs.store.met() + len(cs.background.pending)

    def note_compiles(self, sid: int, chunk: int, before: int, seconds: float) -> None:
        """Log the classes a call of session ``sid`` met first (``before``: ``classes_met()``
        when it started)."""
        new = self.classes_met() - before
        if new > 0:
            self.compile_log.append((sid, chunk, new, seconds))

    @contextlib.contextmanager
    def running(self):
        """Run a chunk on the lane's stream, after the work the caller's stream has queued (its
        inputs); the caller's stream does not wait for the lane (other lanes would then wait too):
        read results after ``done()``."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def done(self) -> Optional["torch.cuda.Event"]:
        """An event recorded after the lane's queued work (None on the CPU): poll ``query()``."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def memory(self) -> dict:
        """Bytes the lane holds: carries, private buffer copies, device graphs' pool."""
        cs = self.compiled
        backend = cs.backend
        return {"carries": sum(_nbytes(c.tensor) for c in cs.carries.values()),
                "private_buffers": sum(_nbytes(t) for t in cs.tensors.private.values()),
                "graphs_allocated": getattr(backend, "graph_allocated_bytes", 0),
                "graphs_reserved": getattr(backend, "graph_reserved_bytes", 0)}


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def make_lanes(compiled, n: int, backend_for_lane: Optional[Callable[[int], object]] = None
               ) -> List[Lane]:
    """``n`` lanes over ``compiled``: lane 0 is ``compiled`` itself, lanes 1.. are new compiled
    steps of the same step and module. ``backend_for_lane(i)`` gives lane ``i``'s backend
    (default: chosen at each lane's first class, so every lane has its own)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"lanes={n!r}: give a positive number of lanes (1 serves every session "
                         "from one set of carries and graphs)")
    if n > 1 and compiled.config.donate_state:
        raise ValueError("lanes > 1 with donate_state=True: a donated state becomes one lane's "
                         "carry; compile without donate_state")
    on_cuda = any(p.is_cuda for p in compiled.module.parameters())
    if backend_for_lane is not None and compiled.backend is None:
        compiled.backend = backend_for_lane(0)
    if on_cuda:   # a stream of its own per lane: never one another lane or capture holds
        from .capture_streams import private_stream
    lanes = [Lane(0, compiled, private_stream() if on_cuda else None)]
    draws = on_cuda and compiled.adapter.effects.device_rng
    for i in range(1, n):
        step = _lane_step(compiled, backend_for_lane(i) if backend_for_lane else None)
        if draws:
            _own_generator(step, next(compiled.module.parameters()).device)
        lanes.append(Lane(i, step, private_stream() if on_cuda else None))
    return lanes


def _own_generator(step, device: torch.device) -> None:
    """Give a lane's step a device generator state of its own (a clone of the default one's).
    Every graph registers the generator state current at its capture, and a replay fills that
    state's seed and offset holder on its stream: graphs of several lanes registered with one
    state would race on its holder, so lanes drawing from one state took turns on the device.
    With a state of its own a lane's drawing chunks overlap the others'. (The session's own
    draws are unchanged: the pool loads the session's generator state into the lane's state
    before each chunk, ``SessionPool._call``.)"""
    step.generator = torch.cuda.default_generators[device.index or 0].clone_state()
    if step.backend is not None and hasattr(step.backend, "generator"):
        step.backend.generator = step.generator   # a backend given by backend_for_lane


def _lane_step(compiled, backend):
    """A compiled step like ``compiled``: same module, adapter and options; its own carries,
    private buffers and backend; the first lane's envelopes, traces, compiled classes and
    compile cache."""
    import dataclasses
    from .runtime import CompiledStep
    config = dataclasses.replace(compiled.config, keep_before=False, cache_dir=None,
                                 donate_state=False)
    lane = CompiledStep(compiled.step, compiled.adapter, compiled.module, config, backend=backend,
                        trace_cache=compiled.store.share_traces(), envelopes=compiled.envelopes,
                        class_cache=compiled.store.share_classes())
    lane.kernel_store = compiled.kernel_store
    # the first lane's compile cache: a class a lane compiles first is stored for restarts too,
    # and a class the pool has not met yet loads from it on any lane
    lane.compile_cache = compiled.compile_cache
    return lane
