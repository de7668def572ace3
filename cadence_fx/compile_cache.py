"""A persistent compile cache: each compiled class on disk, so a restarted process runs nothing
but the capture.

Two entries per class:

* ``<class key>.class``, the class as compiled (``stored_class.py``): the rewritten step's graph
  modules as torch.fx's own pickled form of a GraphModule keeps them (generated code and its
  import block) with their bytecode, the constants, the per-piece facts the lowering derived, and
  the class's records. Loading it skips tracing, the passes and the probationary call; only the
  capture runs again (device graphs and addresses belong to one process).
* ``<class key>.trace``, the traced aten graph, pickled with torch's own
  ``torch.fx._graph_pickler.GraphPickler`` (the format torch's AOTAutograd cache uses for graphs
  whose nodes carry fake tensors: each fake value is stored as its metadata and made again in a
  fresh ``FakeTensorMode`` on load), with the trace's input specs and result structure. Pickling
  the fake values costs about as much as tracing, so it is written only for a class that cannot
  be stored compiled (``verify=True``, a global the code cannot import) or that runs the stock
  step; a later process runs the passes and the probe on it.

Layout::

    CACHE_DIR/<step key>/meta.json          model, step, adapter, torch, created
    CACHE_DIR/<step key>/<class key>.class  one header line (JSON) + the pickled payload
    CACHE_DIR/<step key>/<class key>.trace  the same

The step key hashes everything that can change a trace but the signature: the step's source and
every module class's, the files they are defined in (so the helpers beside them count) and the
installed versions of their packages, the adapter (all fields), parameter and buffer names,
shapes and dtypes (not their values: new weights reuse the cache), the pass options, torch's and
cadence_fx's versions and the source of every cadence_fx module, pass and adapter
(``region_kernels.compiler_digest``: an edited pass compiles again), and the GPU (name,
capability) and cuDNN build the weights live on: the passes choose by them. Fused regions' code
and verdicts are entries of their own, shared by the steps (``region_kernels.py``).
The class key hashes the signature class (shapes, strides, dtypes, devices, argument structure,
grad and inference modes). The header repeats both keys in full and the payload's SHA-256: an
entry whose keys differ (a foreign file), whose digest does not match (a truncated or corrupt
write) or that does not load is reported with a warning and compiled again, never used. Writes go
to a temporary file renamed into place, so processes writing at once leave a valid entry.

Entries are Python pickles: load only a cache directory you trust, as with torch's caches.
"""
from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import logging
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.utils._pytree as pytree

from .entries import BadEntry, read_entry, write_entry
from .entries import atomic_write as _atomic_write
from .region_kernels import compiler_digest
from .stored_class import attributes
from .tracing import TracedStep, module_state_tensors

__all__ = ["CompileCache", "entries", "clear", "default_dir", "FORMAT"]

FORMAT = 4   # 3: a fused region keeps the inputs it writes; 4: typed records (passes/records.py)
log = logging.getLogger(__name__)


