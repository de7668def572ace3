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
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

__all__ = ["DirectServer"]

log = logging.getLogger(__name__)


class DirectServer:
    """``serve(message) -> reply`` for every binary message of every connection, one request at a
    time per connection; started on the running event loop at the first ``start()``."""

    def __init__(self, host: str, serve: Callable[[bytes], Awaitable[bytes]]):
        self.host, self._serve = host, serve
        self.url: Optional[str] = None
        self._server = None
        self._starting = asyncio.Lock()

    async def start(self) -> str:
        if self.url is not None:   # every request of the replica asks: started already
            return self.url
        async with self._starting:
            if self._server is None:
                from websockets.asyncio.server import serve
                # no per-message deflate, which a client may offer (client.py says why)
                self._server = await serve(self._connection, self.host, 0, max_size=None,
                                           ping_interval=None, compression=None)
                port = self._server.sockets[0].getsockname()[1]
                self.url = f"ws://{self._advertised()}:{port}"
                log.info("direct connections on %s", self.url)
        return self.url

    def _advertised(self) -> str:
        if self.host not in ("0.0.0.0", "::", ""):
            return self.host
        import ray
        return ray.util.get_node_ip_address()

    async def _connection(self, connection) -> None:
        from websockets.exceptions import ConnectionClosed
        try:
            async for message in connection:
                if isinstance(message, str):
                    message = b""   # the protocol is binary: the reply says so
                await connection.send(await self._serve(message))
        except ConnectionClosed:
            return

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
