"""``SessionReplica``: one Ray Serve replica (one GPU) holding a served model's compiled steps
and the sessions on them.

At start the replica builds the model, compiles its steps with the shared ``cache_dir`` and runs
the warm-up stream on every lane (``PoolEngine.warm``): a replica started after another has
written the cache loads every class and traces none. Every request is ``handle(token,
message)``: the session's token (``router.py`` routed the request here by it) and the client's
message as it came (``protocol.py``); the reply is the message to send back. A session lives on
this replica only: a token naming another replica is answered ``session_lost``, never served
from a fresh state. Each request runs in a worker thread of the replica's own (as many as
``max_ongoing_requests``), so the replica's event loop stays free for Serve's health checks and
the handle's queue-length probes while chunks compute, and chunks of different lanes overlap on
the device (``engine.py``). With ``direct_host`` the replica also serves the later requests of the
sessions opened with ``"direct": true`` on a WebSocket server of its own (``direct.py``), through
the same ``_handle``, each in its connection's own thread (no event loop, no worker pool).

Draining (``status(token, draining=True)``, which the gateway's ``POST /v1/drain`` sends to the
replicas it names): the replica opens no session, and each live session is closed at the end of
its turn (the reply to its ``last`` chunk says so, a ``reset`` is refused), so no conversation is
cut mid-turn; its stats say ``draining``, and ``drained`` once no session is left. Metrics go
through ``ray.util.metrics``: live sessions, draining, chunk latency, deadline misses, stock
fallbacks and lost sessions, tagged with the model and the replica.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from typing import Optional

import ray
import torch
from ray import serve

from .direct import DirectServer
from .engine import PoolEngine
from .host import GcPauses, LoopLag, freeze_start_up, process_settings
from .models import build
from .protocol import OPS, decode, encode, error
from .router import replica_of

__all__ = ["SessionReplica", "process_settings"]

log = logging.getLogger(__name__)
_LATENCY_MS = [5, 10, 20, 40, 80, 160, 320, 640, 1000, 2000, 5000]


class _Metrics:
    def __init__(self, model: str, replica: str):
        from ray.util import metrics
        keys = ("model", "replica")
        self.live = metrics.Gauge("cadence_fx_live_sessions", "sessions open on the replica",
                                  tag_keys=keys)
        self.latency = metrics.Histogram("cadence_fx_chunk_latency_ms",
                                         "a chunk's time on the replica", boundaries=_LATENCY_MS,
                                         tag_keys=keys)
        self.misses = metrics.Counter("cadence_fx_deadline_misses",
                                      "chunks slower than the audio they carry", tag_keys=keys)
        self.fallbacks = metrics.Counter("cadence_fx_fallbacks",
                                         "step calls that ran the stock step", tag_keys=keys)
        self.lost = metrics.Counter("cadence_fx_sessions_lost",
                                    "requests for a session whose replica is gone", tag_keys=keys)
        self.draining = metrics.Gauge("cadence_fx_draining", "1 while the replica drains",
                                      tag_keys=keys)
        for m in (self.live, self.latency, self.misses, self.fallbacks, self.lost, self.draining):
            m.set_default_tags({"model": model, "replica": replica})


class SessionReplica:
    def __init__(self, model: str, cache_dir: Optional[str] = None, device: str = "auto",
                 full: Optional[bool] = None, threads: Optional[int] = None,
                 deadline_ms: Optional[float] = None, lanes: int = 1, workers: int = 64,
                 direct_host: Optional[str] = None, switch_interval_ms: Optional[float] = None,
                 gc_freeze: bool = True):
        process_settings(threads, switch_interval_ms)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tag = serve.get_replica_context().replica_id.unique_id
        self.actor = ray.get_runtime_context().get_actor_name()
        self.model = build(model, device, cache_dir, full)
        self.engine = PoolEngine(self.model, lanes=lanes)   # the one seam to the sessions
        self.warm = self.engine.warm()
        # start-up's objects out of every later collection (host.py says why), then every
        # collection's pause and the event loop's lateness in the stats
        if gc_freeze:
            freeze_start_up()
        self.gc = GcPauses().install()
        self.loop_lag = LoopLag()
        self.deadline_ms = deadline_ms or self.model.deadline_ms
        self.draining, self.failed = False, None
        self.tally = {"chunks": 0, "deadline_misses": 0, "fallbacks": 0, "lost": 0}
        self.metrics = _Metrics(model, self.tag)
        self.metrics.live.set(0)
        self.metrics.draining.set(0)
        self._lock = threading.Lock()   # the tally
        self._workers = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"cadence-fx-{self.tag}")
        # the sessions' own connections (direct.py), started on the replica's event loop
        self.direct = DirectServer(direct_host, self._direct) if direct_host else None
        log.info("replica %s: %s on %s, %d lanes, warm %s", self.tag, model, device, lanes,
                 self.warm)

    async def check_health(self) -> None:
        self.loop_lag.start()
        if self.direct is not None:
            self.direct.start()
        if self.failed:
            raise RuntimeError(f"replica {self.tag} failed ({self.failed}); Serve restarts it and "
                               "its sessions are lost (their clients prime again)")

    async def status(self, token: str, draining: Optional[bool] = None) -> Optional[dict]:
        """This replica's stats, after setting its drain flag when ``draining`` is given; None
        when ``token`` names another replica (the one it names is gone)."""
        if replica_of(token) != self.tag:
            return None
        if draining is not None:
            self.draining = bool(draining)
            self.metrics.draining.set(int(self.draining))
            log.info("replica %s: draining %s, %d live sessions", self.tag, self.draining,
                     self.engine.live)
        return self.stats()

    async def handle(self, token: Optional[str], message: bytes, avoid=()) -> bytes:
        """One request (``avoid``: replicas the router skips for an open; not read here)."""
        arrived = time.perf_counter()
        self.loop_lag.start()
        if self.direct is not None:
            self.direct.start()   # before an open may hand out its address
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, self._handle, token, message, False,
                                          arrived)

    def _direct(self, message: bytes) -> bytes:
        """A request on a session's direct connection (its token in its header), in that
        connection's thread: its reply carries no ``wait_ms`` (no hop to wait for)."""
        return self._handle(None, message, True)

    def __del__(self) -> None:
        """Serve's graceful shutdown: the direct connections close (their clients raise
        ``SessionLost``), the listening socket with them."""
        direct = getattr(self, "direct", None)
        if direct is not None:
            direct.close()

    def _handle(self, token: Optional[str], message: bytes, direct: bool = False,
                arrived: Optional[float] = None) -> bytes:
        """One request, in a worker thread (``arrived``: when the event loop took it; a chunk's
        reply says how long it waited for this thread, ``wait_ms``) or in its direct
        connection's own thread (``arrived`` None)."""
        begun = time.perf_counter()
        wait_ms = None if arrived is None else (begun - arrived) * 1e3
        try:
            header, tensors = decode(message)
        except ValueError as e:
            return error("bad_request", str(e), token)
        op = header.get("op")
        if direct:
            token = header.get("session")
            if op == "open":
                return error("bad_request", "open sessions through the gateway (/v1/stream) with "
                             '"direct": true; a direct connection carries their later requests')
            if op in OPS and replica_of(token) != self.tag:
                return error("bad_request", f"this direct connection is replica {self.tag}'s; "
                             f"send the requests of session {token!r} to the address its own "
                             "open returned, or through the gateway", token)
        if op not in OPS:
            return error("bad_request", f"unknown op {op!r}; send one of {', '.join(OPS)}", token)
        if op == "stats":
            return encode({"op": "stats", "session": token, "stats": self.stats()})
        if op == "open":
            return self._open(header, tensors)
        sid = self._session(token)
        if isinstance(sid, bytes):
            return sid
        try:
            if op == "chunk":
                return self._chunk(token, sid, header, tensors, wait_ms, begun)
            return getattr(self, "_" + op)(token, sid, header, tensors)
        except (ValueError, TypeError, KeyError) as e:   # the request, not the replica
            return error("bad_request", str(e), token)
        except Exception as e:  # noqa: BLE001 - the carries may be inconsistent: restart
            self.failed = f"{type(e).__name__}: {e}"
            log.exception("replica %s: %s of %s failed", self.tag, op, token)
            return error("failed", f"the replica failed ({self.failed}) and will restart; "
                         "open a new session", token)

    def stats(self) -> dict:
        return {"replica": self.tag, "actor": self.actor, "model": self.model.name,
                "live_sessions": self.engine.live, "draining": self.draining,
                "drained": self.draining and not self.engine.live, "lanes": self.engine.lanes,
                "deadline_ms": self.deadline_ms, "warm": self.warm,
                "switch_interval_ms": sys.getswitchinterval() * 1e3,
                "counters": self.engine.counters(), **self.tally, **self.gc.report(),
                **self.loop_lag.report()}

    # -- the operations ---------------------------------------------------------------------
    def _open(self, header, tensors) -> bytes:
        if self.draining:
            return error("draining", f"replica {self.tag} is draining and opens no session; "
                         "open again once a replica that does not drain is up", replica=self.tag)
        seed = header.get("seed")
        if seed is not None and not isinstance(seed, int):
            return error("bad_request", f"seed {seed!r} is not an integer; send an int or null")
        direct = bool(header.get("direct", False))
        if direct and (self.direct is None or self.direct.url is None):
            return error("bad_request", "this deployment serves no direct connections: open "
                         "without \"direct\", or serve with build_app(direct_host=...) "
                         "(cadence-fx serve --direct)")
        try:
            sid = self.engine.open(tensors, seed=seed)
        except ValueError as e:
            return error("bad_request", str(e))
        self.metrics.live.set(self.engine.live)
        reply = {"op": "opened", "session": f"{self.tag}:{sid}", "replica": self.tag,
                 "actor": self.actor, "warm": self.warm}
        if direct:
            reply["direct"] = self.direct.url
        return encode(reply)

    def _chunk(self, token, sid, header, tensors, wait_ms=None, begun=None) -> bytes:
        last = bool(header.get("last", False))
        outputs, record = self.engine.chunk(sid, tensors, last)
        self._count(record)
        reply = {"op": "out", "session": token, "replica": self.tag, "ms": round(record.ms, 3),
                 "fallbacks": record.fallbacks}
        if wait_ms is not None:   # from the event loop to this worker thread
            reply["wait_ms"] = round(wait_ms, 3)
        if begun is not None:   # this thread's time on the request besides the chunk's own:
            # decoding it, finding the session, the metrics (the reply's encoding comes after)
            reply["around_ms"] = round((time.perf_counter() - begun) * 1e3 - record.ms, 3)
        if last and self.draining:   # the turn ended: the session ends with it
            self.engine.close(sid)
            self.metrics.live.set(self.engine.live)
            reply["closed"] = "draining"
        return encode(reply, outputs)

    def _reset(self, token, sid, header, tensors) -> bytes:
        if self.draining:
            self.engine.close(sid)
            self.metrics.live.set(self.engine.live)
            return error("draining", f"replica {self.tag} is draining: session {token} ended "
                         "with its turn; open a new session (on another replica)", token)
        self.engine.reset(sid)
        return encode({"op": "reset", "session": token})

    def _close(self, token, sid, header, tensors) -> bytes:
        self.engine.close(sid)
        self.metrics.live.set(self.engine.live)
        return encode({"op": "closed", "session": token})

    def _session(self, token):
        """The engine's id of the session ``token`` names, or the error reply to send."""
        owner = replica_of(token)
        if owner is None:
            return error("bad_request", f"session {token!r} is not a session token; send the "
                         "'session' an 'opened' reply gave")
        if owner != self.tag:
            with self._lock:
                self.tally["lost"] += 1
            self.metrics.lost.inc()
            return error("session_lost", f"session {token} lived on replica {owner}, which is "
                         f"gone (this is replica {self.tag}), and its state with it; open a new "
                         "session and prime it again", token)
        n = token.split(":", 1)[1]
        if not n.isdigit() or not self.engine.holds(int(n)):
            return error("unknown_session", f"replica {self.tag} holds no session {token} (it "
                         "was closed, or never opened); open a new one", token)
        return int(n)

    def _count(self, record) -> None:
        with self._lock:
            self._tally(record)

    def _tally(self, record) -> None:
        self.tally["chunks"] += 1
        self.metrics.latency.observe(record.ms)
        if record.ms > self.deadline_ms:
            self.tally["deadline_misses"] += 1
            self.metrics.misses.inc()
        if record.fallbacks:
            self.tally["fallbacks"] += record.fallbacks
            self.metrics.fallbacks.inc(record.fallbacks)
