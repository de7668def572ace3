"""Who holds device memory at the peak: the CUDA caching allocator's history over a block of code,
replayed to the moment the allocated total was highest, and the blocks live then grouped by the
Python line that allocated them.

    with memory_trace.Recorder() as rec:
        ...                                   # the code whose peak is in question
    summary = rec.peak()                      # {"peak_above_start_bytes", "live": [...]}

Allocations made before the recorder started are outside the history (their bytes are in
``allocated_at_start_bytes``); the peak is theirs plus the most the history ever held above them.
Recording Python stacks slows allocation-heavy code a few times over: a diagnostic, not a timed row.
"""
from __future__ import annotations

from typing import Dict, List

import torch

__all__ = ["Recorder"]

_SKIP = ("torch/", "contextlib.py", "memory_trace.py", "functools.py")


def _site(frames: List[dict], depth: int = 6) -> str:
    """The innermost ``depth`` frames outside torch and the standard library, innermost first."""
    own = [f for f in frames if not any(s in f.get("filename", "") for s in _SKIP)]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                      for f in own[:depth]) or "(torch internals)"


class Recorder:
    def __init__(self, max_entries: int = 2_000_000, min_bytes: int = 1 << 16):
        self.max_entries, self.min_bytes = max_entries, min_bytes
        self.snapshot = None

    def __enter__(self):
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)

    def peak(self, top: int = 15) -> Dict:
        """The peak of the recorded span and the live blocks of at least ``min_bytes`` then, the
        largest allocation sites first (allocated bytes count from an alloc to its free request,
        as ``memory_allocated`` does)."""
        every = self.snapshot["device_traces"][torch.cuda.current_device()]
        trace = [e for e in every if e["action"] in ("alloc", "free_requested")]
        total = best = 0
        at = -1
        for i, e in enumerate(trace):
            total += e["size"] if e["action"] == "alloc" else -e["size"]
            if total > best:
                best, at = total, i
        return {"allocated_at_start_bytes": self.start, "peak_above_start_bytes": best,
                "end_above_start_bytes": total,
                # the history is a ring of max_entries actions: full, its start is lost
                "events": len(trace), "truncated": len(every) >= self.max_entries,
                "live": self._live(trace[:at + 1], top),        # at the peak
                "live_at_end": self._live(trace, top)}          # what the span left allocated

    def _live(self, trace: List[dict], top: int) -> List[dict]:
        live: Dict[int, dict] = {}
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            else:
                live.pop(e["addr"], None)
        sites: Dict[str, List[int]] = {}
        for e in live.values():
            if e["size"] >= self.min_bytes:
                sites.setdefault(_site(e.get("frames", [])), []).append(e["size"])
        ranked = sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:top]
        return [{"site": s, "bytes": sum(v), "blocks": len(v)} for s, v in ranked]
