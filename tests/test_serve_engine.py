"""cadence_fx.serve without Ray: the wire format keeps tensors bit for bit and names what is
malformed; the engine (the replica's seam to its SessionPools) keeps interleaved sessions exact
against each one run alone on the stock step, across a turn reset, a partial flush and a longer
last call; a second engine on the same compile cache traces nothing."""
import json
import os
import struct
import threading

import pytest
import torch

from cadence_fx.serve.engine import PoolEngine
from cadence_fx.serve.models import StockSession, build
from cadence_fx.serve.protocol import SessionLost, decode, encode, error, raise_for

WIDTHS = [8, 8, 8, 4, 8, 8, 10]   # a turn ending in a partial flush, then one ending longer
RESET_AFTER, LAST = 3, (3, 6)


def stream(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(1, w, 256, generator=g)} for w in WIDTHS]


def test_messages_keep_tensors_exact_and_errors_name_the_fix():
    x = {"a": torch.randn(3, 5), "b": torch.arange(4)}
    header, out = decode(encode({"op": "chunk", "session": "r:1"}, x))
    assert header == {"op": "chunk", "session": "r:1"}
    assert all(torch.equal(out[k], x[k]) and out[k].dtype == x[k].dtype for k in x)
    with pytest.raises(ValueError, match="binary"):
        decode("text")
    with pytest.raises(ValueError, match="header length"):
        decode(b"\x00\x00\x01\x00{}")
    with pytest.raises(SessionLost, match="prime"):
        raise_for(decode(error("session_lost", "open a new session and prime it again", "r:1"))[0])


