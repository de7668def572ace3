"""The peers of cadence_fx on the CFM loop (``bench/suite.py``): the vendor's CUDA-graph branch
and ``torch.compile``.

* V: the vendor's branch as shipped (``CausalConditionalCFM.scatter_cuda_graph``: buckets
  30/48/96). B: the same branch re-bucketed to the live widths 50/56, padded to 500 cached
  frames as the vendor pads. Their replays and fallbacks count estimator calls (10 per chunk).
* T: ``torch.compile`` of the step (``--t-mode``, reduce-overhead by default), or of the
  estimator's ``forward_chunk`` when the step does not compile (``--t-target estimator`` goes
  there directly). TM, the same in max-autotune, runs T in a subprocess (``suite_cfm``).

Each runs ``Baseline.measure`` (``suite_measure``) over the same stream as the cadence
configurations and restores the stock module afterwards, so the next configuration of the
process starts from the stock step.
"""
from __future__ import annotations

import logging
import time

import torch

from suite_measure import cleanup

__all__ = ["run_torch_compile", "run_vendor"]

log = logging.getLogger(__name__)


class _CountingGraph:
    """Stands in for a vendor ``torch.cuda.CUDAGraph`` to count its replays."""

    def __init__(self, graph, counter):
        self.graph, self.counter = graph, counter

    def replay(self):
        self.counter[0] += 1
        self.graph.replay()


def _capture_buckets(dit, sizes):
    """The vendor branch's capture (``DiT._init_cuda_graph_chunk``) at other bucket sizes:
    ``sizes`` maps a chunk width to the cached frames it pads to."""
    dtype, device = dit.cnn_cache_buffer.dtype, dit.cnn_cache_buffer.device
    blocks = len(dit.blocks)
    with torch.no_grad():
        for chunk, max_size in sizes.items():
            dit.max_size_chunk[chunk] = max_size
            x = torch.zeros(2, 320, chunk, dtype=dtype, device=device)
            t = torch.zeros(2, 1, 512, dtype=dtype, device=device)
            mask = torch.ones(2, chunk, max_size + chunk, dtype=torch.bool, device=device)
            cnn = torch.zeros(blocks, 2, 1024, 2, dtype=dtype, device=device)
            att = torch.zeros(blocks, 2, 8, max_size, 128, dtype=dtype, device=device)
            new_cnn = torch.zeros(blocks, 2, 1024, 2, dtype=dtype, device=device)
            new_att = torch.zeros(blocks, 2, 8, max_size + chunk, 128, dtype=dtype, device=device)
            dit.blocks_forward_chunk(x, t, mask, cnn, att, new_cnn, new_att)   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = dit.blocks_forward_chunk(x, t, mask, cnn, att, new_cnn, new_att)
            dit.inference_buffers_chunk[chunk] = {"static_inputs": [x, t, mask, cnn, att],
                                                  "static_outputs": [out, new_cnn, new_att]}
            dit.graph_chunk[chunk] = graph
    dit.use_cuda_graph = True


def run_vendor(base, rebucket):
    """V (``rebucket=False``) or B: the vendor's graphs captured (``capture_s``), then measured
    with every estimator call and every replay counted."""
    stream = base.stream
    dit = stream.step.cfm.estimator
    counter = [0]
    t0 = time.perf_counter()
    try:
        if rebucket:
            _capture_buckets(dit, {50: 500, 56: 500})
        else:
            stream.step.cfm.scatter_cuda_graph(True)   # the branch as shipped
        capture_s = time.perf_counter() - t0
        dit.graph_chunk = {k: _CountingGraph(g, counter) for k, g in dit.graph_chunk.items()}
        calls, forward_chunk = [0], dit.forward_chunk

        def counted(*a, **k):   # every estimator call (10 Euler steps per chunk)
            calls[0] += 1
            return forward_chunk(*a, **k)
        dit.forward_chunk = counted
        _, row = base.measure("B" if rebucket else "V", stream.step)
        row.update(replays=counter[0], fallbacks=calls[0] - counter[0], estimator_calls=calls[0],
                   capture_s=capture_s, buckets=sorted(dit.graph_chunk), status="ok",
                   note="replays and fallbacks count estimator calls (10 per chunk)")
        return row
    finally:
        dit.__dict__.pop("forward_chunk", None)
        dit.use_cuda_graph = False
        dit.graph_chunk, dit.inference_buffers_chunk, dit.max_size_chunk = {}, {}, {}
        cleanup()


def run_torch_compile(base, mode, target="step"):
    """T / TM: ``torch.compile`` of the step itself. When that does not compile or run (or with
    ``target="estimator"``), the same mode on what it can take, the estimator's
    ``forward_chunk`` (10 calls per chunk), recorded as such with the step's error."""
    import torch._dynamo
    dit = base.stream.step.cfm.estimator
    step_error = "not attempted in this run (--t-target estimator)"
    try:
        if target == "step":
            return _torch_compile_row(base, mode, target="CFMStep")
    except Exception as ex:  # noqa: BLE001 - recorded, then the estimator alone
        step_error = f"{type(ex).__name__}: {str(ex).splitlines()[0][:300]}"
        log.info("  torch.compile of the step failed (%s); the estimator alone", step_error)
    plain = dit.forward_chunk
    dit.forward_chunk = torch.compile(plain, mode=mode, dynamic=False)
    try:
        row = _torch_compile_row(base, mode, target="DiT.forward_chunk", compiled=base.stream.step)
        row["status"] = f"the step: {step_error}; on the estimator: {row['status']}"
        return row
    finally:
        dit.__dict__.pop("forward_chunk", None)
        torch._dynamo.reset()
        cleanup()


def _torch_compile_row(base, mode, target, compiled=None):
    """One pass compiles and runs (``compile_s``; it is also the warm-up pass), then the memory,
    timed and profiled passes; when not bit-exact, the largest mel difference from E."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    stream, ref = base.stream, base.ref
    torch._dynamo.reset()
    counters.clear()
    if compiled is None:
        compiled = torch.compile(stream.step, mode=mode, dynamic=False)
    try:
        t0 = time.perf_counter()
        stream.run(compiled)
        compile_s = time.perf_counter() - t0
        log.info("  compiled and ran one pass in %.1f s", compile_s)
        # T is profiled whatever --no-floor lists
        _, row = base.measure("T", compiled, warm=False, prof=True)
        row.update(target=target, mode=mode, compile_s=compile_s, replays=None, fallbacks=None,
                   graph_breaks=sum(counters["graph_break"].values()),
                   graph_break_reasons=list(counters["graph_break"])[:5],
                   unique_graphs=counters["stats"].get("unique_graphs"),
                   cudagraph_skips=dict(counters["inductor"]).get("cudagraph_skips"),
                   recompiles=dict(counters["recompiles"]),
                   status="ok" if row["bit_exact_blocks"] == row["blocks"] else
                   f"runs, not bit-exact ({row['bit_exact_blocks']}/{row['blocks']} blocks)")
        if row["bit_exact_blocks"] < row["blocks"]:
            diffs = []
            stream.run(compiled, check=lambda i, mel, state: diffs.append(
                float((ref[i][0].to(mel.device) - mel).abs().max())))
            row["max_abs_diff_mel"] = max(diffs)
        return row
    finally:
        del compiled
        torch._dynamo.reset()
        cleanup()
