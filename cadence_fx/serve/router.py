"""``SessionRouter``: a Ray Serve request router that sends every request of a session to the
replica that holds it, and never to another one in its place.

A session's token is ``"<replica>:<n>"``, the unique id of the replica that opened it and its
number there. A request whose first argument is a token goes to that replica alone (rank one,
no fallback rank: when it is busy the request waits, it is not moved). When that replica is not
among the candidates (it died; a restarted replica has a new id), the request goes to any live
replica, which holds no such session and answers ``session_lost``: the client hears of the loss
at its next chunk and primes a new session. A request without a token (``open``) goes to the
replicas in turn, the next ones ranked after as fallbacks.

Ray's ``ConsistentHashRouter`` (``x-session-id``) is not used: adding a replica changes the ring
and so the replica of sessions that live on, and its fallback on backpressure moves a session to
a replica without its state.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ["SessionRouter", "replica_of"]


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
        if pending_request is not None:   # a busy owner: wait with backoff, never spin
            pending_request.routing_context.should_backoff = True
        args = pending_request.args if pending_request is not None else ()
        owner = replica_of(args[0]) if args else None
        if owner is not None:
            held = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
            return [held] if held else [candidate_replicas]
        if not args:   # a routing task without a request: it assigns no request
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ranked)
        ranked = ranked[first:] + ranked[:first]
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]