def default_dir() -> Path:
    """``CADENCE_FX_CACHE_DIR``, else ``~/.cache/cadence_fx`` (the CLI's default)."""
    env = os.environ.get("CADENCE_FX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "cadence_fx"


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):   # built in, or defined where there is no source
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def _named(obj) -> str:
    """A class by its qualified name where its source file is hashed into the key (``_files``:
    the file covers its source, and ``getsource`` tokenizes the file once per class, 133 times
    for the Token2Wav flow), else by its source."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        path = None
    if path and os.path.isfile(path):
        return f"{obj.__module__}.{obj.__qualname__}"
    return _source(obj)


def _files(objs) -> Dict[str, str]:
    out = {}
    for obj in objs:
        try:
            path = inspect.getsourcefile(obj)
        except TypeError:
            continue
        if path and path not in out and os.path.isfile(path):
            out[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def _packages(objs) -> Dict[str, str]:
    from importlib import metadata
    out = {}
    for obj in objs:
        top = (getattr(obj, "__module__", None) or "").split(".")[0]
        if top and top not in out:
            try:
                out[top] = metadata.version(top)
            except metadata.PackageNotFoundError:
                out[top] = "?"
    return dict(sorted(out.items()))


def _devices(cs) -> list:
    devices = sorted({t.device for t in [*cs.tensors.params.values(), *cs.tensors.buffers.values()]
                      if t.device.type == "cuda"}, key=str)
    if not devices:
        return []
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [(str(d), torch.cuda.get_device_name(d), torch.cuda.get_device_capability(d), cudnn)
            for d in devices]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class CompileCache:
    """The cache of one compiled step (``cs``: a ``runtime.CompiledStep``) under ``root``."""

    def __init__(self, root, cs):
        import cadence_fx
        fn = getattr(cs.fn, "__func__", cs.fn)
        module_types = sorted({type(m) for m in cs.module.modules()},
                              key=lambda t: f"{t.__module__}.{t.__qualname__}")
        parts = {
            "format": FORMAT, "cadence_fx": cadence_fx.__version__, "torch": torch.__version__,
            # the passes' and the runtime's source, not only the version: an edited pass never
            # reuses what the old one compiled
            "compiler": compiler_digest(),
            "step": _source(fn), "modules": [_named(t) for t in module_types],
            # helpers the step calls live beside it: every file defining the step or a module
            # class, and the installed version of each package they come from
            "files": _files([fn, *module_types]), "packages": _packages([fn, *module_types]),
            "adapter": repr(cs.adapter), "options": repr(cs.config.options),
            "tracing_mode": cs.config.tracing_mode,
            # what the passes decided for this machine (which convolution backend, which
            # attention kernel): the devices the weights are on, their name and the cuDNN build
            "devices": _devices(cs),
            "tensors": [(n, tuple(t.shape), str(t.dtype), t.device.type)
                        for n, t in [*cs.tensors.params.items(), *cs.tensors.buffers.items()]],
        }
        self.step_key = _digest(json.dumps(parts, sort_keys=True, default=str))
        self.dir = Path(root) / self.step_key[:24]
        self.meta = {"model": type(cs.module).__qualname__, "step": getattr(fn, "__qualname__", str(fn)),
                     "adapter": cs.adapter.name, "torch": torch.__version__,
                     "cadence_fx": cadence_fx.__version__, "step_key": self.step_key}
        self.module = cs.module
        self.loads = self.stores = 0
        self.load_seconds = 0.0
        self.store_seconds = 0.0

    @staticmethod
    def class_key(key) -> str:
        return _digest(repr(key))

    def path(self, key, kind: str = "trace") -> Path:
        return self.dir / f"{self.class_key(key)[:24]}.{kind}"

    # -- the compiled class (``stored_class``): what a load runs from, skipping the passes --------
    def load_class(self, key) -> Optional[dict]:
        """The class's compiled payload (``stored_class.freeze``), or None (absent; or unusable,
        with a warning)."""
        start = time.perf_counter()
        try:
            payload = self._read(self.path(key, "class"), key)
            return None if payload is None else self._unpickle(self.path(key, "class"), payload)
        finally:
            self.load_seconds += time.perf_counter() - start

    def store_class(self, key, payload: dict) -> bool:
        start = time.perf_counter()
        try:
            blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the class works without its cache entry
            log.warning("class %s not cached compiled: %s: %s", key[0], type(e).__name__, e)
            return False
        self._write(self.path(key, "class"), key, blob)
        self.store_seconds += time.perf_counter() - start
        return True

    # -- the trace: what a load runs the passes on, when the class itself is not stored ----------
    def load(self, key) -> Optional[TracedStep]:
        """The class's trace from the cache, or None (absent; or unusable, with a warning)."""
        start = time.perf_counter()
        try:
            return self._load(key)
        finally:
            self.load_seconds += time.perf_counter() - start

    def _load(self, key) -> Optional[TracedStep]:
        path = self.path(key)
        payload = self._read(path, key)
        if payload is None:
            return None
        fields = self._unpickle(path, payload)
        if fields is None:
            return None
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.fx._graph_pickler import GraphPickler
            gm = GraphPickler.loads(fields.pop("gm"), FakeTensorMode())
            # module state the graph reads and writes is the live module's, not a stored copy
            live = module_state_tensors(self.module)
            missing = [where for where in fields["state_attrs"].values() if where not in live]
            if missing:
                log.info("class %s: its trace reads module state the module does not have (%s); "
                         "traced again", key[0], ", ".join(missing[:3]))
                return None
            for target, where in fields.pop("state_attrs").items():
                setattr(gm, target, live[where])
            fields["out_spec"] = pytree.treespec_loads(fields["out_spec"])
            fields["seconds"] = 0.0          # nothing traced in this process
            traced = TracedStep(gm=gm, loaded=True, **fields)
        except Exception as e:  # noqa: BLE001 - a cache entry must never break a compile
            return self.unusable(path, f"not loadable ({type(e).__name__}: {e})")
        self.loads += 1
        return traced

    def store(self, key, traced: TracedStep) -> bool:
        """Write the class's trace; False (logged) when it cannot be stored."""
        start = time.perf_counter()
        try:
            from torch.fx._graph_pickler import GraphPickler, Options
            fields = {f: getattr(traced, f) for f in ("inputs", "out_spec", "out_paths",
                                                      "out_constants", "out_tensor_index", "seconds",
                                                      "copied_calls", "refused")}
            # module state is stored by its path and bound to the live module on load
            state = {id(t): path for path, t in module_state_tensors(self.module).items()}
            fields["state_attrs"] = {target: ref for target, (kind, ref)
                                     in attributes(traced.gm, state).items() if kind == "state"}
            fields["gm"] = GraphPickler.dumps(traced.gm, Options(ops_filter=None))
            fields["out_spec"] = pytree.treespec_dumps(traced.out_spec)   # torch's own format
            payload = pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - the class works without its cache entry
            log.warning("class %s not cached: %s: %s", key[0], type(e).__name__, e)
            return False
        self._write(self.path(key), key, payload)
        self.store_seconds += time.perf_counter() - start
        return True

    # -- one entry on disk: a header line (JSON) and the pickled payload ------------------------
    def _read(self, path: Path, key) -> Optional[bytes]:
        """The entry's payload, checked against its header; None when absent or unusable."""
        keys = {"step_key": self.step_key, "class_key": self.class_key(key)}
        try:
            found = read_entry(path, FORMAT, keys, "cache", "another step or class")
        except BadEntry as e:
            return self.unusable(path, str(e))
        return None if found is None else found[1]

    def _unpickle(self, path: Path, payload: bytes):
        try:
            return pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - a cache entry must never break a compile
            return self.unusable(path, f"not loadable ({type(e).__name__}: {e})")

    def _write(self, path: Path, key, payload: bytes) -> None:
        write_entry(path, {"format": FORMAT, "step_key": self.step_key,
                           "class_key": self.class_key(key), "class": repr(key[0])}, payload)
        meta = self.dir / "meta.json"
        if not meta.exists():
            created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            _atomic_write(meta, json.dumps(dict(self.meta, created=created), indent=1).encode())
        self.stores += 1

    def unusable(self, path: Path, why: str) -> None:
        warnings.warn(f"cadence_fx compile cache: {path} is {why}; the class is compiled again "
                      "and the entry rewritten", RuntimeWarning, stacklevel=4)
        return None


