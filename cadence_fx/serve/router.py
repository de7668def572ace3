"""``SessionRouter``: a Ray Serve request router that sends every request of a session to the
replica that holds it, and never to another one in its place.

A session's token is ``"<replica>:<n>"``, the unique id of the replica that opened it and its
number there. A request whose first argument is a token goes to that replica alone (rank one,
no fallback rank: when it is busy the request waits, it is not moved). When that replica is not
among the candidates (it died; a restarted replica has a new id), the request goes to any live
replica, which holds no such session and answers ``session_lost``: the client hears of the loss
at its next chunk and primes a new session. A request without a token (``open``) goes to the
replicas in turn, the next ones ranked after as fallbacks, skipping the replicas named in its
``avoid`` keyword (draining ones; when every replica is to be avoided, any one answers).

Ray's ``ConsistentHashRouter`` (``x-session-id``) is not used: adding a replica changes the ring
and so the replica of sessions that live on, and its fallback on backpressure moves a session to
a replica without its state.

Routing tasks. Serve's base routing loop (Ray 2.56) assumes a router that may hand any pending
request to the replica it found (``FIFOMixin``). A pinning router cannot, and the base loop then
(a) lets a task retire after it took a request off the queue but before it placed it, so the
request waits forever (ray-project/ray#66325), and (b) keeps a task with no request of its own
choosing replicas in a loop that never yields to the event loop, until a queue-length cache
entry expires (10 s): every other request of the handle stalls that long, and the replicas'
queue-length probes miss their 0.1 s deadline. ``_fulfill_pending_requests`` below keeps each
task on the request it took until it is placed (or cancelled) and retires a task that has none,
as Ray's own ``ConsistentHashRouter`` does.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ["SessionRouter", "replica_of"]

log = logging.getLogger("ray.serve")


def replica_of(token) -> Optional[str]:
    """The replica id a session token names, or None for a request that opens a session."""
    if not isinstance(token, str) or ":" not in token:
        return None
    return token.split(":", 1)[0]


class SessionRouter(RequestRouter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:   # no request to place (see the module docstring)
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True   # a busy owner: wait, never spin
        args = pending_request.args
        owner = replica_of(args[0]) if args else None
        if owner is not None:
            held = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
            return [held] if held else [candidate_replicas]
        avoid = set(pending_request.kwargs.get("avoid") or ())
        ranked = sorted((r for r in candidate_replicas if r.replica_id.unique_id not in avoid),
                        key=lambda r: r.replica_id.unique_id)
        if not ranked:   # every replica drains: one of them refuses the open
            return [candidate_replicas]
        first = next(self._turn) % len(ranked)
        ranked = ranked[first:] + ranked[:first]
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]

    # -- Serve's routing loop, made safe for a router that never reassigns a request ----------
    async def _fulfill_pending_requests(self):
        try:
            while len(self._routing_tasks) <= self.target_num_routing_tasks:
                pending = self._get_next_pending_request_to_route()
                if pending is None:   # nothing of its own to place: retire
                    self._drop_finished()
                    return
                await self._place(pending)
        except Exception:  # noqa: BLE001 - as Serve's loop: log it, the handle starts another task
            log.exception("SessionRouter: a routing task failed")
        finally:
            self._routing_tasks.remove(asyncio.current_task(loop=self._event_loop))
            self.num_routing_tasks_gauge.set(self.curr_num_routing_tasks)

    async def _place(self, pending: PendingRequest) -> None:
        """Route ``pending`` until it has a replica or its caller gave up on it."""
        choices = self._choose_replicas_with_backoff(pending)
        attempt = 0
        try:
            async for candidates in choices:
                self._drop_finished()
                if pending.future.done():   # cancelled by its caller
                    return
                replica = await self._select_from_candidate_replicas(candidates, attempt)
                if replica is not None:
                    self._fulfill_next_pending_request(replica, pending.metadata)
                    return
                attempt += 1
        finally:
            await choices.aclose()

    def _drop_finished(self) -> None:
        """Pop placed or cancelled requests off the front of the queue that counts routing
        tasks (Serve cleans it lazily)."""
        queue = self._pending_requests_to_fulfill
        while queue and queue[0].future.done():
            queue.popleft()
