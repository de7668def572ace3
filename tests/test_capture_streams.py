"""Capture streams (``cadence_fx/capture_streams.py``): a graph captured on a stream is destroyed
only with every other graph captured there, and the stream is not handed out again while any of
them lives. torch drops a stream's cuBLAS workspace whenever one of its graphs is destroyed,
under the graphs still replaying with it (pytorch/pytorch#193402). The lifetimes are checked on
the CPU with stand-ins for torch's streams and graphs; the workspace itself on CUDA."""
import contextlib
import gc
import itertools
import types
import weakref

import pytest
import torch

from cadence_fx import capture_streams
from cadence_fx.capture_streams import CaptureStream, private_stream


class _Stream:
    """torch's pooled streams: 32 handles handed out round-robin."""
    _next = itertools.count()

    def __init__(self):
        self.cuda_stream = 0x1000 + next(self._next) % 32
        self.device = torch.device("cuda", 0)


class _Graph:
    def capture_begin(self, **kwargs):
        self.begun = True

    def capture_end(self):
        self.ended = True


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(capture_streams, "_HELD", set())
    monkeypatch.setattr(capture_streams, "_HeldStream",
                        type("_HeldStandIn", (capture_streams._GivesBack, _Stream), {}))


def test_a_graph_given_up_lives_until_every_graph_of_its_stream_goes(stand_ins):
    side = CaptureStream()
    kept, given = side.graph(), side.graph()
    refs = [weakref.ref(kept), weakref.ref(given)]
    side.give_up(given)
    del given
    gc.collect()
    assert refs[1]() is not None, "a given-up graph was destroyed while another graph replays"
    assert (len(side), side.given_up) == (2, 1)
    del kept, side
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_stream_stays_held_while_a_replayer_keeps_its_graphs(stand_ins):
    """A step dropped while one of its replayers is still referenced: the stream is not handed
    to a new lane, whose graphs would share its workspace until the old graph is destroyed."""
    side = CaptureStream()
    graph = side.graph()
    replay = types.SimpleNamespace(graph=graph, capture_stream=side)   # what lower() returns
    handle = side.stream.cuda_stream
    del side, graph
    gc.collect()
    assert all(private_stream().cuda_stream != handle for _ in range(31)), \
        "a stream whose graph is still alive was handed out again"
    ref = weakref.ref(replay.graph)
    del replay
    gc.collect()
    assert ref() is None and handle not in capture_streams._HELD
    assert private_stream().cuda_stream == handle   # free again: the round-robin comes back to it


def test_a_held_stream_is_never_weakly_referenced_and_gives_its_handle_back(stand_ins):
    """torch 2.10-2.12 free a ``torch.cuda.Stream`` without clearing the weak references to it
    (pytorch/pytorch#183403): a weak reference to a held stream (a WeakValueDictionary of them)
    dangles, and the collector that walks it later crashes. The held set keeps handles only."""
    stream = private_stream()
    handle = stream.cuda_stream
    assert weakref.getweakrefcount(stream) == 0, "a weak reference to a held stream"
    assert handle in capture_streams._HELD
    del stream
    assert handle not in capture_streams._HELD, "a freed stream still counts as held"
    others = [private_stream() for _ in range(31)]   # the other 31 handles, then this one again
    assert private_stream().cuda_stream == handle and len(others) == 31


def test_only_a_graph_of_the_stream_can_be_given_up(stand_ins):
    one, other = CaptureStream(), CaptureStream()
    assert one.stream.cuda_stream != other.stream.cuda_stream
    with pytest.raises(AssertionError, match="another capture stream"):
        one.give_up(other.graph())


def test_every_pooled_stream_held_is_an_error_that_says_what_to_do(stand_ins):
    held = [private_stream() for _ in range(32)]
    with pytest.raises(RuntimeError, match=r"step\.close\(\), and drop them"):
        private_stream()
    assert len({s.cuda_stream for s in held}) == 32


