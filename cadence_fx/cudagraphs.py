"""ExactShapeReplay (paper §3.4): one CUDA graph per capturable piece, at its exact signature.

States of a piece: not lowered -> capture (warm-up first if needed) -> replaying, or eager with a
reason.

* Capture records the piece into a pool shared by all classes of one compiled step. A piece is
  lowered only after the probationary stock call of its class (§3.4 (iii)) ran the same kernels
  at the same shapes on the device -- and rejected host randomness for the whole class -- so it
  is captured straight away, without running it first.
* Fused regions (``fusion.py``) still pending are verified first, on one eager run made like
  the warm-up's (side stream, everything it writes put back): verification syncs with the host.
* Warm-up, when that capture fails for any reason but out-of-memory (a library setting itself up
  lazily, which it may not do under capture), or before every capture with ``warm_up=True``:
  the piece runs once eagerly on a side stream with every generator watched (host randomness
  rejects it for good; device randomness is admitted), then the generators and every input it
  writes are put back, so the warm-up is invisible; then it is captured again, once.
* Aliasing: inputs marked fixed-address (carries, parameters, buffers, and views of them) are read
  in place; every other tensor input is copied into a static staging buffer before each replay,
  and copied back after it when the piece writes that input in place.
* Output lifetime: results that leave the step are cloned after replay unless they are views of a
  fixed-address input (the carry), so a caller may hold a chunk's output while the next runs.
  ``copy_outputs=False`` skips that (results are then overwritten by the next replay).
* Failures (a host sync, an out-of-memory, an op not allowed under capture) leave the piece eager
  with the reason; nothing the piece owns has been written when that happens.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
import weakref
from typing import Callable, List, Optional, Tuple

import torch

from .capture_streams import CaptureStream, private_stream
from .effects import RngSnapshot, TensorSnapshot, drawing_from
from .fusion import pending_regions
from .passes.fx_utils import mutated_attributes

__all__ = ["CudaGraphBackend", "private_stream"]

log = logging.getLogger(__name__)


class CudaGraphBackend:
    name = "cudagraphs"

    def __init__(self, copy_outputs: bool = True, warm_up: bool = False,
                 generator: Optional[torch.Generator] = None):
        self.copy_outputs = copy_outputs
        self.warm_up = warm_up       # warm every piece up before its first capture attempt
        self.generator = generator   # the device generator state its graphs draw from (a lane's)
        self.pool = None
        # one side stream for every eager warm-up and every capture: the BLAS libraries keep a
        # workspace per stream they run on (32 MiB each for cuBLAS on Hopper) for the life of
        # the process
        self._side: Optional[CaptureStream] = None   # its graphs live and die together
        self._graphs = weakref.WeakSet()   # the graphs captured into ``pool`` still alive
        self.captured = 0
        self.capture_seconds = 0.0   # staging, capture and any warm-up of every piece
        self.warmup_seconds = 0.0    # of which the eager warm-up runs
        self.warmups = 0
        self.verifications = 0       # eager runs that verified fused regions before a capture
        self.staging_bytes = 0
        self.graph_allocated_bytes = 0   # held by captured graphs: static outputs, staging
        self.graph_reserved_bytes = 0    # reserved by the shared pool, intermediates included

    def lower(self, piece, args) -> Tuple[Optional[Callable], Optional[str]]:
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return None, "no CUDA tensor among the piece's inputs"
        # alone from here: it synchronizes the device and empties the cache, which fail while
        # another thread captures ("operation not permitted when stream is capturing", a lane
        # thread lowering a piece while another lane's thread captured, on the H200)
        with GLOBAL_STATE.exclusive():
            return self._lower(piece, args)

    def _lower(self, piece, args) -> Tuple[Optional[Callable], Optional[str]]:
        if not self._graphs:
            # No graph of this backend lives in the pool: start a new one. A pool whose graphs
            # were all released is being freed by the allocator, and its handle would trip the
            # allocator's internal assert. Graphs given up stay with their capture stream
            # (capture_streams.py), so this holds until the first capture that succeeds, and
            # again only after the capture stream itself was replaced (another device).
            self.pool = torch.cuda.graph_pool_handle()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        if self.warm_up or pending_regions(piece.module):
            # fused regions are verified (host syncs) on an eager run like the warm-up's, before
            # the capture; counted as a warm-up only when it is one
            reason = self._warm_up(piece, args, verify=not self.warm_up)
            if reason:
                return None, reason
        static = self._staged_inputs(piece, args)
        # torch.cuda.graph empties the allocator's cache as it starts capturing: do it first, so
        # the reserved bytes below count the pool's growth, not blocks freed by that. (No
        # gc.collect: torch's own capture dropped it as too expensive for captures in a row; after
        # a cold compile's graphs and fake tensors, the Token2Wav catalog's captures took 8.4 s
        # with it on the H200 host, 1.4 s without.)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        captured = self._capture_or_retry(piece, args, static)
        if isinstance(captured, str):
            return None, captured
        graph, outs = captured
        end.record()
        torch.cuda.synchronize()
        self.capture_seconds += start.elapsed_time(end) / 1e3
        self.graph_allocated_bytes += torch.cuda.memory_allocated() - allocated
        self.graph_reserved_bytes += torch.cuda.memory_reserved() - reserved
        self.captured += 1
        self._graphs.add(graph)
        self.staging_bytes += piece.staging_bytes
        replay = self._replayer(piece, args, static, graph, outs)
        replay.capture_stream = self._side   # holds the stream and its graphs (capture_streams.py)
        return replay, None

    @staticmethod
    def _staged_inputs(piece, args) -> List:
        """The capture's inputs: a static copy of each tensor input that is not fixed-address
        storage (``piece.staging_bytes`` counts them), the others as they are."""
        piece.staging_bytes = 0
        static = []
        for a, fixed in zip(args, piece.fixed):
            if isinstance(a, torch.Tensor) and not fixed:
                s = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                s.copy_(a)
                static.append(s)
                piece.staging_bytes += s.untyped_storage().nbytes()
            else:
                static.append(a)
        return static

    def _capture_or_retry(self, piece, args, static):
        """``(graph, outputs)``, or why the piece stays eager: a capture that fails is warmed up
        and tried once more (unless every capture is warmed up already)."""
        try:
            return self._capture(piece, static)
        except torch.OutOfMemoryError as e:
            return _capture_failed(e)
        except Exception as e:  # noqa: BLE001 - warm up, then capture once more
            if self.warm_up:
                return _capture_failed(e)
            log.info("%s: %s; warming up and capturing again", piece.piece_name, _capture_failed(e))
        reason = self._warm_up(piece, args)
        if reason:
            return reason
        try:
            return self._capture(piece, static)
        except Exception as e:  # noqa: BLE001 - the piece stays eager, with the reason
            return _capture_failed(e)

    def _replayer(self, piece, args, static, graph, outs) -> Callable:
        fixed_storages = {a.untyped_storage().data_ptr() for a, f in zip(args, piece.fixed)
                          if f and isinstance(a, torch.Tensor)}
        clone = [self.copy_outputs and esc and isinstance(o, torch.Tensor)
                 and o.untyped_storage().data_ptr() not in fixed_storages
                 for o, esc in zip(outs, piece.escaping)]
        staged = [i for i, (a, f) in enumerate(zip(args, piece.fixed))
                  if isinstance(a, torch.Tensor) and not f]
        # a staged input the piece writes in place: the write lands in the staging buffer, so it
        # is copied back to the caller's tensor after every replay
        write_back = [i for i in staged if piece.mutated[i]]
        log.debug("%s captured: %d staged inputs (%d bytes)", piece.piece_name, len(staged),
                  piece.staging_bytes)

        def replay(call_args) -> List:
            for i in staged:
                static[i].copy_(call_args[i])
            graph.replay()
            for i in write_back:
                call_args[i].copy_(static[i])
            return tuple(o.clone() if c else o for o, c in zip(outs, clone))

        replay.graph = graph
        return replay

    def _stream(self) -> torch.cuda.Stream:
        """The side stream warm-ups and captures run on (made again if the current device
        changed since: a step runs on one device)."""
        if self._side is None or self._side.device.index != torch.cuda.current_device():
            self._side = CaptureStream()
        return self._side.stream

    @property
    def graphs_given_up(self) -> int:
        """Graphs given up on the current capture stream, kept until its graphs all go."""
        return self._side.given_up if self._side is not None else 0

    @contextlib.contextmanager
    def side_stream(self):
        """Eager work of the compile (the probationary call, warm-ups) on the side stream the
        captures use, ordered after and before the current stream's work: the BLAS libraries'
        workspaces are made for one stream only."""
        side, current = self._stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            current.wait_stream(side)

    def _capture(self, piece, static):
        """Record the piece into the shared pool; nothing runs, so nothing is written.

        ``thread_local``: the capture forbids unsafe CUDA calls (an allocation, a sync) in the
        capturing thread only. Under the default ``global`` mode a priming class captured in a
        background thread would make the serving thread's own calls fail while it captures
        (``cudaEventQuery`` of the scheduler's poll, an allocation of another lane's chunk), and
        a capture in the serving thread would fail a background compile's. Other threads never
        work on this stream, so nothing of theirs can enter the graph (Inductor's CUDA graph
        trees capture the same way)."""
        stream = self._stream()
        graph = self._side.graph()
        with GLOBAL_STATE.exclusive(), drawing_from(self.generator):
            rng, current = RngSnapshot(), torch.cuda.current_stream()
            try:
                with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool, stream=stream,
                                                       capture_error_mode="thread_local"):
                    outs = piece.module(*static)
            except BaseException:
                # torch.cuda.graph leaves the capture stream current when its end fails
                torch.cuda.set_stream(current)
                self._side.give_up(graph)
                self.pool = _end_allocation(self._side.device, self.pool, graph)
                _out_of_capture(self._side)
                torch.cuda.synchronize()
                rng.restore()   # a capture cut short leaves the generators as they were
                raise
        return graph, outs

    def _warm_up(self, piece, args, verify: bool = False) -> Optional[str]:
        """Run the piece once eagerly on a side stream with every generator watched, then put
        back the generators and everything it writes. Returns why it may not be captured.
        ``verify``: the run is for the piece's fused regions (counted in ``verifications``)."""
        with GLOBAL_STATE.exclusive():   # it puts the generators back: no other draw meanwhile
            return self._warm_up_alone(piece, args, verify)

    def _warm_up_alone(self, piece, args, verify: bool) -> Optional[str]:
        written = [a for a, w in zip(args, piece.mutated) if w and isinstance(a, torch.Tensor)]
        written += mutated_attributes(piece.module)  # module state the warm-up must not advance
        state, rng = TensorSnapshot(written), RngSnapshot()
        start = time.perf_counter()
        if verify:
            self.verifications += 1
        else:
            self.warmups += 1
        try:
            with self.side_stream(), torch.no_grad():
                piece.module(*args)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the piece stays eager, with the reason
            return f"warm-up failed: {type(e).__name__}: {e}"
        finally:
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()   # nothing of the warm-up still runs when it is put back
            effects = rng.effects()
            state.restore()
            rng.restore()
            self.warmup_seconds += time.perf_counter() - start
        return effects.host_reason


