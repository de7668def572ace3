"""What carrying one Token2Wav reply costs, without a model: the wire format and the WebSocket.

    python bench/ws_roundtrip.py --out bench/results/DATE-cpu-ws-roundtrip.json [--clients 1,8,28]

Two parts, on this machine, in one process:

- ``codec``: encoding and decoding a reply (``mel`` (1, 80, 50) and ``pcm`` (1, 28000), float32,
  130 KB) with ``cadence_fx.serve.protocol`` (raw bytes) against ``torch.save``/``torch.load``
  (the format before 2026-12-03), medians over ``--calls``.
- ``roundtrip``: K clients, each a thread with a connection of its own, send a small request to
  an echo server on loopback (``websockets.sync``, a thread per connection) that answers with the
  encoded reply; per K, with per-message deflate on both ends (``websockets``' default, what
  ``cadence_fx.serve`` ran before 2026-12-03) and off (now), the round trip's p50/p99 over
  ``--rounds`` rounds after 5, with and without decoding the reply. Clients and server share this
  machine's cores, as a replica's lanes and its connections share its process.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import io
import json
import os
import platform
import statistics
import threading
import time

import torch

from cadence_fx.serve.host import percentiles
from cadence_fx.serve.protocol import decode, encode

REPLY = {"mel": torch.randn(1, 80, 50, generator=torch.Generator().manual_seed(0)),
         "pcm": torch.randn(1, 28000, generator=torch.Generator().manual_seed(1))}


def _median_ms(fn, calls):
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def codec(calls):
    raw = encode({"op": "out"}, REPLY)
    buf = io.BytesIO()
    torch.save(REPLY, buf)
    saved = buf.getvalue()
    return {"bytes_raw": len(raw), "bytes_torch_save": len(saved),
            "encode_ms": _median_ms(lambda: encode({"op": "out"}, REPLY), calls),
            "decode_ms": _median_ms(lambda: decode(raw), calls),
            "torch_save_ms": _median_ms(lambda: torch.save(REPLY, io.BytesIO()), calls),
            "torch_load_ms": _median_ms(
                lambda: torch.load(io.BytesIO(saved), weights_only=True), calls)}


def roundtrip(k, rounds, compression, decoded):
    from websockets.sync.client import connect
    from websockets.sync.server import serve
    reply, request = encode({"op": "out"}, REPLY), encode({"op": "chunk"})
    ext = "deflate" if compression else None

    def echo(ws):
        for _ in ws:
            ws.send(reply)

    with serve(echo, "127.0.0.1", 0, max_size=None, ping_interval=None, compression=ext) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"ws://127.0.0.1:{srv.socket.getsockname()[1]}"
        conns = [connect(url, max_size=None, ping_interval=None, compression=ext).__enter__()
                 for _ in range(k)]
        assert all(bool(c.protocol.extensions) == compression for c in conns)
        ms = []

        def one(i):
            t = time.perf_counter()
            conns[i].send(request)
            message = conns[i].recv()
            if decoded:
                decode(message)
            return (time.perf_counter() - t) * 1e3

        with concurrent.futures.ThreadPoolExecutor(k) as pool:
            for r in range(rounds + 5):
                out = list(pool.map(one, range(k)))
                if r >= 5:
                    ms += out
        for c in conns:
            c.close()
        srv.shutdown()
    p50, p99 = percentiles(ms)
    return {"clients": k, "deflate": compression, "decoded": decoded, "p50_ms": p50,
            "p99_ms": p99}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", default="1,8,28")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    rows = [roundtrip(int(k), args.rounds, compression, decoded)
            for k in args.clients.split(",") for compression in (True, False)
            for decoded in (False, True)]
    for row in rows:
        print(json.dumps(row), flush=True)
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "commit": os.environ.get("CADENCE_COMMIT", "unknown"),
              "codec": codec(args.calls), "roundtrip": rows,
              "date": datetime.date.today().isoformat()}
    print(json.dumps(result["codec"]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
