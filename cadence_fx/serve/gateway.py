"""The ingress: a FastAPI app on Ray Serve that streams sessions over WebSockets to the replicas,
and ``build_app``, the whole Serve application.

``/v1/stream`` (WebSocket): each binary message is one request (``protocol.py``,
``docs/serving.md``); the gateway reads the session token from its header, hands the message to
the replicas' handle (``SessionRouter`` picks the session's replica) and sends the reply back,
one request at a time per connection. A replica that dies under a request, or before it, turns
into a ``session_lost`` reply; the connection stays open for the next session. An ``open``
skips the replicas the gateway knows to be draining, and one refused by a draining replica is
tried again on the others. ``/v1/health`` (GET): every replica's stats (live sessions,
draining, drained, warm start, counters). ``/v1/drain`` (POST, JSON ``{"replicas": [ids] or
null for all, "draining": true|false}``): drains (or stops draining) replicas in place, without
a redeploy, so open WebSockets and live sessions go on; it answers as ``/v1/health`` does.
"""
# no ``from __future__ import annotations``: FastAPI reads the routes' parameter types (the
# WebSocket) from their annotations, which a bound method cannot resolve from strings
import json
import struct
from typing import List, Optional

import ray
from fastapi import Body, FastAPI, HTTPException, WebSocket, WebSocketDisconnect
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from .protocol import error
from .replica import SessionReplica
from .router import SessionRouter

__all__ = ["Gateway", "build_app", "REPLICA"]

REPLICA = "SessionReplica"   # the replicas' deployment name (their actors' names carry it)


def _header(message: bytes) -> dict:
    """A message's header, read without its tensors ({} when malformed: the replica answers
    bad_request, naming what is)."""
    try:
        (n,) = struct.unpack(">I", message[:4])
        header = json.loads(bytes(message[4:4 + n]))
    except (struct.error, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def _token(header: dict) -> Optional[str]:
    token = header.get("session")
    return token if isinstance(token, str) else None


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000)
@serve.ingress()
class Gateway:
    def __init__(self, replicas: DeploymentHandle, model: str):
        self.replicas, self.model = replicas, model
        self.draining = set()   # replicas known to drain: opens skip them

    def __serve_build_asgi_app__(self) -> FastAPI:
        # built in the replica: a FastAPI app made at import time may not pickle (its
        # telemetry holds a lock), and the routes are this instance's methods anyway
        api = FastAPI(title="cadence_fx sessions")
        api.add_api_websocket_route("/v1/stream", self.stream)
        api.add_api_route("/v1/health", self.health, methods=["GET"])
        api.add_api_route("/v1/drain", self.drain, methods=["POST"])
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
        header = _header(message)
        token = _token(header)
        if header.get("op") != "open":
            return await self._call(token, message)
        refused = set()
        while True:   # an open refused by a draining replica goes to the others
            reply = await self._call(None, message, avoid=sorted(self.draining | refused))
            answer = _header(reply)
            tag = answer.get("replica")
            if answer.get("code") != "draining" or not tag or tag in refused:
                return reply
            refused.add(tag)
            self.draining.add(tag)

    async def _call(self, token: Optional[str], message: bytes, avoid=()) -> bytes:
        try:
            return await self.replicas.handle.remote(token, message, avoid=list(avoid))
        except (RayActorError, ActorUnavailableError) as e:   # the replica died under it
            if token is None:
                return error("failed", f"the replica died while opening ({type(e).__name__}); "
                             "open again")
            return error("session_lost", f"the replica of session {token} died "
                         f"({type(e).__name__}), and its state with it; open a new session and "
                         "prime it again", token)

    async def health(self) -> dict:
        """Every live replica's stats."""
        return await self._statuses(self._tags())

    async def drain(self, body: Optional[dict] = Body(None)) -> dict:
        """Drain the replicas ``body["replicas"]`` names (all when null or absent), or stop
        draining them with ``"draining": false``; answers as ``health`` does."""
        body = body or {}
        tags, flag = self._tags(), body.get("draining", True)
        named = body.get("replicas")
        if not isinstance(flag, bool) or not (named is None or isinstance(named, list)):
            raise HTTPException(400, 'send {"replicas": [replica ids] or null for all, '
                                '"draining": true or false}')
        unknown = sorted(set(named or ()) - set(tags))
        if unknown:
            raise HTTPException(404, f"no live replica {unknown} (live: {tags}); name replicas "
                                "/v1/health lists")
        return await self._statuses(tags, named if named is not None else tags, flag)

    def _tags(self) -> List[str]:
        """The live replicas' ids, found by their actors' names."""
        app = serve.get_replica_context().app_name
        prefix = f"SERVE_REPLICA::{app}#{REPLICA}#"
        return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(True)
                      if a["name"].startswith(prefix))

    async def _statuses(self, tags: List[str], set_on=(), draining: Optional[bool] = None
                        ) -> dict:
        """Every replica's stats, asked by its id (the router sends each to its replica), the
        replicas in ``set_on`` told ``draining`` first."""
        replicas = {}
        for tag in tags:
            flag = draining if tag in set_on else None
            try:
                stats = await self.replicas.status.remote(f"{tag}:", flag)
            except (RayActorError, ActorUnavailableError):
                continue
            if stats is not None:
                replicas[stats["replica"]] = stats
        self.draining = {t for t, s in replicas.items() if s["draining"]}
        return {"model": self.model, "replicas": replicas,
                "live_sessions": sum(s["live_sessions"] for s in replicas.values()),
                "draining": sorted(self.draining),
                "drained": sorted(t for t, s in replicas.items() if s["drained"])}