def test_a_failed_capture_ends_its_pools_allocation_and_keeps_both_its_graphs(stand_ins,
                                                                              monkeypatch):
    """The failure path of ``CudaGraphBackend._capture`` with torch's capture stood in for: the
    pool's allocation is ended (torch 2.11 leaves it recording when the capture's end fails), and
    the failed graph and the empty capture after it both stay on the capture stream."""
    from cadence_fx import cudagraphs
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                        lambda device, pool: ended.append((device, pool)), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    class Invalidated:   # torch.cuda.graph whose capture the piece invalidates
        def __init__(self, graph, **kwargs):
            self.kwargs = kwargs

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", Invalidated)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 8))
    monkeypatch.setattr(cudagraphs, "_FAILED_CAPTURES", [])
    current = ["caller's"]   # torch.cuda.graph leaves the capture stream current: put it back
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    backend = cudagraphs.CudaGraphBackend()
    backend.pool = (0, 7)

    def piece(*args):
        current[0] = "capture stream"
        return args

    with pytest.raises(RuntimeError, match="not permitted"):
        backend._capture(types.SimpleNamespace(module=piece), [])
    assert ended == [(0, (0, 7))]
    assert current == ["caller's"], "the capture stream stayed current after the failed capture"
    side = backend._side
    assert (len(side), side.given_up, backend.graphs_given_up) == (2, 2, 2)
    failed, empty = side._graphs
    assert not hasattr(failed, "begun") and empty.begun and empty.ended   # out of capture mode
    # torch's pinned-memory allocator still routes to (0, 7) through a filter that reads the
    # failed graph: the next capture takes a new pool, and the graph lives on
    assert backend.pool == (0, 8) and cudagraphs._FAILED_CAPTURES == [failed]


def test_ending_an_allocation_that_already_ended_keeps_the_pool(monkeypatch):
    """A capture whose own end ran ended its pool's allocation on the device and the host: the
    pool stays, and no graph is kept for the host allocator."""
    from cadence_fx import cudagraphs

    def not_recording(device, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", not_recording, raising=False)
    monkeypatch.setattr(cudagraphs, "_FAILED_CAPTURES", [])
    assert cudagraphs._end_allocation(torch.device("cuda", 0), (0, 7), _Graph()) == (0, 7)
    assert cudagraphs._FAILED_CAPTURES == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_capture_keeps_the_workspace_the_graphs_before_it_replay_with():
    """A GEMM captured, then a piece whose captures fail (a host sync): each failure leaves an
    empty capture on the side stream (``_out_of_capture``) and a given-up graph. Destroying either
    would free the stream's cuBLAS workspace, which the GEMM's graph writes its scratch into."""
    from cadence_fx.cudagraphs import CudaGraphBackend

    def piece(fn, fixed):
        fn.written_attributes = ()   # no module state (what ``lower`` asks a piece)
        return types.SimpleNamespace(module=fn, piece_name="p", fixed=fixed, mutated=[False] * 2,
                                     escaping=[True], staging_bytes=0)

    torch.manual_seed(0)
    x, w = torch.randn(512, 1024, device="cuda"), torch.randn(1024, 768, device="cuda")
    backend = CudaGraphBackend()
    with backend.side_stream():   # as a class's probationary stock call: cuBLAS set up, and the
        x @ w                     # side stream's workspace made, before anything is captured
    replay, reason = backend.lower(piece(lambda x, w: (x @ w,), [False, True]), (x, w))
    assert reason is None and backend.captured == 1
    gc.collect()   # earlier tests' garbage in this process is not what is measured
    before = torch.cuda.memory_allocated()
    syncs = piece(lambda x, w: ((x @ w) * (x @ w).sum().item(),), [False, True])
    replay2, reason = backend.lower(syncs, (x, w))
    assert replay2 is None and reason.startswith("capture failed")
    assert "already recording" not in reason, "the failed capture left the pool recording"
    assert backend.graphs_given_up == 4   # two captures tried, each with its empty capture
    gc.collect()
    torch.cuda.synchronize()
    # a freed workspace is megabytes (cuBLAS's is 32 MiB on Hopper): a few kilobytes less are
    # the failed captures' own garbage
    assert torch.cuda.memory_allocated() > before - (1 << 20), "the workspace was freed"
    torch.cuda.empty_cache()   # a freed workspace would now be unmapped, or taken by this:
    junk = [torch.full((1 << 23,), float("nan"), device="cuda") for _ in range(8)]
    assert torch.equal(replay([x, w])[0], x @ w)
    del junk
    replay3, reason = backend.lower(piece(lambda x, w: (x @ w * 3,), [False, True]), (x, w))
    assert reason is None and backend.captured == 2, "a capture after the failed ones"
    assert torch.equal(replay3([x, w])[0], x @ w * 3) and torch.equal(replay([x, w])[0], x @ w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_held_cuda_streams_freed_and_collected_give_their_handles_back():
    """torch's own streams, taken and freed over and over with collections in between (what lanes
    and steps do over a server's life): none is weakly referenced, and each handle comes back."""
    for _ in range(20):
        held = [private_stream() for _ in range(8)]
        handles = {s.cuda_stream for s in held}
        assert len(handles) == 8 and handles <= capture_streams._HELD
        assert not any(weakref.getweakrefcount(s) for s in held), "a weakly referenced stream"
        del held
        gc.collect()
        assert not handles & capture_streams._HELD, "a freed stream still counts as held"
