"""cadence_fx.serve on a local Ray cluster (``ray.init(num_cpus=2)``), the toy model, 2 replicas,
one cluster for the module: sessions stay on their replicas and are bit-exact over the WebSocket
against each session run alone on the stock step; a replica killed mid-stream gives its sessions
``session_lost`` while the others go on exact; a restarted replica loads its classes from the
shared compile cache and traces none; a load of three concurrent clients per replica on loopback,
every session exact and no chunk stalled; draining a replica in place (no redeploy: the
WebSocket stays open) lets its live sessions end their turn while new sessions open on the other
replica; one's own model (the tests' speaker-prompted decoder) served by its import path, exact.
Skipped when Ray is not installed (``pip install .[serve]``)."""
import collections
import concurrent.futures
import json
import os
import pathlib
import socket
import time
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("websockets")

from cadence_fx.serve import ServeError, SessionLost, StreamClient, build_app  # noqa: E402
from cadence_fx.serve.models import StockSession, build  # noqa: E402

pytestmark = pytest.mark.slow
WIDTHS = [8, 8, 8, 4, 8, 8, 10]   # a turn ending in a partial flush, then one ending longer
LAST = (3, 6)


class Cluster:
    def __init__(self, port, cache_dir):
        self.port, self.cache_dir = port, str(cache_dir)
        self.url = f"ws://127.0.0.1:{port}/v1/stream"

    def deploy(self):
        serve.run(build_app("toy", 2, cache_dir=self.cache_dir, num_cpus=0.5, threads=1,
                            direct_host="127.0.0.1"), name="cfx", route_prefix="/")

    def health(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health", timeout=30) as r:
            return json.loads(r.read())

    def drain(self, replicas=None, draining=True):
        body = json.dumps({"replicas": replicas, "draining": draining}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/drain", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def replicas(self, n=2, gone=(), timeout=120):
        """The replicas' stats once ``n`` are up and none of ``gone`` is among them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.health()["replicas"]
            if len(up) == n and not set(gone) & set(up):
                return up
            time.sleep(0.5)
        raise AssertionError(f"replicas {sorted(up)} after {timeout} s (wanted {n}, not {gone})")

    def kill(self, stats, timeout=30):
        """Kill a replica's actor and wait until it is dead (a direct connection's next request
        could otherwise still reach it)."""
        ray.kill(ray.get_actor(stats["actor"], namespace="serve"), no_restart=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get_actor(stats["actor"], namespace="serve")
            except ValueError:
                return
            time.sleep(0.1)
        raise AssertionError(f"replica {stats['replica']} still alive {timeout} s after its kill")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(pathlib.Path(__file__).parent)   # the replicas import the tests' own model
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, path]))
    try:   # Ray's processes start with this environment
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        c = Cluster(port, tmp_path_factory.mktemp("serve-cache"))
        c.deploy()
        c.replicas()
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def toy():
    torch.set_num_threads(1)   # as the replicas run it
    return build("toy")


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(1, w, 256, generator=g)} for w in WIDTHS]


def play(session, ref, xs, chunks):
    """Run ``chunks`` of a stream on the served session and on the stock reference; every
    output equal, every reply from the session's own replica."""
    for i in chunks:
        if i == LAST[0] + 1:
            session.reset()
            ref.reset()
        out = session.chunk(last=i in LAST, **xs[i])
        assert session.last_reply["replica"] == session.replica
        if session.direct is None:   # from the replica's loop to its worker thread
            assert session.last_reply["wait_ms"] >= 0
        else:   # run in its connection's own thread: no hop
            assert "wait_ms" not in session.last_reply
        assert session.last_reply["around_ms"] >= 0   # the replica's time besides the chunk's
        assert torch.equal(out["y"], ref.chunk(xs[i], last=i in LAST)["y"]), (session.token, i)


def test_sessions_stay_on_their_replicas_and_are_exact(cluster, toy):
    with StreamClient(cluster.url) as a, StreamClient(cluster.url) as b:
        sessions = [(a if s % 2 else b).open(seed=s) for s in range(4)]
        assert len({s.replica for s in sessions}) == 2   # opened on the replicas in turn
        refs = [StockSession(toy, seed=s) for s in range(4)]
        streams = [inputs(s) for s in range(4)]
        for i in range(len(WIDTHS)):   # interleaved, chunk by chunk
            for s, ref, xs in zip(sessions, refs, streams):
                play(s, ref, xs, [i])
        for s in sessions:
            s.close()
            with pytest.raises(ServeError, match="unknown_session"):
                s.chunk(**streams[0][0])


def test_direct_sessions_are_exact_and_their_connections_serve_them_only(cluster, toy):
    """Sessions opened with ``direct``: every later request on a connection to the replica's own
    server, none through the gateway; exact against stock alone across the reset; a direct
    connection refuses another replica's session and an open."""
    with StreamClient(cluster.url) as client:
        sessions = [client.open(seed=50 + s, direct=True) for s in range(2)]
        assert len({s.replica for s in sessions}) == 2
        assert all(s.direct.startswith("ws://127.0.0.1:") for s in sessions)
        assert sessions[0].direct != sessions[1].direct
        for k, s in enumerate(sessions):
            play(s, StockSession(toy, seed=50 + k), inputs(50 + k), range(len(WIDTHS)))
        a, b = sessions
        with pytest.raises(ServeError, match=f"direct connection is replica {b.replica}'s"):
            b.request({"op": "reset", "session": a.token})
        with pytest.raises(ServeError, match="open sessions through the gateway"):
            b.request({"op": "open", "seed": 1})
        stats = a.stats()
        assert stats["replica"] == a.replica   # its own replica's, over its connection
        # its start-up frozen out of later collections; collections and the loop's lag sampled
        assert stats["gc_frozen_objects"] > 10_000 and stats["gc_collections"] >= 0
        assert stats["loop_lag_ms_p50"] is not None and stats["loop_lag_ms_max"] >= 0
        for s in sessions:
            s.close()
        assert sessions[0]._ws is None


def test_a_killed_replica_loses_its_sessions_and_the_others_go_on(cluster, toy):
    """Through the gateway and over direct connections (seeds 14 and 15)."""
    with StreamClient(cluster.url) as client:
        sessions = [client.open(seed=10 + s) for s in range(4)]
        sessions += [client.open(seed=14 + s, direct=True) for s in range(2)]
        assert len({s.replica for s in sessions[4:]}) == 2
        refs = [StockSession(toy, seed=10 + s) for s in range(6)]
        streams = [inputs(10 + s) for s in range(6)]
        for s, ref, xs in zip(sessions, refs, streams):
            play(s, ref, xs, range(2))
        victim = sessions[0].stats()
        cluster.kill(victim)
        for s, ref, xs in zip(sessions, refs, streams):
            if s.replica == victim["replica"]:
                with pytest.raises(SessionLost, match="prime it again") as lost:
                    s.chunk(**xs[2])
                assert lost.value.session == s.token
            else:
                play(s, ref, xs, range(2, len(WIDTHS)))
                s.close()
        again = client.open(seed=10)   # primed again, on a live replica
        assert again.replica != victim["replica"]
        play(again, StockSession(toy, seed=10), streams[0], range(len(WIDTHS)))
        again.close()
    cluster.replicas(gone=[victim["replica"]])


def test_a_restarted_replica_loads_its_classes_without_tracing(cluster, toy):
    before = cluster.replicas()
    victim = next(iter(before.values()))
    cluster.kill(victim)
    after = cluster.replicas(gone=[victim["replica"]])
    new = [s for tag, s in after.items() if tag not in before]
    assert len(new) == 1
    warm = new[0]["warm"]
    assert warm["traces"] == 0 and warm["cache_loads"] > 0, warm
    assert warm["compiled_loads"] == warm["cache_loads"] and warm["fallbacks"] == 0
    with StreamClient(cluster.url) as client:   # and it serves exact sessions
        sessions = [client.open(seed=20 + s) for s in range(2)]
        assert new[0]["replica"] in {s.replica for s in sessions}
        for k, s in enumerate(sessions):
            play(s, StockSession(toy, seed=20 + k), inputs(20 + k), range(len(WIDTHS)))
            s.close()


def test_concurrent_clients_per_replica_on_loopback(cluster, toy):
    """Three clients per replica send their chunks at once: none waits for the routing of
    another (Serve's routing loop once stalled such requests for 10 s), and every session is
    exact."""
    assert cluster.url.startswith("ws://127.0.0.1:")
    live, clients, start = cluster.health()["live_sessions"], 6, time.monotonic()

    def one(k):   # the stock references run after the load: the 2 cores go to the replicas
        with StreamClient(cluster.url, timeout=60) as client:
            s, outs, slowest = client.open(seed=30 + k), [], 0.0
            for i, x in enumerate(inputs(30 + k)):
                t = time.monotonic()
                outs.append(s.chunk(last=i in LAST, **x)["y"])
                assert s.last_reply["replica"] == s.replica
                slowest = max(slowest, time.monotonic() - t)
            s.close()
            return s.replica, outs, slowest

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        served = list(pool.map(one, range(clients)))
    assert time.monotonic() - start < 60
    assert sorted(collections.Counter(r for r, _, _ in served).values()) == [3, 3]
    assert max(slowest for _, _, slowest in served) < 5.0, [s for _, _, s in served]
    for k, (_, outs, _) in enumerate(served):
        ref = StockSession(toy, seed=30 + k)
        for i, x in enumerate(inputs(30 + k)):
            assert torch.equal(outs[i], ref.chunk(x, last=i in LAST)["y"]), (k, i)
    assert cluster.health()["live_sessions"] == live   # every session closed


def test_draining_a_replica_ends_its_sessions_with_their_turn_and_opens_elsewhere(cluster, toy):
    with StreamClient(cluster.url) as client:
        sessions = [client.open(seed=40 + k) for k in range(2)]   # one per replica, in turn
        assert len({s.replica for s in sessions}) == 2
        refs = [StockSession(toy, seed=40 + k) for k in range(2)]
        streams = [inputs(40 + k) for k in range(2)]
        for s, ref, xs in zip(sessions, refs, streams):
            play(s, ref, xs, range(2))
        going, staying = sessions
        status = cluster.drain([going.replica])   # in place: this WebSocket stays open
        assert status["draining"] == [going.replica] and status["drained"] == []
        opened = [client.open(seed=50 + k) for k in range(3)]
        assert {o.replica for o in opened} == {staying.replica}   # new sessions go elsewhere
        play(going, refs[0], streams[0], range(2, LAST[0] + 1))   # its turn goes on to its end
        assert going.closed == "draining"
        with pytest.raises(ServeError, match="unknown_session"):
            going.chunk(**streams[0][LAST[0] + 1])
        play(staying, refs[1], streams[1], range(2, len(WIDTHS)))   # across a reset
        assert staying.closed is None
        health = cluster.health()
        assert health["drained"] == [going.replica]
        assert health["replicas"][going.replica]["live_sessions"] == 0
        for o in opened:
            o.close()
        staying.close()
        assert cluster.drain()["draining"] == sorted(health["replicas"])
        with pytest.raises(ServeError, match="draining"):
            client.open(seed=60)
        assert cluster.drain(draining=False)["draining"] == []
        again = client.open(seed=61)
        play(again, StockSession(toy, seed=61), inputs(61), range(len(WIDTHS)))
        again.close()


def test_an_own_model_is_served_by_its_import_path_exact_against_stock(cluster):
    """The self-written speaker-prompted decoder, deployed beside the toy as
    ``streaming_prompt_decoder:served`` (the replica imports it): two speakers, each primed with
    its own prompt, two turns each ending on a partial chunk, every chunk exact against the
    speaker alone on the stock step, from the session's own replica, on the compiled path."""
    from streaming_prompt_decoder import CHUNK, FLUSH, PROMPT, VOCAB
    own = "streaming_prompt_decoder:served"
    serve.run(build_app(own, 1, cache_dir=cluster.cache_dir, num_cpus=0.5, threads=1),
              name="own", route_prefix="/own")
    try:
        model = build(own)
        url = f"ws://127.0.0.1:{cluster.port}/own/v1/stream"
        with StreamClient(url) as client:
            for speaker in (1, 2):
                g = torch.Generator().manual_seed(speaker)
                prompt = {"tokens": torch.randint(0, VOCAB, (1, PROMPT), generator=g)}
                s, ref = client.open(prompt=prompt), StockSession(model, prompt=prompt)
                for turn in range(2):
                    widths = [CHUNK] * 9 + [FLUSH]
                    for i, w in enumerate(widths):
                        x = {"tokens": torch.randint(0, VOCAB, (1, w), generator=g)}
                        last = i == len(widths) - 1
                        out = s.chunk(last=last, **x)
                        assert s.last_reply["replica"] == s.replica
                        assert torch.equal(out["mel"], ref.chunk(x, last=last)["mel"]), \
                            (speaker, turn, i)
                    s.reset()
                    ref.reset()
                stats = s.stats()
                assert stats["model"] == "prompt-decoder"
                assert stats["counters"]["compiled_calls"] >= 20 * speaker
                assert stats["counters"]["fallbacks"] == 0
                s.close()
    finally:
        serve.delete("own")