class SharedExclusive:
    """A lock held shared by many threads or exclusively by one, reentrant in both modes. A thread
    that holds it shared and asks for it exclusively gives its shared holds back while it waits
    and takes them again after (it has run nothing yet that needs them: a class compiles before
    it runs). Exclusive waiters go first, so a steady stream of shared holders cannot starve a
    compile."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._shared: dict = {}       # thread id -> shared holds
        self._owner: Optional[int] = None
        self._depth = 0               # the owner's exclusive holds
        self._waiting = 0             # threads waiting to hold it exclusively

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:     # an exclusive owner runs its own shared work inside
                while (self._owner is not None or self._waiting) and me not in self._shared:
                    self._cond.wait()
            self._shared[me] = self._shared.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared[me] -= 1
                if not self._shared[me]:
                    del self._shared[me]
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        me = threading.get_ident()
        with self._cond:
            held = 0
            if self._owner != me:
                held = self._shared.pop(me, 0)   # given back while this thread waits
                self._waiting += 1
                try:
                    while self._owner is not None or self._shared:
                        self._cond.wait()
                except BaseException:   # interrupted while waiting: as it was
                    if held:
                        self._shared[me] = held
                    raise
                finally:
                    self._waiting -= 1
                    self._cond.notify_all()
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    if held:
                        self._shared[me] = held
                    self._cond.notify_all()


# What torch and the module keep for the process, not the thread. Held alone by whatever changes
# it or runs the module itself: a class compile (and ``prepare`` around it), a capture and its
# warm-up, a call that runs the stock step (the stock step writes the module's own buffers, which
# every lane shares), the serve engine's start states. Held shared by a pool's drawing chunk, so
# that none of those runs while it draws. Replays of captured graphs and eager pieces need
# neither: they read the tensors they were built with (each lane has its own).
# - A class compile traces with ``functional_call``, which swaps the module's parameters for fake
#   tensors while it traces: another thread running the module then computes on fakes (a serve
#   engine's start state, run while another lane compiled, failed in FakeTensorMode). Its
#   probationary stock call rewinds the generators it drew from, which would undo another
#   thread's draws.
# - A capture puts the device's default generator in capture mode (torch registers it with each
#   graph), one flag of the generator: two threads capturing at once would each end the other's,
#   and a draw from it in another thread fails ("Offset increment outside graph capture").
# A thread holding it shared that needs it alone gives its hold back while it waits (a class
# compiles before it runs). Code outside cadence_fx that runs the same module in another thread
# while cadence_fx serves it (a background priming compile, traffic on other lanes) must hold it:
# ``with GLOBAL_STATE.exclusive(): module(...)``, and open no pool session inside (an unseeded
# open waits for the pool's draws, which wait for this).
GLOBAL_STATE = SharedExclusive()


# graphs whose capture failed after torch's pinned-memory allocator began routing to their pool:
# it keeps a filter that reads the graph for the life of the process (``_end_allocation``)
_FAILED_CAPTURES: List[torch.cuda.CUDAGraph] = []


def _end_allocation(device: torch.device, pool, graph: torch.cuda.CUDAGraph):
    """Stop routing allocations to ``pool`` after ``graph``'s capture failed; returns the pool
    the next capture takes. A capture whose end fails (``cudaStreamEndCapture`` reports it
    invalidated, as after a host sync inside it) raises before torch ends the pool's allocation
    (``CUDAGraph::capture_end``), on the device and on the pinned host memory (the host
    allocator routes to graph pools too, since torch 2.11): every later capture into that pool
    then fails ("beginAllocateToPool: already recording to mempool_id", seen on the H200). The
    device's allocation is ended here, but on the H200 (torch 2.11) that alone left the pool
    refusing captures; the host allocator's (found in torch's source) has no binding to end it.
    So the next captures take a new pool, and ``graph`` stays alive for good: the host
    allocator's routing filter reads it at every pinned allocation. (Where the capture ended its
    allocation itself, torch says the pool is not recording: the pool is kept.)"""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except RuntimeError:
        return pool   # the capture's end ran: nothing of it still routes to the pool
    _FAILED_CAPTURES.append(graph)
    return torch.cuda.graph_pool_handle()


def _out_of_capture(side: CaptureStream) -> None:
    """Take the default generator out of capture mode after a capture that failed. A capture
    whose end fails (``cudaStreamEndCapture`` reports it invalidated by an op not allowed in it)
    raises before torch takes the generators registered with it out of capture mode, and nothing
    else ever does: every later draw outside a capture, eager or a replay, then fails with
    "Offset increment outside graph capture encountered unexpectedly". (A restarted Token2Wav
    replica met it: HiFT's first piece, loaded compiled, failed its first capture, then its
    warm-up and every stock call after it failed too.) An empty capture begun and ended on the
    same stream takes the generator in and out of capture mode, on the same generator state the
    graphs captured so far replay with. The empty graph stays with the others on that stream:
    destroying it would drop the cuBLAS workspace they replay with (capture_streams.py)."""
    graph = side.graph()
    side.give_up(graph)
    with warnings.catch_warnings(), torch.cuda.stream(side.stream):
        warnings.simplefilter("ignore")   # torch warns that the graph is empty
        graph.capture_begin(capture_error_mode="thread_local")
        graph.capture_end()


def _capture_failed(e: BaseException) -> str:
    return f"capture failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
