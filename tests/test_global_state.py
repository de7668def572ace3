"""``cudagraphs.GLOBAL_STATE``: a class compile (and its preparation), a capture and a call that
runs the stock step hold it alone; a pool's drawing chunk shares it; replays take none. A class
traces with fake tensors swapped into the module, a stock call writes the module's buffers, a
preparation puts the generators back: nothing else may run the module or draw meanwhile."""
import threading
import time
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import cadence_fx
from cadence_fx.cudagraphs import GLOBAL_STATE, SharedExclusive
from helpers import stream
from streaming_decoder import DECODER_ADAPTER, make_decoder, prompt


def _in_thread(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_shared_holders_run_together_and_an_exclusive_one_alone():
    lock, inside, order = SharedExclusive(), threading.Barrier(2, timeout=5), []

    def shared():
        with lock.shared():
            inside.wait()   # both shared holders inside at once, or this times out
            order.append("shared")

    threads = [_in_thread(shared) for _ in range(2)]
    for t in threads:
        t.join(5)
    assert order == ["shared", "shared"]

    entered = threading.Event()

    def exclusive():
        with lock.exclusive():
            entered.set()
            time.sleep(0.2)
            order.append("exclusive done")

    t = _in_thread(exclusive)
    entered.wait(5)
    with lock.shared():   # waits for the exclusive holder
        order.append("shared after")
    t.join(5)
    assert order[2:] == ["exclusive done", "shared after"]


def test_a_shared_holder_may_ask_for_it_alone_and_gets_its_shared_hold_back():
    lock, order = SharedExclusive(), []
    other_in, release = threading.Event(), threading.Event()

    def other():
        with lock.shared():
            other_in.set()
            release.wait(5)
            order.append("other left")

    t = _in_thread(other)
    other_in.wait(5)
    with lock.shared():
        threading.Timer(0.2, release.set).start()
        with lock.exclusive():          # gives this thread's hold back, waits for the other's
            order.append("alone")
            with lock.exclusive(), lock.shared():   # reentrant inside
                order.append("nested")
        assert lock._shared[threading.get_ident()] == 1   # its shared hold is back
    t.join(5)
    assert order == ["other left", "alone", "nested"]


def test_a_waiting_exclusive_holder_goes_before_new_shared_ones():
    lock, order = SharedExclusive(), []
    first_in, release = threading.Event(), threading.Event()

    def first():
        with lock.shared():
            first_in.set()
            release.wait(5)

    def alone():
        with lock.exclusive():
            order.append("exclusive")

    def late():
        with lock.shared():
            order.append("late shared")

    a = _in_thread(first)
    first_in.wait(5)
    b = _in_thread(alone)
    time.sleep(0.1)   # the exclusive one waits for the first shared holder
    c = _in_thread(late)
    time.sleep(0.1)
    release.set()
    for t in (a, b, c):
        t.join(5)
    assert order == ["exclusive", "late shared"]


def test_nothing_runs_the_module_while_a_class_of_it_traces(monkeypatch):
    """One thread compiles a class (its trace slowed by 0.4 s while the module's parameters are
    fake); another runs the module itself under ``GLOBAL_STATE.exclusive()``, as code outside
    the compiled step must. It waits for the compile and computes on the real parameters."""
    model = make_decoder()
    compiled = cadence_fx.compile(model, DECODER_ADAPTER)
    tracing_now, linear = threading.Event(), torch.nn.Linear.forward

    def slow_linear(self, input):   # slowed while tracing: the parameters are fake then
        if isinstance(self.weight, FakeTensor) and not tracing_now.is_set():
            tracing_now.set()
            time.sleep(0.4)
        return linear(self, input)

    monkeypatch.setattr(torch.nn.Linear, "forward", slow_linear)
    x = prompt(3)
    with torch.inference_mode():
        want, _ = model(x, None)

    def compile_one():
        with torch.inference_mode():
            compiled(x, None)

    t = _in_thread(compile_one)
    assert tracing_now.wait(30)
    with GLOBAL_STATE.exclusive(), torch.inference_mode():
        got, _ = model(x, None)
    t.join(60)
    assert torch.equal(got, want)
    assert compiled.counters.traces == 1 and len(compiled.classes) == 1   # it traced, slowed


@pytest.fixture
def eager_switches():
    """Threads switch every 10 microseconds (races show up in a few calls)."""
    import sys
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_stock_calls_of_two_lanes_never_share_the_modules_buffers(eager_switches):
    """Two lanes of a served toy, each chunk outside the catalog (width 12: the stock step, which
    returns views of the module's own scratch buffers), sent from two threads at once: every
    chunk equals its session run alone."""
    from cadence_fx.serve.engine import PoolEngine
    from cadence_fx.serve.models import StockSession, build
    model = build("toy")
    engine = PoolEngine(model, lanes=2)
    sids = [engine.open(lane=0), engine.open(lane=1)]
    g = torch.Generator().manual_seed(0)
    xs = [[torch.randn(1, 12, 256, generator=g) for _ in range(12)] for _ in range(2)]
    outs, start = [[], []], threading.Barrier(2, timeout=30)

    def play(k):
        start.wait()
        for x in xs[k]:
            outs[k].append(engine.chunk(sids[k], {"x": x})[0]["y"])

    threads = [_in_thread(lambda k=k: play(k)) for k in range(2)]
    for t in threads:
        t.join(120)
    for k in range(2):
        ref = StockSession(model)
        assert [torch.equal(ref.chunk({"x": x})["y"], y) for x, y in zip(xs[k], outs[k])] == \
            [True] * 12
    assert [engine.pools["step"].lanes[i].compiled.counters.fallbacks for i in (0, 1)] == [12, 12]


def test_a_background_priming_compile_leaves_other_lanes_draws_alone(eager_switches):
    """Lane 0 compiles a priming class in the background (its preparation puts the generators
    back when it ends) while lane 1's session draws in another thread: lane 1 equals itself
    alone from its seed."""
    import dataclasses
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy

    class Noisy(NoisySourceToy):
        def forward(self, x, cache=None):
            if cache is None:
                cache = torch.zeros(1, x.shape[1], self.context)
            return super().forward(x, cache)

    adapter = dataclasses.replace(NOISY_ADAPTER, name="noisy-priming", prompt_lengths=(8,))
    model, zero = Noisy(), torch.zeros(1, 16, 2)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(1, 16, 8, generator=g) for _ in range(150)]
    want = [y for y, _ in stream(model, xs, zero, None, reset_at=len(xs), mode=torch.inference_mode,
                                 before=lambda i: i or torch.manual_seed(100))]
    pool = cadence_fx.SessionPool(cadence_fx.compile(model, adapter), lanes=2)
    drawing, priming = pool.open(zero, seed=100, lane=1), pool.open(None, seed=5, lane=0)
    got, started = [], threading.Event()

    def draw():
        with torch.inference_mode():
            for i, x in enumerate(xs):
                if i == 20:
                    started.set()
                got.append(pool.step(drawing, x)[0].clone())

    t = _in_thread(draw)
    assert started.wait(60)
    with torch.inference_mode():
        pool.step(priming, xs[0])   # runs stock; its class compiles in the background
    assert pool.lanes[0].compiled.wait_background(60)
    t.join(120)
    assert pool.lanes[0].compiled.counters.background_compiles == 1
    assert [torch.equal(a, b) for a, b in zip(got, want)] == [True] * len(xs)