def entries(root=None) -> List[Dict]:
    """One row per cached step: model, step, adapter, classes, bytes, created, where."""
    root = Path(root) if root is not None else default_dir()
    rows = []
    steps = sorted(p for p in root.glob("*") if p.is_dir() and p.name != "kernels") \
        if root.is_dir() else []
    for d in steps:
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        classes = {p.stem for p in d.glob("*.trace")} | {p.stem for p in d.glob("*.class")}
        rows.append({"model": meta.get("model", "?"), "step": meta.get("step", "?"),
                     "adapter": meta.get("adapter", "?"), "classes": len(classes),
                     "bytes": sum(p.stat().st_size for p in d.iterdir() if p.is_file()),
                     "created": meta.get("created", "?"), "torch": meta.get("torch", "?"),
                     "path": str(d)})
    kernels = root / "kernels"
    if kernels.is_dir():   # fused regions' code and verdicts, shared by the steps above
        files = list(kernels.glob("*.kernel"))
        rows.append({"model": "(fused-region kernels)", "step": "-", "adapter": "-",
                     "classes": len(files),
                     "bytes": sum(f.stat().st_size for f in kernels.rglob("*") if f.is_file()),
                     "created": "-", "torch": torch.__version__, "path": str(kernels)})
    return rows


def clear(root=None) -> int:
    """Remove every cached step under ``root``; returns how many."""
    import shutil
    rows = entries(root)
    for row in rows:
        shutil.rmtree(row["path"], ignore_errors=True)
    return sum(not row["path"].endswith("kernels") for row in rows)
