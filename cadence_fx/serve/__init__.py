"""cadence_fx sessions served through Ray Serve (``pip install cadence_fx[serve]``).

One replica per GPU holds a compiled step and its sessions (``replica.py``), warm from a shared
compile cache; a session stays on its replica for life (``router.py``); a FastAPI WebSocket
ingress streams chunks in and out (``gateway.py``, protocol in ``docs/serving.md``); a Python
client ships with it (``client.py``). ``cadence-fx serve --model toy --replicas 2`` runs it.
"""
__all__ = ["build_app", "StreamClient", "Session", "SessionLost", "ServeError"]


def __getattr__(name):   # Ray loads only for the application; the client needs none of it
    if name == "build_app":
        from .gateway import build_app
        return build_app
    if name in ("StreamClient", "Session"):
        from . import client
        return getattr(client, name)
    if name in ("SessionLost", "ServeError"):
        from . import protocol
        return getattr(protocol, name)
    raise AttributeError(name)
