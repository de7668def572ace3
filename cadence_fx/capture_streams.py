"""Streams that CUDA graphs are captured on, and how long they and their graphs live.

A CUDA graph bakes in the address of the cuBLAS workspace of the stream it was captured on: torch
keeps one workspace per (handle, stream) and hands it to every GEMM on that stream, captured or
not. When torch destroys or resets a graph, it also drops the workspaces of that graph's capture
stream (``CUDAGraph::reset`` calls ``clearCublasWorkspacesForStream``, since torch 2.11), although
every other graph captured on the stream still writes its GEMM scratch there
(pytorch/pytorch#193402). The block goes back to the allocator; the next capture empties the cache
and unmaps it, or another tensor takes it. The live graphs then fault or write into that tensor.
cadence_fx met it in two ways: the empty capture that follows every failed capture
(``cudagraphs._out_of_capture``) was destroyed on the step's capture stream, and a stream could
be handed to a new lane while an old step's graphs still waited for the collector. (Found in
torch's source; no failure on the H200 has been traced to it yet.)

So, here:

* every graph captured on a stream belongs to its ``CaptureStream`` and is destroyed only together
  with all the others. A graph that is given up (a failed or retried capture, the empty capture
  that takes the generators out of capture mode, a class captured again after its inputs moved)
  stays until every user of the stream lets go;
* the stream stays held (``private_stream`` does not hand it out again) while any of its graphs
  lives: each replayer keeps its ``CaptureStream``, so a step dropped while some of its graphs are
  still referenced cannot pass its workspace on to a new lane.

The price is memory: a given-up graph keeps its executable graph (not its outputs) until its step
is closed or dropped. ``CaptureStream.given_up`` counts them.

Which streams are held is a set of handles that a held stream takes itself out of when it is
freed (``_HeldStream.__del__``), never a weak reference to the stream: in torch 2.10 to 2.12 a
freed ``torch.cuda.Stream`` does not clear the weak references to it (its ``tp_dealloc`` skips
``PyObject_ClearWeakRefs``, pytorch/pytorch#183403), and a collection that later walks them
crashes the process.
"""
from __future__ import annotations

import gc
from typing import List, Set

import torch

__all__ = ["CaptureStream", "private_stream"]

# the handles of the streams held by live lanes and capture streams (``private_stream``)
_HELD: Set[int] = set()


class _GivesBack:
    """A held stream gives its handle back when it is freed."""
    _handle = None

    def __del__(self):
        if _HELD is not None:   # None while the interpreter shuts down
            _HELD.discard(self._handle)


class _HeldStream(_GivesBack, torch.cuda.Stream):
    """A pooled stream of the current device, held while this object lives."""


def private_stream() -> torch.cuda.Stream:
    """A stream of the current device that no live lane or capture holds. ``torch.cuda.Stream()``
    hands out 32 pooled streams round-robin, so the 33rd comes back as the 1st: two lanes' capture
    streams would then be one, their graphs one cuBLAS workspace (replayed concurrently, a race),
    and destroying either's graphs would free the workspace the other's still use."""
    for attempt in range(2):
        for _ in range(32):
            stream = _HeldStream()
            if stream.cuda_stream not in _HELD:
                stream._handle = stream.cuda_stream
                _HELD.add(stream._handle)
                return stream
        gc.collect()   # steps, pools and lanes no longer referenced give theirs back
    raise RuntimeError(
        "every pooled CUDA stream of this device is held by a live lane or capture stream (torch "
        "pools 32 per priority): close compiled steps and session pools that are no longer used "
        "(step.close(), and drop them), or serve with fewer lanes")


class CaptureStream:
    """A private stream and every graph made for capture on it, destroyed together."""

    def __init__(self):
        self._graphs: List[torch.cuda.CUDAGraph] = []   # first: destroyed before the stream
        self.stream = private_stream()
        self.device = self.stream.device
        self.given_up = 0

    def graph(self) -> torch.cuda.CUDAGraph:
        """A new graph to capture on this stream; it lives as long as this object."""
        graph = torch.cuda.CUDAGraph()
        self._graphs.append(graph)
        return graph

    def give_up(self, graph: torch.cuda.CUDAGraph) -> None:
        """Count ``graph`` as given up (it stays, with the others, until they all go)."""
        assert any(g is graph for g in self._graphs), "a graph of another capture stream"
        self.given_up += 1

    def __len__(self) -> int:
        return len(self._graphs)

    def __repr__(self):
        return (f"CaptureStream({self.stream.cuda_stream:#x}, graphs={len(self._graphs)}, "
                f"given_up={self.given_up})")
