"""``cudagraphs.GLOBAL_STATE``: compiled calls share it; a class compile, a capture and a pooled
draw hold it alone. A class traces with fake tensors swapped into the module, so nothing may run
the module in another thread meanwhile."""
import threading
import time

import torch
from torch._subclasses.fake_tensor import FakeTensor

import cadence_fx
from cadence_fx.cudagraphs import GLOBAL_STATE, SharedExclusive
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
    fake); another runs the module itself under ``GLOBAL_STATE.shared()``, as code outside the
    compiled step must. It waits for the compile and computes on the real parameters."""
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
    with GLOBAL_STATE.shared(), torch.inference_mode():
        got, _ = model(x, None)
    t.join(60)
    assert torch.equal(got, want)
    assert compiled.counters.traces == 1 and len(compiled.classes) == 1   # it traced, slowed
