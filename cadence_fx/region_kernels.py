"""Compiled kernels of fused regions on disk, with their verdicts: what a warm start loads instead
of compiling and verifying again.

A fused region (``fusion.py``) is compiled by Inductor with eager numerics and admitted only if
its outputs are the stock bits. Both results are stored here, once per *kernel key*:

* the compiled code as Inductor's precompiled artifact (``torch._inductor.standalone_compile``
  with ``aot=True``: the output code with its kernels' binaries and launch metadata bundled, the
  format torch's own precompile and vLLM's compile cache load), so a load runs no Inductor
  compile, no Inductor or Triton cache lookup and no Triton compile;
* the verdict: ``fused``, or ``stock`` with the reason (the fused bits differed from stock).

The kernel key hashes the region's ops (``fusion.graph_key``), its inputs' layout and the modes
it runs under (``fusion.layout_key``), the numerics settings, cadence_fx's compiler source
(``compiler_digest``) and the machine the binary is for: GPU name and compute capability, CUDA
driver and runtime versions, torch's and Triton's versions. Regions with the same key -- the
same layer at the same shapes, the next Euler step -- share one entry on disk and one compiled
callable in memory. A stored verdict is trusted on load (the per-op exactness table and its
device tests are what it rests on; ``CADENCE_FX_RECHECK_FUSION=1`` verifies every region again
on its first call, as a cold start does).

Layout::

    CACHE_DIR/kernels/<kernel key>.kernel    one header line (JSON) + the artifact's bytes

A region is found by the key of its inputs' layout as traced (its fake values), and the entry
keeps the layout its verdict was made at on the real inputs: a loaded region compares its first
call's inputs with that one, and is verified again where they differ.

The header repeats the key in full, the verdict, that layout and the payload's length and
SHA-256: an entry whose key differs (foreign), whose digest does not match (truncated, corrupt) or
that does not load is reported with a warning and compiled again, never used. Entries are Python
pickles inside: load only a cache directory you trust, as with torch's own caches.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from . import code_objects
from .entries import BadEntry, atomic_write, read_entry, write_entry  # noqa: F401 - shared with the class cache

__all__ = ["KernelStore", "StoredKernel", "compile_artifact", "compiler_digest", "environment",
           "kernel_key", "load_artifact", "recheck"]

FORMAT = 1
log = logging.getLogger(__name__)


def recheck() -> bool:
    """``CADENCE_FX_RECHECK_FUSION=1``: stored verdicts are verified again, not trusted."""
    return os.environ.get("CADENCE_FX_RECHECK_FUSION", "0") not in ("", "0")


# -- what a key covers ----------------------------------------------------------------------------
def compiler_files():
    """Every source file of cadence_fx, its passes and adapters: what a compiled class and a
    fused region's code depend on besides torch."""
    import cadence_fx
    import cadence_fx.adapters
    import cadence_fx.passes
    files = []
    for pkg in (cadence_fx, cadence_fx.passes, cadence_fx.adapters):
        for root in pkg.__path__:
            files += sorted(Path(root).rglob("*.py"))
    return sorted(set(files))


@functools.lru_cache(maxsize=None)
def compiler_digest() -> str:
    """SHA-256 over the compiler's source (``compiler_files``), read once per process: an edited
    pass or runtime module gives every key a new value, so nothing compiled by other code is
    reused."""
    h = hashlib.sha256()
    for f in compiler_files():
        h.update(Path(f).name.encode())
        h.update(hashlib.sha256(Path(f).read_bytes()).digest())
    return h.hexdigest()


def _driver_version() -> Optional[int]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def environment(device_index: int = 0) -> tuple:
    """The machine a kernel binary is for: GPU, CUDA driver and runtime, torch, Triton."""
    from importlib import metadata
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    gpu = None
    if torch.cuda.is_available():
        gpu = (torch.cuda.get_device_name(device_index),
               torch.cuda.get_device_capability(device_index))
    return (("gpu", gpu), ("driver", _driver_version()), ("cuda", torch.version.cuda),
            ("torch", torch.__version__), ("triton", triton))


def kernel_key(graph: tuple, layout: tuple, numerics: dict) -> str:
    device = next((a[3] for a in layout if isinstance(a, tuple) and len(a) == 5), "cuda")
    index = (torch.device(device).index or 0) if str(device).startswith("cuda") else 0
    parts = [repr(graph), repr(layout), repr(sorted(numerics.items())), compiler_digest(),
             repr(environment(index)), FORMAT]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


