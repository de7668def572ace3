"""``cadence-fx serve``: a local Ray cluster serving one model, until Ctrl-C drains and stops it.

Starts Ray (or joins ``--address``), Serve's HTTP proxy on ``--host:--port``, and the application
(``gateway.build_app``) with the compile cache at ``--cache-dir``. Ctrl-C (or SIGTERM) redeploys it
draining: no new sessions, live ones end with their turn; once none is left (or after
``--drain-timeout`` seconds) Serve shuts down.
"""
from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request

__all__ = ["serve_locally"]


def _live(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/health", timeout=10) as r:
        return json.loads(r.read())["live_sessions"]


def serve_locally(args) -> int:
    import ray
    from ray import serve
    from cadence_fx.compile_cache import default_dir
    from .gateway import build_app
    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    kw = dict(cache_dir=str(args.cache_dir or default_dir()), num_gpus=args.gpus,
              num_cpus=args.cpus, full=args.full)
    serve.run(build_app(args.model, args.replicas, **kw), name="cadence_fx", route_prefix="/")
    url = f"http://{args.host}:{args.port}"
    print(f"serving {args.model} on ws://{args.host}:{args.port}/v1/stream with {args.replicas} "
          f"replicas (health: {url}/v1/health); Ctrl-C drains and stops", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    print("draining: no new sessions; live ones end with their turn", file=sys.stderr, flush=True)
    serve.run(build_app(args.model, args.replicas, draining=True, **kw), name="cadence_fx",
              route_prefix="/")
    deadline = time.monotonic() + args.drain_timeout
    while time.monotonic() < deadline and _live(url):
        time.sleep(1)
    serve.shutdown()
    return 0
