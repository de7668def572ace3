"""The ingress: a FastAPI app on Ray Serve that streams sessions over WebSockets to the replicas,
and ``build_app``, the whole Serve application.

``/v1/stream`` (WebSocket): each binary message is one request (``protocol.py``,
``docs/serving.md``); the gateway reads the session token from its header, hands the message to
the replicas' handle (``SessionRouter`` picks the session's replica) and sends the reply back,
one request at a time per connection. A replica that dies under a request, or before it, turns
into a ``session_lost`` reply; the connection stays open for the next session. ``/v1/health``
(GET): every replica's stats (live sessions, draining, warm start, counters).
"""
# no ``from __future__ import annotations``: FastAPI reads the routes' parameter types (the
# WebSocket) from their annotations, which a bound method cannot resolve from strings
import json
import struct
from typing import Optional

import ray
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from .protocol import encode, error
from .replica import SessionReplica
from .router import SessionRouter

__all__ = ["Gateway", "build_app", "REPLICA"]

REPLICA = "SessionReplica"   # the replicas' deployment name (their actors' names carry it)


def _token(message: bytes) -> Optional[str]:
    """The session a message names (its header's ``session``), read without its tensors."""
    try:
        (n,) = struct.unpack(">I", message[:4])
        token = json.loads(bytes(message[4:4 + n])).get("session")
    except (struct.error, ValueError, AttributeError):
        return None   # the replica answers bad_request, naming what is malformed
    return token if isinstance(token, str) else None


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000)
@serve.ingress()
class Gateway:
    def __init__(self, replicas: DeploymentHandle, model: str):
        self.replicas, self.model = replicas, model

    def __serve_build_asgi_app__(self) -> FastAPI:
        # built in the replica: a FastAPI app made at import time may not pickle (its
        # telemetry holds a lock), and the routes are this instance's methods anyway
        api = FastAPI(title="cadence_fx sessions")
        api.add_api_websocket_route("/v1/stream", self.stream)
        api.add_api_route("/v1/health", self.health, methods=["GET"])
        return api

    async def stream(self, ws: WebSocket) -> None:
        await ws.accept()
        try:
            while True:
                frame = await ws.receive()
                if frame.get("type") == "websocket.disconnect":
                    return
                message = frame.get("bytes")
                if message is None:
                    await ws.send_bytes(error("bad_request", "send binary messages "
                                              "(docs/serving.md), not text"))
                    continue
                await ws.send_bytes(await self._forward(message))
        except WebSocketDisconnect:
            return

    async def _forward(self, message: bytes) -> bytes:
        token = _token(message)
        try:
            return await self.replicas.handle.remote(token, message)
        except (RayActorError, ActorUnavailableError) as e:   # the replica died under it
            if token is None:
                return error("failed", f"the replica died while opening ({type(e).__name__}); "
                             "open again")
            return error("session_lost", f"the replica of session {token} died "
                         f"({type(e).__name__}), and its state with it; open a new session and "
                         "prime it again", token)

    async def health(self) -> dict:
        """Every live replica's stats: found by their actors' names, asked by their tokens."""
        app = serve.get_replica_context().app_name
        prefix = f"SERVE_REPLICA::{app}#{REPLICA}#"
        tags = sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(True)
                      if a["name"].startswith(prefix))
        replicas = {}
        for tag in tags:
            try:
                reply = await self.replicas.handle.remote(f"{tag}:", encode({"op": "stats"}))
            except (RayActorError, ActorUnavailableError):
                continue
            stats = json.loads(reply[4:4 + struct.unpack(">I", reply[:4])[0]])["stats"]
            replicas[stats["replica"]] = stats
        return {"model": self.model, "replicas": replicas,
                "live_sessions": sum(s["live_sessions"] for s in replicas.values()),
                "draining": any(s["draining"] for s in replicas.values())}


def build_app(model: str = "toy", replicas: int = 1, *, cache_dir=None, num_gpus=None,
              num_cpus: float = 1.0, device: str = "auto", full: Optional[bool] = None,
              threads: Optional[int] = None, deadline_ms: Optional[float] = None,
              draining: bool = False, max_ongoing_requests: int = 64):
    """The Serve application: the gateway and ``replicas`` replicas of ``model``, each with
    ``num_gpus`` GPUs (default: 1 where this machine has CUDA, else 0; fractional in tests) and
    ``num_cpus`` CPUs, all compiling into the shared ``cache_dir``. ``serve.run`` it; running it
    again with ``draining=True`` drains the replicas in place (no restart)."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: serve at least one replica")
    if num_gpus is None:
        import torch
        num_gpus = 1 if torch.cuda.is_available() else 0
    replica = serve.deployment(SessionReplica, name=REPLICA).options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
        user_config={"draining": draining},
        request_router_config=RequestRouterConfig(request_router_class=SessionRouter))
    return Gateway.bind(replica.bind(model, None if cache_dir is None else str(cache_dir),
                                     device, full, threads, deadline_ms), model)
