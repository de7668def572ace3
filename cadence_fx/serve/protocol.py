"""The wire format of ``cadence_fx.serve``: one binary WebSocket message per request and reply.

A message is a 4-byte big-endian header length, the header (UTF-8 JSON), then the tensors, if
any: a dict of named tensors as ``torch.save`` writes it, read back with ``weights_only=True``
(tensors travel as their exact bytes, so a chunk's output is the replica's output bit for bit).
``docs/serving.md`` describes every operation and error. This module imports no Ray: the client
and the replicas share it.
"""
from __future__ import annotations

import io
import json
import struct
from typing import Dict, Optional, Tuple

import torch

__all__ = ["encode", "decode", "error", "ServeError", "SessionLost", "OPS", "ERRORS"]

OPS = ("open", "chunk", "reset", "close", "stats")
# error codes a reply may carry; the client raises SessionLost for session_lost, else ServeError
ERRORS = ("session_lost", "unknown_session", "draining", "bad_request", "failed")


class ServeError(RuntimeError):
    """An error reply: ``code`` is one of ``ERRORS``, ``session`` the session it concerns."""

    def __init__(self, code: str, message: str, session: Optional[str] = None):
        super().__init__(f"{code}: {message}")
        self.code, self.session = code, session


class SessionLost(ServeError):
    """The session's replica is gone, and its state with it: open a new session (prime again)."""


def encode(header: dict, tensors: Optional[Dict[str, torch.Tensor]] = None) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b""
    if tensors:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, buf)
        body = buf.getvalue()
    return struct.pack(">I", len(head)) + head + body


def decode(message: bytes) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``(header, tensors)`` of one message; ``ValueError`` naming what is malformed."""
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
    body = bytes(message[4 + n:])
    if not body:
        return header, {}
    tensors = torch.load(io.BytesIO(body), weights_only=True)
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise ValueError("the tensors must be a dict of named tensors saved with torch.save")
    return header, tensors


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
