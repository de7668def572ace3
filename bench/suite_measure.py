"""How the suite measures one configuration of the CFM loop: the stream, timing, memory, the
kernel floor and bit-exactness (``bench/suite.py``; docs/benchmarks.md has the method).

``measure`` runs the passes every configuration gets, in this order: a warm-up pass, a memory
pass, ``blocks`` timed passes compared chunk by chunk with E, and a profiled pass.

Memory (the memory pass): after the warm-up pass, ``cleanup()`` (``gc.collect``,
``torch.cuda.synchronize``, ``torch.cuda.empty_cache``), then
``torch.cuda.reset_peak_memory_stats``, one untimed, uncompared pass over the stream, a
synchronize, and then ``peak_bytes = torch.cuda.max_memory_allocated()`` and
``reserved_bytes = torch.cuda.memory_reserved()``. Resetting the peak sets it to what is
allocated at that moment, so ``peak_bytes`` is the whole process's high-water mark during the
pass: the model, the stream's inputs and prompt state, the configuration's own state and graphs,
and anything an earlier configuration of the same process left allocated. ``reserved_bytes`` is
read once, at the end of the pass; it is not a peak (``max_memory_reserved`` is not read). E's
reference chunks are held in pinned host memory, so they are not counted.
"""
from __future__ import annotations

import gc
import logging
import random
import statistics
import time
from dataclasses import dataclass

import torch

from cadence_fx.demo_streams import same_state  # mel/state equal; undeclared stock rows zero
from common import p95

__all__ = ["BLOCKS", "ROW_KEYS", "Baseline", "CFMStream", "cleanup", "compile_breakdown",
           "counters_row", "measure", "p95", "profile", "ratio_ci"]

log = logging.getLogger(__name__)

BLOCKS = 8   # timed passes over the whole stream per configuration (--blocks)
# the flat per-configuration view of a result (``result[letter]``); the full rows are under ``cfm``
ROW_KEYS = ("p50_ms", "p95_ms", "peak_bytes", "reserved_bytes", "bit_exact_blocks", "blocks",
            "replays", "fallbacks", "floor_ms", "kernel_ms", "kernels", "status")


def ratio_ci(times, ref, n=2000, seed=0):
    """Paired 95% bootstrap interval of mean(t_i / ref_i) over chunks."""
    r = [a / b for a, b in zip(times, ref)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choice(r) for _ in r) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n) - 1]], statistics.fmean(r)


def cleanup():
    """Free what is no longer referenced and hand the allocator's cached blocks back, so the next
    memory reading starts from what is live."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def profile(run):
    """Kernel time (ms, copies and memsets excluded), launches (kernel launches, graph
    launches, async copies) and kernels run (those inside replayed graphs too) of ``run()``, and
    per kernel name its time (ms) and count (``launches["by_kernel"]``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA
                    and not e.key.startswith(("Memcpy", "Memset")))
    kernels = sum(e.count for e in avg if e.device_type == DeviceType.CUDA
                  and not e.key.startswith(("Memcpy", "Memset")))
    launches = {"kernels": kernels, "by_kernel": {
        e.key: (e.self_device_time_total / 1e3, e.count) for e in avg
        if e.device_type == DeviceType.CUDA and not e.key.startswith(("Memcpy", "Memset"))}}
    for e in avg:
        if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                     "cudaGraphLaunch", "cudaMemcpyAsync"):
            launches[e.key] = launches.get(e.key, 0) + e.count
    return kernel_us / 1e3, launches