# -- compile, serialize, load ---------------------------------------------------------------------
def compile_artifact(module: torch.fx.GraphModule, args, numerics: dict) -> Callable:
    """Inductor's code for ``module`` at these inputs, with ``numerics`` patched in. The callable
    carries ``artifact``: the serialized precompiled form (None where this torch cannot make
    one; then it is not stored)."""
    import torch._inductor
    import torch._inductor.config as config
    with config.patch(numerics), torch.no_grad():
        if "aot" not in inspect.signature(torch._inductor.standalone_compile).parameters:
            fn = torch._inductor.compile(module, list(args))   # no precompiled artifact here
            fn.artifact = None
            return fn
        art = torch._inductor.standalone_compile(
            module, list(args), dynamic_shapes="from_example_inputs", options={}, aot=True)
    # the artifact's own callable runs the code and kernel binaries it serializes
    fn = functools.partial(_call, art)
    try:
        fn.artifact = art.serialize()
    except Exception as e:  # noqa: BLE001 - it runs fused here; a later process compiles it again
        log.info("a fused region's code cannot be serialized (%s: %s); not stored",
                 type(e).__name__, e)
        fn.artifact = None
    return fn


def _call(art, *args):
    return art(*args)


def load_artifact(blob: bytes) -> Callable:
    from torch._inductor.standalone_compile import AOTCompiledArtifact
    art = AOTCompiledArtifact.deserialize(blob)

    def run(*args):
        return art(*args)
    return run


# -- the store on disk ----------------------------------------------------------------------------
@dataclasses.dataclass
class StoredKernel:
    verdict: str                      # "fused" | "stock"
    reason: Optional[str]             # why stock
    fn: Optional[Callable]            # the loaded code (None for a stock verdict)
    layout: Optional[str] = None      # the inputs' layout it was verified at (``fusion.layout_key``)


class KernelStore:
    """Kernel entries under ``root/kernels``; ``loads``/``stores`` count them, ``load_seconds``
    the time spent reading and deserializing."""

    _open: dict = {}

    @classmethod
    def at(cls, root) -> "KernelStore":
        """The store of ``root``, one per directory per process (so one callable per key)."""
        path = str(Path(root).resolve())
        if path not in cls._open:
            cls._open[path] = cls(root)
        return cls._open[path]

    def __init__(self, root):
        self.dir = Path(root) / "kernels"
        self.loads = self.stores = 0
        self.load_seconds = 0.0
        self._memory: dict = {}           # key -> StoredKernel: one callable per key per process

    def path(self, key: str) -> Path:
        return self.dir / f"{key[:32]}.kernel"

    def keep_code(self) -> None:
        """From now on keep Inductor's generated modules as code objects under this store
        (``code_objects``); called where Inductor is about to run, never before (importing it
        costs seconds a step without fused regions need not pay)."""
        code_objects.install(self.dir / "code")

    def get(self, key: str) -> Optional[StoredKernel]:
        if key in self._memory:
            return self._memory[key]
        import time
        start = time.perf_counter()
        try:
            found = self._read(key)
        finally:
            self.load_seconds += time.perf_counter() - start
        if found is not None:
            self._memory[key] = found
            self.loads += 1
        return found

    def known(self, key: str) -> Optional[str]:
        """The verdict this process stored or loaded under ``key``, if any."""
        found = self._memory.get(key)
        return None if found is None else found.verdict

    def put(self, key: str, verdict: str, reason: Optional[str], fn: Optional[Callable],
            layout: Optional[str] = None) -> None:
        """Store a verdict made at ``layout``, with the artifact of ``fn`` for a fused one
        (none to store: skipped)."""
        blob = getattr(fn, "artifact", None) if verdict == "fused" else b""
        if blob is None:
            return
        write_entry(self.path(key), {"format": FORMAT, "key": key, "verdict": verdict,
                                     "reason": reason, "layout": layout}, blob)
        self._memory[key] = StoredKernel(verdict, reason, fn if verdict == "fused" else None, layout)
        self.stores += 1

    def _read(self, key: str) -> Optional[StoredKernel]:
        path = self.path(key)
        try:
            found = read_entry(path, FORMAT, {"key": key}, "kernel", "another region or machine")
        except BadEntry as e:
            return self._unusable(path, str(e))
        if found is None:
            return None
        header, blob = found
        if header.get("verdict") == "stock":
            return StoredKernel("stock", header.get("reason"), None, header.get("layout"))
        self.keep_code()
        try:
            fn = load_artifact(blob)
        except Exception as e:  # noqa: BLE001 - a cache entry must never break a compile
            return self._unusable(path, f"not loadable ({type(e).__name__}: {e})")
        fn.artifact = blob
        return StoredKernel("fused", None, fn, header.get("layout"))

    def _unusable(self, path: Path, why: str) -> None:
        warnings.warn(f"cadence_fx compile cache: {path} is {why}; the region is compiled and "
                      "verified again and the entry rewritten", RuntimeWarning, stacklevel=4)
        return None