def build_app(model: str = "toy", replicas: int = 1, *, cache_dir=None, num_gpus=None,
              num_cpus: float = 1.0, device: str = "auto", full: Optional[bool] = None,
              threads: Optional[int] = None, deadline_ms: Optional[float] = None,
              lanes: int = 1, max_ongoing_requests: int = 64,
              direct_host: Optional[str] = None, switch_interval_ms: Optional[float] = None,
              gc_freeze: bool = True):
    """The Serve application: the gateway and ``replicas`` replicas of ``model``, each with
    ``num_gpus`` GPUs (default: 1 where this machine has CUDA, else 0; fractional in tests),
    ``num_cpus`` CPUs and ``lanes`` lanes, all compiling into the shared ``cache_dir``.
    ``max_ongoing_requests``: requests a replica runs at once (each in a worker thread of its
    own); a session sends one at a time, so keep it above the sessions a replica holds (a
    pinned request waits in the gateway when its replica is full). ``direct_host``: each
    replica also serves its sessions' later requests on a WebSocket of its own, bound to that
    host (``direct.py``; ``"0.0.0.0"`` advertises the node's address), for the sessions opened
    with ``"direct": true``. ``switch_interval_ms``: each replica's ``sys.setswitchinterval``
    (``host.process_settings``). ``gc_freeze``: each replica freezes the objects its start made
    once warm, out of every later collection (``host.freeze_start_up``). ``serve.run`` it;
    drain it with ``POST /v1/drain``."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: serve at least one replica")
    if lanes < 1 or max_ongoing_requests < 1:
        raise ValueError(f"lanes={lanes}, max_ongoing_requests={max_ongoing_requests}: give "
                         "each at least 1")
    if switch_interval_ms is not None and not switch_interval_ms > 0:
        raise ValueError(f"switch_interval_ms={switch_interval_ms!r}: give a positive number of "
                         "milliseconds (Python's default is 5), or None to leave it")
    if num_gpus is None:
        import torch
        num_gpus = 1 if torch.cuda.is_available() else 0
    replica = serve.deployment(SessionReplica, name=REPLICA).options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(request_router_class=SessionRouter))
    return Gateway.bind(replica.bind(model, None if cache_dir is None else str(cache_dir),
                                     device, full, threads, deadline_ms, lanes,
                                     max_ongoing_requests, direct_host, switch_interval_ms,
                                     gc_freeze),
                        model)
