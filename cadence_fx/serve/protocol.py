"""The wire format of ``cadence_fx.serve``: one binary WebSocket message per request and reply.

A message is a 4-byte big-endian header length, the header (UTF-8 JSON), then the tensors'
bytes, if any, one after another in the order of the header's ``"tensors"`` list, which names
each: ``[name, dtype, shape]`` (``"float32"``, ``[1, 28000]``). A tensor's bytes are its
contiguous memory, little-endian: it travels as its exact bytes, so a chunk's output is the
replica's output bit for bit, and reading a message runs no code it carries (no pickle). Raw bytes
rather than ``torch.save``: a Token2Wav reply (130 KB) took 0.25 ms to save and 0.23 ms to load,
both holding the interpreter lock that every other request of the process waits for; these take
0.02 and 0.06 ms (``bench/ws_roundtrip.py``). ``docs/serving.md`` describes every operation and error. This module imports no Ray:
the client and the replicas share it.
"""
from __future__ import annotations

import json
import struct
import sys
from typing import Dict, Optional, Tuple

import torch

__all__ = ["encode", "decode", "error", "ServeError", "SessionLost", "OPS", "ERRORS", "DTYPES"]

OPS = ("open", "chunk", "reset", "close", "stats")
# error codes a reply may carry; the client raises SessionLost for session_lost, else ServeError
ERRORS = ("session_lost", "unknown_session", "draining", "bad_request", "failed")
# the dtypes a message carries, by their name on the wire (torch's, without "torch.")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
if sys.byteorder != "little":   # the wire's byte order is the memory's on every host we serve
    raise ImportError("cadence_fx.serve sends tensors as little-endian bytes; this host is "
                      "big-endian")


class ServeError(RuntimeError):
    """An error reply: ``code`` is one of ``ERRORS``, ``session`` the session it concerns."""

    def __init__(self, code: str, message: str, session: Optional[str] = None):
        super().__init__(f"{code}: {message}")
        self.code, self.session = code, session


class SessionLost(ServeError):
    """The session's replica is gone, and its state with it: open a new session (prime again)."""


def encode(header: dict, tensors: Optional[Dict[str, torch.Tensor]] = None) -> bytes:
    """One message: ``header`` (JSON; its ``"tensors"`` key is the wire's) and ``tensors``."""
    parts, names = [], []
    for name, t in (tensors or {}).items():
        t = t.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"tensor {name!r} is {t.dtype}, which the wire does not carry; "
                             f"send one of {', '.join(DTYPES)}")
        names.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        parts.append(t.reshape(-1).view(torch.uint8).numpy().data)
    if names:
        header = dict(header, tensors=names)
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([struct.pack(">I", len(head)), head, *parts])


def decode(message: bytes) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``(header, tensors)`` of one message (the header without its ``"tensors"`` list);
    ``ValueError`` naming what is malformed."""
    if not isinstance(message, (bytes, bytearray)) or len(message) < 4:
        raise ValueError("a message is binary: 4-byte header length, JSON header, tensors "
                         "(docs/serving.md); got " + type(message).__name__)
    (n,) = struct.unpack(">I", message[:4])
    if len(message) < 4 + n:
        raise ValueError(f"the header length says {n} bytes but the message holds "
                         f"{len(message) - 4}; send the whole header")
    try:
        header = json.loads(bytes(message[4:4 + n]))
    except ValueError as e:
        raise ValueError(f"the header is not JSON ({e}); send a JSON object") from e
    if not isinstance(header, dict):
        raise ValueError("the header must be a JSON object with an 'op'")
    names = header.pop("tensors", [])
    body = bytearray(message[4 + n:])   # writable: tensors are read out of it, then copied
    tensors, at = {}, 0
    for entry in names if isinstance(names, list) else [names]:
        name, dtype, shape = _entry(entry)
        if name in tensors:
            raise ValueError(f"the header lists tensor {name!r} twice; name each tensor once")
        numel = 1
        for d in shape:
            numel *= d
        size = numel * dtype.itemsize
        if at + size > len(body):
            raise ValueError(f"tensor {name!r} ({dtype}, {shape}) needs {size} bytes at byte "
                             f"{at} of the tensors, which hold {len(body)}; send every tensor "
                             "the header lists, in its order")
        flat = torch.empty(size, dtype=torch.uint8)
        if size:
            flat.copy_(torch.frombuffer(body, dtype=torch.uint8, count=size, offset=at))
        tensors[name] = flat.view(dtype).reshape(shape)
        at += size
    if at != len(body):
        raise ValueError(f"the message holds {len(body) - at} bytes past the tensors its header "
                         "lists; list every tensor in the header's 'tensors'")
    return header, tensors


def _entry(entry) -> Tuple[str, torch.dtype, Tuple[int, ...]]:
    """One ``[name, dtype, shape]`` of a header's ``"tensors"``, checked."""
    ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
          and isinstance(entry[2], list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                 and d >= 0 for d in entry[2]))
    if not ok:
        raise ValueError(f"the header's 'tensors' entry {entry!r} is not [name, dtype, shape] "
                         "(shape a list of sizes >= 0)")
    if entry[1] not in DTYPES:
        raise ValueError(f"tensor {entry[0]!r} has dtype {entry[1]!r}; the wire carries "
                         f"{', '.join(DTYPES)}")
    return entry[0], DTYPES[entry[1]], tuple(entry[2])


def error(code: str, message: str, session: Optional[str] = None, **extra) -> bytes:
    """An error reply; ``extra``: more header fields (a draining replica names itself)."""
    assert code in ERRORS, code
    return encode({"op": "error", "code": code, "message": message, "session": session, **extra})


def raise_for(header: dict) -> None:
    """Raise the error an error reply carries (``SessionLost`` for a lost session)."""
    if header.get("op") != "error":
        return
    cls = SessionLost if header.get("code") == "session_lost" else ServeError
    raise cls(header.get("code", "failed"), header.get("message", ""), header.get("session"))
