"""Which objects a crashing garbage collection was freeing: a pytest plugin.

    PYTHONPATH=bench python -X faulthandler -m pytest -p gc_probe tests/test_lanes.py -q -s

On CUDA, a process that ran lanes can crash with a segmentation fault inside a collection
(docs/sessions.md, Lanes). This plugin turns automatic collection off and collects after every
test itself: first with ``gc.DEBUG_SAVEALL``, which keeps what it finds, to print the types the
collection is about to free (those with native destructors first: graphs, streams, events,
generators), then for real. A crash then follows the last printed summary, and names the test
whose garbage it was. Prints to stderr, flushed, one block per test.
"""
import collections
import gc
import sys

NATIVE = {"CUDAGraph", "Stream", "ExternalStream", "Event", "Generator", "MemPool", "Tensor",
          "Parameter", "FakeTensor"}   # torch types whose freeing runs native code


def _summary(objects) -> str:
    types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    native = {t: n for t, n in types.items()
              if t.startswith("torch") and t.rsplit(".", 1)[-1] in NATIVE}
    top = ", ".join(f"{t} {n}" for t, n in types.most_common(8))
    return f"{len(objects)} objects; native: {native}; most: {top}"


def pytest_configure(config):
    gc.disable()


def pytest_runtest_teardown(item, nextitem):
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    found = list(gc.garbage)
    gc.garbage.clear()
    print(f"\n[gc_probe] after {item.nodeid}: {_summary(found)}", file=sys.stderr, flush=True)
    del found
    print("[gc_probe] freeing it", file=sys.stderr, flush=True)
    gc.collect()
    print("[gc_probe] freed", file=sys.stderr, flush=True)
