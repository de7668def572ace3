"""Inductor's generated Python modules kept as compiled code objects in the cache directory.

Loading a stored region kernel (``region_kernels.load_artifact``) makes Inductor write its
output code and each Triton kernel's module to its own cache and import them: a ``compile()`` of
the source text per module, 853 of them for the Token2Wav catalog's 181 kernels, 2.5 of the
8.8 s its loads took on the H200 (profiled with ``bench/probe_startup.py --kernels``). The source
is the same in every process, so its code object is kept here once, keyed by the source's
SHA-256 and the Python version, and later processes unmarshal it (about 40x faster than
compiling on the machine it was measured on).

``install(directory)`` puts ``_reload`` in place of Inductor's module loader
(``torch._inductor.codecache._reload_python_module``) once per process: it builds the module as
Inductor's does, from the cached code object when there is one. The loader is replaced only where
its signature is the one this was written against; elsewhere Inductor's own is left in place.

Layout::

    CACHE_DIR/kernels/code/<key>.pyc    one header line (JSON) + the marshal'd code object

The key is the SHA-256 of the source and the Python version; the header repeats it with the
payload's length and digest (``entries.write_entry``), so a damaged or foreign entry is
reported with a warning and compiled again, never run.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import marshal
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Optional

from .entries import BadEntry, read_entry, write_entry

__all__ = ["install", "installed_dir", "stats"]

FORMAT = 1
log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_DIR: Optional[Path] = None          # where code objects are kept; None: not installed
_REAL = None                         # Inductor's loader
stats = {"kept": 0, "compiled": 0}   # modules this process took from the cache / compiled


def installed_dir() -> Optional[Path]:
    return _DIR


def install(directory) -> bool:
    """Keep Inductor's generated modules' code objects under ``directory`` from now on in this
    process (the latest directory installed is the one used). False where Inductor's loader is not
    the one this replaces (then nothing changes)."""
    global _DIR, _REAL
    from torch._inductor import codecache
    with _LOCK:
        if _REAL is None:
            real = getattr(codecache, "_reload_python_module", None)
            if real is None or list(inspect.signature(real).parameters) != [
                    "key", "path", "set_sys_modules"]:
                log.info("Inductor's module loader is not the expected one; code not cached")
                return False
            _REAL = real
            codecache._reload_python_module = _reload
        _DIR = Path(directory)
    return True


def _reload(key: str, path: str, set_sys_modules: bool = True) -> types.ModuleType:
    """Inductor's ``_reload_python_module``, with the compile taken from the cache."""
    from torch._inductor.runtime import compile_tasks
    with open(path) as f:
        source = f.read()
    try:
        code = _code(source, path)
    except Exception as e:  # noqa: BLE001 - Inductor's own error for a module that fails
        raise RuntimeError(f"Failed to import {path}\n{type(e).__name__}: {e}") from None
    mod = types.ModuleType(f"{compile_tasks.__name__}.{key}")
    mod.__file__ = path
    mod.key = key
    exec(code, mod.__dict__, mod.__dict__)
    if set_sys_modules:
        sys.modules[mod.__name__] = mod
    return mod


def _code(source: str, path: str) -> types.CodeType:
    directory = _DIR
    if directory is None:
        return compile(source, path, "exec", dont_inherit=True)
    digest = hashlib.sha256(f"{sys.version}\0{source}".encode()).hexdigest()
    kept = directory / f"{digest[:32]}.pyc"
    try:
        found = read_entry(kept, FORMAT, {"source": digest}, "code", "another module")
        code = None if found is None else marshal.loads(found[1])
        if code is not None and isinstance(code, types.CodeType):
            stats["kept"] += 1
            return _refile(code, path)
    except (BadEntry, EOFError, ValueError, TypeError) as e:
        warnings.warn(f"cadence_fx compile cache: {kept} is {e}; the module is compiled again "
                      "and the entry rewritten", RuntimeWarning, stacklevel=2)
    code = compile(source, path, "exec", dont_inherit=True)
    stats["compiled"] += 1
    try:
        write_entry(kept, {"format": FORMAT, "source": digest}, marshal.dumps(code))
    except OSError as e:
        log.info("a generated module's code is not kept (%s)", e)
    return code


def _refile(code: types.CodeType, path: str) -> types.CodeType:
    """``code`` and the code nested in it as compiled from ``path`` (where this process's
    Inductor wrote the source: tracebacks and ``inspect.getsource``, which Triton's ``jit``
    reads, look there)."""
    consts = tuple(_refile(c, path) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)
