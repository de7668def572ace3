"""Direct connections: a WebSocket server in each replica for the chunks of its own sessions.

Through the gateway a chunk crosses Serve's HTTP proxy, the gateway replica and the session's
replica, and back: four Ray hops besides the WebSocket. On a 2-core machine, echoing a 112 KB
message (a Token2Wav reply's size) took 17.2 ms p50 that way, 10.8 ms with the session's replica
as Serve's ingress (two hops) and 7.0 ms over a plain WebSocket to the replica, none through Ray
(all of them deflating each message then; without, the plain WebSocket takes 0.3 ms).
A session opened with ``direct`` gets the address of its replica's own server in the ``opened``
reply; its client sends every later request there, on a connection of its own. The open itself,
health, draining, metrics and restarts go through Ray Serve as before. The connection is to one
replica, so the session stays pinned to it; when the replica dies the connection closes, and the
client raises ``SessionLost``. The server binds ``host`` (``build_app(direct_host=)``,
``cadence-fx serve --direct``) on a free port and advertises the node's address.

Threads, not the event loop. Each connection has a thread of its own (``websockets.sync``) that
receives a request, runs it and sends its reply: a request crosses no thread but the one that
parses its frames. Served from the replica's event loop instead (as until 2026-12-03), a chunk
waited for the loop to take it, for a worker thread (4.1 ms p50, 19.8 ms p99 with 32 sessions
on 8 lanes on the H200, every thread of the replica sharing one GIL with the lanes' own), and for
the loop again to send the reply.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Set

__all__ = ["DirectServer"]

log = logging.getLogger(__name__)


class DirectServer:
    """``serve(message) -> reply`` for every binary message of every connection, in that
    connection's thread, one request at a time per connection; listening from the first
    ``start()`` (from any thread) until ``close()``."""

    def __init__(self, host: str, serve: Callable[[bytes], bytes]):
        self.host, self._serve = host, serve
        self.url: Optional[str] = None
        self._server = None
        self._lock = threading.Lock()
        self._open: Set[object] = set()   # the connections, closed by close()

    def start(self) -> str:
        if self.url is not None:   # every request of the replica asks: started already
            return self.url
        with self._lock:
            if self._server is None:
                from websockets.sync.server import serve
                # no per-message deflate, which a client may offer (client.py says why)
                self._server = serve(self._connection, self.host, 0, max_size=None,
                                     ping_interval=None, compression=None)
                threading.Thread(target=self._server.serve_forever, daemon=True,
                                 name="cadence-fx-direct").start()
                port = self._server.socket.getsockname()[1]
                self.url = f"ws://{self._advertised()}:{port}"
                log.info("direct connections on %s", self.url)
        return self.url

    def _advertised(self) -> str:
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        import ray
        return ray.util.get_node_ip_address()

    def _connection(self, connection) -> None:
        from websockets.exceptions import ConnectionClosed
        with self._lock:
            self._open.add(connection)
        try:
            for message in connection:   # ends when the client closes
                if isinstance(message, str):
                    message = b""   # the protocol is binary: the reply says so
                connection.send(self._serve(message))
        except ConnectionClosed:
            return
        finally:
            with self._lock:
                self._open.discard(connection)

    def close(self) -> None:
        """Stop listening and close every connection (their clients raise ``SessionLost``)."""
        with self._lock:
            server, connections = self._server, list(self._open)
        if server is None:
            return
        server.shutdown()
        for connection in connections:
            connection.close()