def test_every_dtype_travels_as_its_exact_bytes_and_a_bad_listing_names_the_fix():
    nan = torch.tensor([float("nan")]).view(torch.int32).add_(7).view(torch.float32)  # payload
    x = {"f": torch.randn(4, 6).t(), "h": torch.randn(3, dtype=torch.bfloat16),
         "n": nan, "b": torch.tensor([True, False]), "s": torch.tensor(2.5),
         "e": torch.empty(0, 3, dtype=torch.int16), "i": torch.arange(5, dtype=torch.uint8)}
    header, out = decode(encode({"op": "out"}, x))
    assert header == {"op": "out"} and list(out) == list(x)
    for k in x:   # bit for bit: the NaN's payload too
        assert out[k].dtype == x[k].dtype and out[k].shape == x[k].shape
        assert out[k].is_contiguous()
        a, b = out[k].contiguous(), x[k].contiguous()
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    message = encode({"op": "chunk"}, {"a": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="past the tensors"):
        decode(message + b"\0")
    with pytest.raises(ValueError, match="needs 24 bytes"):
        decode(message[:-1])
    for entry, match in ((["a", "float8", [2]], "dtype 'float8'"),
                         (["a", "float32", [-1]], "shape a list of sizes"),
                         ("a", "not \\[name, dtype, shape\\]")):
        head = json.dumps({"op": "chunk", "tensors": [entry]}).encode()
        with pytest.raises(ValueError, match=match):
            decode(struct.pack(">I", len(head)) + head)
    head = json.dumps({"op": "chunk", "tensors": [["a", "uint8", [1]], ["a", "uint8", [1]]]})
    with pytest.raises(ValueError, match="twice"):
        decode(struct.pack(">I", len(head)) + head.encode() + b"\1\2")
    with pytest.raises(ValueError, match="does not carry"):
        encode({"op": "chunk"}, {"q": torch.zeros(2, dtype=torch.float8_e4m3fn)})


def test_connections_run_without_per_message_compression():
    """Clients offer no deflate and the direct server accepts none, even from a client that
    offers it: float audio barely compresses and deflating it costs milliseconds a reply."""
    from websockets.sync.client import connect
    from websockets.sync.server import serve
    from cadence_fx.serve.client import _connect
    from cadence_fx.serve.direct import DirectServer

    server = DirectServer("127.0.0.1", lambda message: message)
    url = server.start()
    try:
        ours = _connect(url, 30)
        with connect(url, ping_interval=None) as theirs:   # websockets offers deflate by default
            for ws in (ours, theirs):
                ws.send(b"x" * 1000)
                assert ws.recv(timeout=30) == b"x" * 1000
                assert ws.protocol.extensions == []
        ours.close()
        with serve(lambda c: c.send(c.recv()), "127.0.0.1", 0) as plain:   # accepts deflate
            threading.Thread(target=plain.serve_forever, daemon=True).start()
            ours = _connect(f"ws://127.0.0.1:{plain.socket.getsockname()[1]}", 30)
            ours.send(b"y")
            assert ours.recv(timeout=30) == b"y" and ours.protocol.extensions == []
            ours.close()
            plain.shutdown()
    finally:
        server.close()


def test_direct_connections_run_in_their_own_threads_and_close_with_the_server():
    """Each connection's requests run in a thread of its own, not on an event loop (a slow
    request on one connection does not hold another's), and ``close`` ends every connection:
    its client sees the connection closed (``SessionLost`` in ``client.py``)."""
    from websockets.exceptions import ConnectionClosed
    from cadence_fx.serve.client import _connect
    from cadence_fx.serve.direct import DirectServer

    release, threads = threading.Event(), []

    def serve(message):
        threads.append(threading.current_thread().name)
        if message == b"slow":
            assert release.wait(30)
        return message

    server = DirectServer("127.0.0.1", serve)
    assert server.start() == server.start()   # once
    slow, fast = _connect(server.url, 30), _connect(server.url, 30)
    try:
        slow.send(b"slow")
        fast.send(b"fast")
        assert fast.recv(timeout=30) == b"fast"   # while the slow request still runs
        release.set()
        assert slow.recv(timeout=30) == b"slow"
        assert len(set(threads)) == 2 and threading.main_thread().name not in threads
        server.close()
        for ws in (slow, fast):
            with pytest.raises(ConnectionClosed):
                ws.send(b"after")
                ws.recv(timeout=30)
    finally:
        release.set()
        slow.close()
        fast.close()
        server.close()


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-cache")


def test_interleaved_sessions_equal_stock_alone(toy_cache):
    model = build("toy", cache_dir=toy_cache)
    engine = PoolEngine(model)
    warm = engine.warm()
    assert (warm["traces"], warm["fallbacks"]) == (4, 0)
    ids = [engine.open(seed=s) for s in range(3)]
    refs = [StockSession(model, seed=s) for s in range(3)]
    inputs = [stream(model, s) for s in range(3)]
    for i in range(len(WIDTHS)):
        for sid, ref, xs in zip(ids, refs, inputs):
            if i == RESET_AFTER + 1:
                engine.reset(sid)
                ref.reset()
            out, record = engine.chunk(sid, xs[i], last=i in LAST)
            assert torch.equal(out["y"], ref.chunk(xs[i], last=i in LAST)["y"])
            assert record.fallbacks == 0   # the partial flush is a class of its own
    assert engine.live == 3 and engine.pools["step"].swaps > 0
    for sid in ids:
        engine.close(sid)
    assert engine.live == 0


def test_a_second_engine_on_the_cache_traces_nothing(toy_cache):
    build("toy", cache_dir=toy_cache)   # the cache the test above filled (or fill it here)
    PoolEngine(build("toy", cache_dir=toy_cache)).warm()
    warm = PoolEngine(build("toy", cache_dir=toy_cache)).warm()
    assert warm["traces"] == 0 and warm["cache_loads"] == 4


def test_bad_inputs_name_what_to_send():
    model = build("toy")
    engine = PoolEngine(model)
    sid = engine.open()
    with pytest.raises(ValueError, match="'x'"):
        engine.chunk(sid, {"y": torch.zeros(1, 8, 256)})
    with pytest.raises(ValueError, match=r"shape \(1, None, 256\)"):
        engine.chunk(sid, {"x": torch.zeros(8, 256)})
    with pytest.raises(KeyError, match="open"):
        engine.chunk(sid + 1, {"x": torch.zeros(1, 8, 256)})


def test_lanes_and_threads_keep_every_session_exact(toy_cache):
    """Two lanes, four sessions sent from four threads at once (as a replica's worker threads
    do): each session lives on one lane and equals itself run alone on the stock step."""
    import concurrent.futures
    model = build("toy", cache_dir=toy_cache)
    engine = PoolEngine(model, lanes=2)
    warm = engine.warm()
    assert warm["fallbacks"] == 0 and warm["calls"] == 2 * model.warm_chunks
    ids = [engine.open(seed=50 + s) for s in range(4)]
    assert sorted(engine.lane_of(sid) for sid in ids) == [0, 0, 1, 1]

    def play(k):
        ref, outs = StockSession(model, seed=50 + k), []
        for i, x in enumerate(stream(model, 50 + k)):
            if i == RESET_AFTER + 1:
                engine.reset(ids[k])
            out, _ = engine.chunk(ids[k], x, last=i in LAST)
            outs.append((out["y"], ref, x, i))
        return outs

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        played = list(pool.map(play, range(4)))
    for outs in played:   # the stock references after the threads: they share the module
        for y, ref, x, i in outs:
            if i == RESET_AFTER + 1:
                ref.reset()
            assert torch.equal(y, ref.chunk(x, last=i in LAST)["y"]), i
    assert all(p.lanes[1].compiled.counters.compiled_calls > 0 for p in engine.pools.values())
    for sid in ids:
        engine.close(sid)
    assert engine.live == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (lane streams)")
def test_a_chunk_waits_for_the_device_asleep_and_exact(monkeypatch, tmp_path):
    """On CUDA a chunk's thread waits for its lane on a blocking event (it sleeps; a plain
    event's wait spins a core per lane), and the chunk still equals stock alone."""
    model = build("toy", "cuda", str(tmp_path))
    engine = PoolEngine(model, lanes=2)
    engine.warm()
    real, made = torch.cuda.Event, []

    def event(*args, **kwargs):
        made.append(kwargs.get("blocking", args[1] if len(args) > 1 else False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", event)
    sid = engine.open(seed=7, lane=1)
    ref = StockSession(model, seed=7)
    for i, x in enumerate(stream(model, 7)[:3]):
        out, _ = engine.chunk(sid, x)
        assert torch.equal(out["y"], ref.chunk(x)["y"].cpu()), i
    assert made and all(made), made   # every chunk's wait: blocking
    assert engine.pools["step"].lanes[1].compiled.counters.replays > 0


def test_a_started_cluster_hands_replies_over_inline_unless_told_otherwise(monkeypatch):
    """``cadence-fx serve`` raises Ray's inline-result limit above a Token2Wav reply (112 KB) for
    the cluster it starts, and keeps a limit the user set."""
    from cadence_fx.serve.launch import INLINE_REPLY_BYTES, inline_replies
    monkeypatch.delenv("RAY_max_direct_call_object_size", raising=False)
    inline_replies()
    assert int(os.environ["RAY_max_direct_call_object_size"]) == INLINE_REPLY_BYTES > 112_000
    monkeypatch.setenv("RAY_max_direct_call_object_size", "50000")
    inline_replies()
    assert os.environ["RAY_max_direct_call_object_size"] == "50000"


def test_a_direct_address_the_client_cannot_reach_closes_the_session_and_says_why():
    """The replica opened the session, but its direct server is out of the client's reach: the
    session is closed through the gateway (not left open on the replica) and the error names the
    address and the fix."""
    pytest.importorskip("websockets")
    import socket
    from cadence_fx.serve.client import ServeError, Session
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sent = []
    client = type("Client", (), {
        "timeout": 5.0, "request": lambda self, header, tensors=None: sent.append(header)})()
    opened = {"session": "r1:0", "replica": "r1", "direct": f"ws://127.0.0.1:{port}"}
    with pytest.raises(ServeError, match=f"at ws://127.0.0.1:{port}, which this client cannot"):
        Session(client, opened)
    assert sent == [{"op": "close", "session": "r1:0"}]


def test_a_direct_open_on_a_deployment_without_direct_connections_says_how_to_serve_them():
    pytest.importorskip("ray.serve")
    from cadence_fx.serve.replica import SessionReplica
    replica = object.__new__(SessionReplica)   # the state _open reads, without a Serve replica
    replica.direct, replica.draining = None, False
    header, _ = decode(replica._open({"op": "open", "direct": True}, {}))
    assert header["code"] == "bad_request" and "build_app(direct_host=...)" in header["message"]


def test_a_replicas_switch_interval_is_set_for_its_process_and_checked():
    """``switch_interval_ms`` (``build_app``, ``cadence-fx serve --switch-interval-ms``): the
    replica's ``sys.setswitchinterval``; a value that is not a positive number of milliseconds is
    refused before anything starts."""
    import sys
    pytest.importorskip("ray.serve")
    from cadence_fx.serve import build_app
    from cadence_fx.serve.host import process_settings
    before = sys.getswitchinterval()
    try:
        process_settings(None, 0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        process_settings(None, None)   # left as it is
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive number of milliseconds"):
            process_settings(None, bad)
        with pytest.raises(ValueError, match="positive number of milliseconds"):
            build_app("toy", switch_interval_ms=bad)
    assert sys.getswitchinterval() == before