class CFMStream:
    """The CFM stream: inputs, the stock step, and one pass of any step over it."""

    def __init__(self, depth, chunks, device="cuda"):
        from cadence_fx.models.token2wav import CFMStep, build_cfm, prime_cfm
        self.step = CFMStep(build_cfm(depth, device=device))
        self.spks, self.prompt = prime_cfm(self.step, device=device)
        g = torch.Generator().manual_seed(9)
        turn = [50] * (chunks // 2 - 1) + [56]
        self.widths = turn * 2
        self.xs = [(torch.randn(1, 80, w, generator=g).to(device), torch.zeros(1, 80, w, device=device))
                   for w in self.widths]
        self.resets = {0, len(self.xs) // 2}

    def run(self, step, times=None, check=None, limit=None):
        """One pass; ``check(i, mel, state)`` sees every chunk after its timing, ``limit`` stops
        after that many chunks."""
        state = self.prompt
        for i, (mu, cond) in enumerate(self.xs[:limit]):
            if i in self.resets:
                state = self.prompt
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
                mel, state = step(mu, self.spks, cond, state)
            end.record()
            if times is not None:
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            if check is not None:
                check(i, mel, state)


def _host_copy(mel, state):
    """A copy in pinned host memory (never a view: stock state aliases the module's scratch
    buffers), compared later on the device without a host-side pass over gigabytes."""
    def pin(t):
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return h.copy_(t)
    return pin(mel), {k: pin(v) for k, v in state.items()}


def _matches(ref, mel, state):
    dev = mel.device
    return same_state((ref[0].to(dev, non_blocking=True),
                       {k: v.to(dev, non_blocking=True) for k, v in ref[1].items()}), (mel, state))


def measure(stream, step, ref, ref_times, *, warm=True, prof=True, blocks=BLOCKS):
    """Warm-up pass; a memory pass (peak allocated and reserved over a whole stream, see the
    module docstring); ``blocks`` timed passes over the stream, every chunk compared on the
    device with the reference (a block is bit-exact when all its chunks are); the profiled
    kernel floor. With ``ref=None`` (E) the first timed block is the reference, so the later
    ones check that the stock path reproduces itself. Returns ``(ref, row)``."""
    t0 = time.perf_counter()
    if warm:
        stream.run(step)
    warm_s = time.perf_counter() - t0
    log.info("  warm pass %.1f s", warm_s)
    cleanup()
    torch.cuda.reset_peak_memory_stats()
    stream.run(step)
    torch.cuda.synchronize()
    row = {"peak_bytes": torch.cuda.max_memory_allocated(),
           "reserved_bytes": torch.cuda.memory_reserved(), "warm_pass_s": warm_s}
    times, exact_blocks, exact_chunks = [], 0, 0
    for b in range(blocks):
        if ref is None:
            ref = []
            stream.run(step, times, check=lambda i, mel, state: ref.append(_host_copy(mel, state)))
            same = [True] * len(ref)
        else:
            same = []
            stream.run(step, times, check=lambda i, mel, state: same.append(_matches(ref[i], mel, state)))
        exact_blocks += all(same)
        exact_chunks += sum(same)
    row.update({"p50_ms": statistics.median(times), "p95_ms": p95(times), "blocks": blocks,
                "chunks_per_block": len(stream.xs), "bit_exact_blocks": exact_blocks,
                "bit_exact_chunks": exact_chunks, "times_ms": times})
    log.info("  timed %d blocks: p50 %.1f ms, p95 %.1f ms; %d/%d blocks bit-exact",
             blocks, row["p50_ms"], row["p95_ms"], exact_blocks, blocks)
    if ref_times is not None:
        row["ratio_vs_E_ci95"], row["ratio_vs_E_mean"] = ratio_ci(times, ref_times)
    if prof:  # two steady chunks, nothing compared
        n = 2
        kernel_ms, launches = profile(lambda: stream.run(step, limit=1 + n))
        first_ms, first = profile(lambda: stream.run(step, limit=1))  # turn start
        by_kernel, first_by_kernel = launches.pop("by_kernel"), first.pop("by_kernel")
        per_chunk = {k: (v - first.get(k, 0)) / n for k, v in launches.items()}
        row["kernel_top"] = top_kernels(by_kernel, first_by_kernel, n)
        row["kernel_kinds"] = kernel_kinds(by_kernel, first_by_kernel, n)
        # its own kernel time and kernels per chunk; ``floor_ms`` is E's (the stock floor), set
        # by ``Baseline.measure`` for the other rows
        row["kernel_ms"] = row["floor_ms"] = (kernel_ms - first_ms) / n
        row["kernels"] = per_chunk.pop("kernels")
        row["launches_per_chunk"] = per_chunk
        log.info("  profiled: %.1f ms kernel time per chunk, %.0f kernels", row["kernel_ms"],
                 row["kernels"])
    else:
        row["floor_ms"] = row["kernel_ms"] = row["kernels"] = None
        row["floor_note"] = "not profiled in this run (--no-floor)"
    return ref, row


def _per_chunk(steady, first, n):
    """``(name, ms, kernels)`` per chunk of each kernel name: ``steady`` (``1 + n`` chunks) minus
    ``first`` (the turn start), over ``n``."""
    for name, (ms, count) in steady.items():
        ms0, count0 = first.get(name, (0.0, 0))
        yield name, (ms - ms0) / n, (count - count0) / n


def top_kernels(steady, first, n, top=25):
    """The ``top`` kernel names by time per chunk, each ``[name, ms, kernels]``."""
    rows = [[name[:160], round(ms, 4), count] for name, ms, count in _per_chunk(steady, first, n)]
    return sorted(rows, key=lambda r: -r[1])[:top]


KINDS = (("triton (fused)", ("triton_",)), ("attention", ("fmha", "flash", "attention")),
         ("cat", ("CatArray",)), ("copy", ("copy_kernel", "direct_copy")),
         ("layer norm", ("layer_norm", "LayerNorm")), ("convolution", ("conv", "Conv", "implicit")),
         ("gemm", ("gemm", "Gemm", "cutlass", "sm90_", "sm80_", "cublas", "nvjet")),
         ("reduction", ("reduce", "Reduce", "softmax", "norm")),
         ("pointwise", ("elementwise", "vectorized", "unrolled")))


def kernel_kinds(steady, first, n):
    """Time (ms) and kernels per chunk by kind of kernel (``KINDS``, by name; ``other`` for the
    rest), steady minus turn start as ``top_kernels``."""
    kinds = {}
    for name, ms, count in _per_chunk(steady, first, n):
        kind = next((k for k, keys in KINDS if any(key in name for key in keys)), "other")
        t, c = kinds.get(kind, (0.0, 0.0))
        kinds[kind] = (t + ms, c + count)
    return {k: [round(t, 4), c] for k, (t, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0])}


@dataclass
class Baseline:
    """What the CFM part measures every other configuration against, with the run's settings:
    the stream, E's first block (``ref``, host copies) and E's per-chunk times (``ref_times``)."""
    stream: CFMStream
    ref: list
    ref_times: list
    blocks: int = BLOCKS
    no_floor: frozenset = frozenset()   # configurations not profiled (--no-floor)
    floor_ms: float = None              # E's kernel time per chunk: the stock floor

    def measure(self, name, step, *, warm=True, prof=None):
        """``measure`` of configuration ``name`` against E; ``prof=None`` profiles the floor
        unless ``name`` is in ``no_floor``."""
        if prof is None:
            prof = name not in self.no_floor
        ref, row = measure(self.stream, step, self.ref, self.ref_times, warm=warm, prof=prof,
                           blocks=self.blocks)
        row["floor_ms"] = self.floor_ms
        if row["kernel_ms"] is not None and self.floor_ms:
            row["kernel_vs_floor"] = row["kernel_ms"] / self.floor_ms
        return ref, row


def compile_breakdown(*compiled):
    """Where the cold compile of these compiled steps went, summed over their classes."""
    entries = [e for c in compiled for e in c.classes.values()]
    return {"trace_s": sum(e.traced.seconds for e in entries),
            "copied_calls": sum(c.counters.copied_calls for c in compiled),
            "passes_s": sum(p.seconds for e in entries for p in e.records.passes),
            "probe_s": sum(e.records.probe_s or 0.0 for e in entries),
            "capture_s": sum(getattr(c.backend, "capture_seconds", 0.0) for c in compiled),
            "warmup_s": sum(getattr(c.backend, "warmup_seconds", 0.0) for c in compiled)}


def counters_row(compiled):
    """A cadence configuration's counters and compile breakdown, as row keys."""
    k = compiled.counters
    backend = compiled.backend
    return {"replays": k.replays, "fallbacks": k.fallbacks, "invalidations": k.invalidations,
            "classes": len(compiled.classes), "traces": k.traces,
            "carry_addresses": k.carry_addresses, **compile_breakdown(compiled),
            "graphs_captured": getattr(backend, "captured", 0),
            "staging_bytes": getattr(backend, "staging_bytes", 0),
            "released_bytes": k.released_bytes,
            "fused_regions": k.fused_regions, "fusions_refused": k.fusions_refused,
            "fallback_reasons": dict(list(k.reasons.items())[:5])}
