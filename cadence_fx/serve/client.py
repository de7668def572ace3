"""A Python client of ``cadence_fx.serve`` (the protocol: ``docs/serving.md``).

    with StreamClient("ws://127.0.0.1:8000/v1/stream") as client:
        s = client.open(seed=1)                   # a session, pinned to one replica for life
        out = s.chunk(x=torch.randn(1, 8, 256))   # the model's inputs by name -> its outputs
        s.chunk(x=..., last=True)                 # the turn's last chunk
        s.reset()                                 # the next turn, from the session's prompt
        s.close()

A chunk for a session whose replica is gone raises ``SessionLost``: its state is gone with the
replica, so the caller opens a new session (on a live replica) and primes it again; nothing is
moved behind its back. Other error replies raise ``ServeError`` with their ``code``.

``client.open(direct=True)`` (a server started with ``direct_host``, ``cadence-fx serve
--direct``): the session's later requests go over a connection of its own to its replica's own
WebSocket server, not through Serve's proxy and the gateway (``direct.py``); the replica's death
closes that connection, and the request then raises ``SessionLost``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .protocol import ServeError, SessionLost, decode, encode, raise_for

__all__ = ["StreamClient", "Session", "SessionLost", "ServeError"]

Tensors = Dict[str, torch.Tensor]


class StreamClient:
    """One WebSocket connection; any number of sessions over it, one request at a time."""

    def __init__(self, url: str = "ws://127.0.0.1:8000/v1/stream", timeout: float = 120.0):
        self.url, self.timeout = url, timeout
        self._ws = _connect(url, timeout)

    def request(self, header: dict, tensors: Optional[Tensors] = None) -> Tuple[dict, Tensors]:
        """Send one request and return the reply; an error reply raises."""
        return _request(self._ws, header, tensors, self.timeout)

    def open(self, prompt: Optional[Tensors] = None, seed: Optional[int] = None,
             direct: bool = False) -> "Session":
        """A new session: ``prompt``, the model's priming tensors (none: the replica's default),
        ``seed``, its generator's seed where the model draws randomness; ``direct``: its later
        requests go straight to its replica (see the module's docstring)."""
        header = {"op": "open", "seed": seed}
        if direct:
            header["direct"] = True
        reply, _ = self.request(header, prompt)
        return Session(self, reply)

    def close(self) -> None:
        self._ws.close()

    def __enter__(self) -> "StreamClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect(url: str, timeout: float):
    """A connection for the life of its owner (``close``). No per-message compression: a
    Token2Wav reply is float audio, which deflate barely shrinks, and a deflated reply's round
    trip took 7.6 ms on a 2-core host, 0.3 ms without, both ends' CPU (docs/serving.md)."""
    from websockets.sync.client import connect
    return connect(url, max_size=None, open_timeout=timeout, close_timeout=5,
                   ping_interval=None, compression=None).__enter__()


def _request(ws, header: dict, tensors: Optional[Tensors], timeout: float
             ) -> Tuple[dict, Tensors]:
    ws.send(encode(header, tensors))
    reply, out = decode(ws.recv(timeout=timeout))
    raise_for(reply)
    return reply, out


class Session:
    """A session on one replica: ``token`` names both. ``direct``: the address of its replica's
    own server, which its requests use (None: through the gateway)."""

    def __init__(self, client: StreamClient, opened: dict):
        self.client, self.token, self.replica = client, opened["session"], opened["replica"]
        self.warm = opened.get("warm", {})     # how its replica started: traces, cache loads
        self.closed: Optional[str] = None      # why the server ended it (e.g. "draining")
        self.last_reply: dict = {}
        self.direct: Optional[str] = opened.get("direct")
        self._ws = None
        if self.direct is not None:
            from websockets.exceptions import WebSocketException
            try:
                self._ws = _connect(self.direct, client.timeout)
            except (OSError, TimeoutError, WebSocketException) as e:   # unreachable: end it
                client.request({"op": "close", "session": self.token})
                raise ServeError("failed", f"the replica of session {self.token} serves direct "
                                 f"connections at {self.direct}, which this client cannot reach "
                                 f"({type(e).__name__}: {e}); the session was closed. Open "
                                 "without direct, or serve with a direct_host the clients reach",
                                 self.token) from e

    def request(self, header: dict, tensors: Optional[Tensors] = None) -> Tuple[dict, Tensors]:
        """One request of this session, on its direct connection if it has one."""
        if self._ws is None:
            return self.client.request(header, tensors)
        from websockets.exceptions import ConnectionClosed
        try:
            return _request(self._ws, header, tensors, self.client.timeout)
        except TimeoutError:   # an OSError, but the replica is slow, not gone: as the gateway's
            raise
        except (ConnectionClosed, OSError) as e:
            raise SessionLost("session_lost", f"the direct connection to replica "
                              f"{self.replica} closed ({type(e).__name__}): the replica is "
                              "gone, and the session's state with it; open a new session and "
                              "prime it again", self.token) from e

    def chunk(self, last: bool = False, **inputs: torch.Tensor) -> Tensors:
        """One chunk: the model's inputs by name; returns its outputs (CPU tensors)."""
        reply, out = self.request({"op": "chunk", "session": self.token, "last": last}, inputs)
        self.last_reply = reply
        self.closed = reply.get("closed")
        return out

    def reset(self) -> None:
        self.request({"op": "reset", "session": self.token})

    def close(self) -> None:
        try:
            self.request({"op": "close", "session": self.token})
        finally:
            if self._ws is not None:
                self._ws.close()
                self._ws = None

    def stats(self) -> dict:
        """Its replica's stats (live sessions, warm start, counters, deadline misses)."""
        return self.request({"op": "stats", "session": self.token})[0]["stats"]
