"""The Moshi frame in the suite (``bench/suite.py --parts moshi``): ``bench/moshi_frame.py`` (E:
stock eager, V: the vendor's ``CUDAGraphed`` path, cadence: ``MoshiStep`` compiled) in a child
process of its own, and the rows the suite keeps from its result.

Memory, per configuration, in that child process (``moshi_frame.timed`` and
``stock_streams``): after the configuration's warm-up stream, ``torch.cuda.synchronize`` and
``reset_peak_memory_stats`` (no ``gc.collect``/``empty_cache``), then ``peak_bytes =
max_memory_allocated`` over the timed streams and ``reserved_bytes = memory_reserved`` read after
them. The configurations run one after another with no cleanup between them; E's reference
outputs stay on the device while V and cadence are measured.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["moshi_part"]

HERE = os.path.dirname(os.path.abspath(__file__))


def moshi_part(args):
    """The suite's ``moshi`` section: E, V, cadence and the stream sizes of one child run."""
    out = "/tmp/suite-moshi.json"
    subprocess.run([sys.executable, os.path.join(HERE, "moshi_frame.py"), "--out", out],
                   check=True, timeout=900)
    with open(out) as f:
        m = json.load(f)
    return {"E": m["E"], "V": m.get("V"), "cadence": m["cadence"],
            "streams": m["streams"], "frames_per_stream": m["frames_per_stream"]}
