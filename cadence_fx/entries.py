"""One cache entry on disk, as every cadence_fx cache writes it: a header line (JSON: the entry's
format, its keys, the payload's length and SHA-256) and the payload, written atomically.

``read_entry`` refuses, with the reason, an entry that is unreadable, of another kind or format,
written for other keys (foreign), or whose payload does not match its digest (truncated,
corrupt): the class cache (``compile_cache.py``), the kernel store (``region_kernels.py``) and the
generated modules' code objects (``code_objects.py``) then compile again and rewrite it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path

__all__ = ["BadEntry", "atomic_write", "read_entry", "write_entry"]


class BadEntry(Exception):
    """A cache entry that may not be used; the message says why."""


def write_entry(path: Path, header: dict, payload: bytes) -> None:
    """One cache entry: a header line (JSON, with the payload's length and SHA-256 added) and
    the payload, written atomically. Both caches write theirs so."""
    header = dict(header, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(header).encode() + b"\n" + payload)


def read_entry(path: Path, fmt: int, keys: dict, kind: str, foreign: str):
    """The header and payload of the entry at ``path``, or None when there is none. Raises
    ``BadEntry`` when it is unreadable, not a ``kind`` entry, of a format other than ``fmt``,
    written for other ``keys`` (``foreign`` says for what), or truncated or corrupt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadEntry(f"unreadable ({e})") from e
    head, sep, payload = data.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise BadEntry(f"not a cadence_fx {kind} entry (no header)")
    if not sep or header.get("format") != fmt:
        raise BadEntry(f"of another format ({header.get('format')!r})")
    if any(header.get(k) != v for k, v in keys.items()):
        raise BadEntry(f"written for {foreign} (foreign entry)")
    if len(payload) != header.get("bytes") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BadEntry("truncated or corrupt (its digest does not match)")
    return header, payload


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place: processes writing
    at once leave one whole entry, never a mix (the compile cache's entries are written so too)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with io.FileIO(fd, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