def test_seeded_opens_beside_another_lanes_drawing_chunks_never_deadlock(eager_switches):
    """One thread opens and closes seeded sessions on lane 1 (each start state a stock pass, held
    alone) while another sends a drawing session's chunks on lane 0: both finish (a seeded open
    once waited for the draw lock holding GLOBAL_STATE alone, while a chunk held the draw lock
    waiting for it), and the chunks equal the session alone."""
    from cadence_fx.models.toy import NOISY_ADAPTER, NoisySourceToy
    from cadence_fx.serve.engine import PoolEngine
    from cadence_fx.serve.models import ServedModel
    model, zero = NoisySourceToy(), torch.zeros(1, 16, 2)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 16, 8, generator=g) for _ in range(80)]

    def start(prompt):
        time.sleep(0.002)   # the start state's stock pass
        return {"step": zero}

    def chunk(run, inputs, last):
        time.sleep(0.001)
        return {"y": run("step", inputs["x"])[0]}

    served = ServedModel("noisy", {"step": model},
                         {"step": cadence_fx.compile(model, NOISY_ADAPTER)}, start=start,
                         chunk=chunk, example=lambda s, i: {"x": xs[i]}, deadline_ms=1000.0)
    engine = PoolEngine(served, lanes=2)
    sid = engine.open(seed=100, lane=0)
    got, stop, done = [], threading.Event(), threading.Event()

    def opener():
        n = 0
        while not stop.is_set():
            engine.close(engine.open(seed=n, lane=1))
            n += 1

    def chunks():
        for x in xs:
            got.append(engine.chunk(sid, {"x": x})[0]["y"])
        done.set()

    t = _in_thread(opener)
    _in_thread(chunks)
    finished = done.wait(60)
    stop.set()
    t.join(10)
    assert finished and not t.is_alive()
    want = [y for y, _ in stream(model, xs, zero, None, reset_at=len(xs), mode=torch.inference_mode,
                                 before=lambda i: i or torch.manual_seed(100))]
    assert [torch.equal(a, b) for a, b in zip(got, want)] == [True] * len(xs)


def test_a_piece_lowers_alone_since_it_synchronizes_the_device(monkeypatch):
    """``lower`` synchronizes the device and empties the allocator's cache before it captures:
    both fail while another thread captures ("operation not permitted when stream is
    capturing", a lane thread lowering while another lane's thread captured). So the whole of
    it holds ``GLOBAL_STATE`` alone, like the capture; checked with torch's calls stood in for."""
    from cadence_fx import cudagraphs

    class CudaLike(torch.Tensor):
        is_cuda = True

    held = []

    def record(name):
        return lambda *a: held.append((name, GLOBAL_STATE._owner == threading.get_ident()))

    monkeypatch.setattr(torch.cuda, "synchronize", record("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", record("empty_cache"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    event = types.SimpleNamespace(record=lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: event)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    backend = cudagraphs.CudaGraphBackend()
    monkeypatch.setattr(backend, "_capture_or_retry", lambda *a: "capture failed: stood in")
    x = torch.Tensor._make_subclass(CudaLike, torch.zeros(2))
    piece = types.SimpleNamespace(module=torch.nn.Identity(), fixed=[True], piece_name="p")
    assert backend.lower(piece, [x]) == (None, "capture failed: stood in")
    assert held == [("synchronize", True), ("empty_cache", True)], held
    assert GLOBAL_STATE._owner is None
