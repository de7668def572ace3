"""The persistent compile cache (``cadence_fx/compile_cache.py``): a later process loads each class
instead of tracing it and stays bit-exact; whatever can change a trace changes the key; new weights
reuse it; corrupt, truncated and foreign entries are reported and traced again; processes writing
at once leave a valid cache; ``cadence-fx cache ls|clear``; the environment variable and the
torch.compile backend's option. Every stream compares each call with the stock module
(``torch.equal``) and asserts what was traced and what was loaded."""
import copy
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cadence_fx
from cadence_fx.cli import main
from cadence_fx.entries import write_entry
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from cadence_fx.passes.pipeline import Options

WIDTHS = [8, 8, 8, 8, 10]      # three extents, two widths: four classes


def _prompt(model, seed=11):
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(seed)), None)
    return {k: v.clone() for k, v in state.items()}


def _stream(model, adapter=PROMPT_RETAINED_ADAPTER, stock=None, **kw):
    """Compile ``model``, stream it against stock (``model`` itself, or a separate ``stock``
    module when the step writes its own module); returns the compiled step."""
    compiled = cadence_fx.compile(model, adapter, **kw)
    g = torch.Generator().manual_seed(5)
    state = ref = _prompt(model) if stock is None else _prompt(copy.deepcopy(stock))
    stock = model if stock is None else stock
    for w in WIDTHS:
        x = torch.randn(1, w, 64, generator=g)
        with torch.no_grad():
            y, state = compiled(x, state)
            want, ref = stock(x, {k: v.clone() for k, v in ref.items()})
        assert torch.equal(y, want) and all(torch.equal(state[k], ref[k]) for k in ref)
    k = compiled.counters
    assert (k.compiled_calls, k.fallbacks) == (len(WIDTHS), 0)
    return compiled


def _entries(d, kind="class"):
    """The cache's entries of one kind: ``class`` (compiled) or ``trace`` (the traced graph,
    stored only for a class that cannot be stored compiled, e.g. under ``verify=True``)."""
    return sorted(Path(d).glob(f"*/*.{kind}"))


def _loads(c):
    return (c.counters.traces, c.counters.cache_loads, c.counters.compiled_loads)


def test_a_second_step_loads_every_class_instead_of_tracing(tmp_path):
    first = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    n = len(first.classes)
    assert _loads(first) == (n, 0, 0) and n == 4
    assert (len(_entries(tmp_path)), len(_entries(tmp_path, "trace"))) == (n, 0)
    second = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(second) == (0, n, n)
    # the loaded classes are the compiled ones: same rewrites, pieces and generated code
    for key, entry in second.classes.items():
        was = first.classes[key]
        assert entry.records.rewrites == was.records.rewrites
        assert entry.records.pieces == was.records.pieces
        assert entry.gm.code == was.gm.code
        assert entry.traced_nodes == was.traced_nodes > 0 and entry.records.probe_s == 0.0
    assert "retention" in str([e.records.rewrites for e in second.classes.values()])


def test_a_loaded_class_runs_no_trace_no_pass_and_no_probe(tmp_path, monkeypatch):
    """What a restart skips: with tracing, the pass pipeline and the probationary call broken,
    every class still loads and streams bit-exact (``_stream`` compares each call)."""
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    from cadence_fx import class_compiler

    def broken(*args, **kwargs):
        raise AssertionError("a loaded class ran this")
    for name in ("trace_step", "run_pipeline", "probe_effects"):
        monkeypatch.setattr(class_compiler, name, broken)
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 4)
    assert c.counters.guarded_eager > 0      # the loaded pieces ran behind their guards


def test_a_class_whose_trace_alone_is_cached_runs_the_passes_again(tmp_path):
    """A class that cannot be stored compiled (here: the shadow auditor is in its graph) caches
    its trace. A later step loads the trace, runs the passes and the probe on it, and stores the
    class compiled; the next loads that."""
    _stream(PromptRetainedToy(), cache_dir=tmp_path, verify=True)
    assert (len(_entries(tmp_path)), len(_entries(tmp_path, "trace"))) == (0, 4)
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 0)
    assert len(_entries(tmp_path)) == 4
    assert _loads(_stream(PromptRetainedToy(), cache_dir=tmp_path)) == (0, 4, 4)


def _traces_only(d):
    """Fill ``d`` with traces only (a step compiled with the shadow auditor)."""
    _stream(PromptRetainedToy(), cache_dir=d, verify=True)
    assert (len(_entries(d)), len(_entries(d, "trace"))) == (0, 4)


def test_a_restarted_process_loads_the_cache(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compile_cache import _stream
        from cadence_fx.models.toy import PromptRetainedToy
        c = _stream(PromptRetainedToy(), cache_dir={str(tmp_path)!r})
        print(c.counters.traces, c.counters.cache_loads, c.counters.compiled_loads)
    """)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["4", "0", "0"], ["0", "4", "4"]]
    assert "cadence_fx compile cache" not in runs[1].stderr


def test_new_weights_reuse_the_cache_and_give_their_own_results(tmp_path):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    other = PromptRetainedToy()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    c = _stream(other, cache_dir=tmp_path)      # compared with the new weights' stock results
    assert _loads(c) == (0, 4, 4)


def test_what_changes_a_trace_changes_the_key(tmp_path, monkeypatch):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    renamed = dataclasses.replace(PROMPT_RETAINED_ADAPTER, name="prompt-retained-renamed")
    c = _stream(PromptRetainedToy(), renamed, cache_dir=tmp_path)              # the adapter
    assert (c.counters.traces, c.counters.cache_loads) == (4, 0)
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path,                        # the passes
                options=Options(mask_writes=False))
    assert (c.counters.traces, c.counters.cache_loads) == (4, 0)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")    # torch
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert (c.counters.traces, c.counters.cache_loads) == (4, 0)
    assert len({p.parent for p in _entries(tmp_path)}) == 4   # one step directory per key


DAMAGE = [
    (lambda b: b[:-100], "truncated or corrupt"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "truncated or corrupt"),
    (lambda b: b"garbage\n" + b, "not a cadence_fx cache entry"),
    (lambda b: b"[1]\n" + b, "not a cadence_fx cache entry"),
]


@pytest.mark.parametrize("damage,why", DAMAGE)
def test_a_damaged_compiled_entry_is_reported_compiled_again_and_rewritten(tmp_path, damage, why):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    victim = _entries(tmp_path)[0]
    victim.write_bytes(damage(victim.read_bytes()))
    with pytest.warns(RuntimeWarning, match=why):
        c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (1, 3, 3)                 # that class was traced again
    again = _stream(PromptRetainedToy(), cache_dir=tmp_path)   # the entry was rewritten
    assert _loads(again) == (0, 4, 4)


def test_an_intact_entry_that_does_not_load_here_is_reported_and_compiled_again(tmp_path):
    """An entry whose digest holds but whose code cannot run in this process (here: an import
    this environment lacks) is reported and compiled again, never half-loaded."""
    first = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    key = next(iter(first.classes))
    payload = first.compile_cache.load_class(key)
    payload["module"]["imports"] += "\nimport a_module_this_environment_lacks\n"
    first.compile_cache.store_class(key, payload)
    with pytest.warns(RuntimeWarning, match="not loadable here .ModuleNotFoundError"):
        c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (1, 3, 3)
    assert _loads(_stream(PromptRetainedToy(), cache_dir=tmp_path)) == (0, 4, 4)


def test_an_entry_of_the_format_before_typed_records_is_reported_and_compiled_again(tmp_path):
    """Format 3 kept a class's records as dicts (format 4 keeps ``passes/records.py``'s
    dataclasses): such an entry is refused by its header, reported with the format it has,
    compiled again and rewritten, never loaded with records of the old shape."""
    first = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    key = next(iter(first.classes))
    payload = first.compile_cache.load_class(key)
    records = payload["records"]
    payload["records"] = {"rewrites": [w.as_dict() for w in records.rewrites],
                          "near_misses": [m.as_dict() for m in records.near_misses],
                          "pieces": [p.as_dict() for p in records.pieces],
                          "passes": [p.as_dict() for p in records.passes]}
    path = first.compile_cache.path(key, "class")
    header = json.loads(path.read_bytes().partition(b"\n")[0])
    write_entry(path, dict(header, format=3), pickle.dumps(payload))
    with pytest.warns(RuntimeWarning, match=r"is of another format \(3\); the class is compiled again"):
        c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (1, 3, 3)
    assert _loads(_stream(PromptRetainedToy(), cache_dir=tmp_path)) == (0, 4, 4)


@pytest.mark.parametrize("damage,why", DAMAGE)
def test_a_damaged_trace_is_reported_traced_again_and_rewritten(tmp_path, damage, why):
    _traces_only(tmp_path)
    victim = _entries(tmp_path, "trace")[0]
    victim.write_bytes(damage(victim.read_bytes()))
    with pytest.warns(RuntimeWarning, match=why):
        c = _stream(PromptRetainedToy(), cache_dir=tmp_path, verify=True)
    assert _loads(c) == (1, 3, 0)
    again = _stream(PromptRetainedToy(), cache_dir=tmp_path, verify=True)   # rewritten
    assert _loads(again) == (0, 4, 0)


@pytest.mark.parametrize("kind", ["class", "trace"])
def test_a_foreign_entry_is_not_loaded(tmp_path, kind):
    if kind == "trace":
        _traces_only(tmp_path)
    else:
        _stream(PromptRetainedToy(), cache_dir=tmp_path)
    a, b = _entries(tmp_path, kind)[:2]
    b.write_bytes(a.read_bytes())               # another class's entry under this class's name
    with pytest.warns(RuntimeWarning, match="foreign entry"):
        c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == ((1, 3, 3) if kind == "class" else (1, 3, 0))


def test_processes_writing_at_once_leave_a_valid_cache(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_compile_cache import _stream
        from cadence_fx.models.toy import PromptRetainedToy
        _stream(PromptRetainedToy(), cache_dir={str(tmp_path)!r})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    assert [p.wait() for p in procs] == [0, 0, 0]
    assert (len(_entries(tmp_path)), len(_entries(tmp_path, "trace"))) == (4, 0)
    assert not list(Path(tmp_path).glob("*/*.tmp"))
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 4)


def test_the_environment_variable_names_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_FX_CACHE_DIR", str(tmp_path))
    _stream(PromptRetainedToy())
    assert len(_entries(tmp_path)) == 4
    monkeypatch.delenv("CADENCE_FX_CACHE_DIR")
    c = _stream(PromptRetainedToy())
    assert c.compile_cache is None and (c.counters.traces, c.counters.cache_loads) == (4, 0)


def test_cache_ls_and_clear(tmp_path, capsys):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert main(["cache", "ls", "--dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["model"], row["adapter"], row["classes"]) == ("PromptRetainedToy",
                                                              PROMPT_RETAINED_ADAPTER.name, 4)
    assert row["bytes"] == sum(p.stat().st_size for p in Path(row["path"]).iterdir())
    assert row["created"].startswith("20")
    assert main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    assert "4 classes" in capsys.readouterr().out
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 cached steps" in capsys.readouterr().out and not _entries(tmp_path)


def test_the_backend_option(tmp_path):
    torch._dynamo.reset()
    model = PromptRetainedToy()
    fn = torch.compile(model, backend="cadence", dynamic=False,
                       options={"adapter": PROMPT_RETAINED_ADAPTER, "cache_dir": str(tmp_path)})
    state = _prompt(model)
    with torch.no_grad():
        fn(torch.randn(1, 8, 64), state)
    torch._dynamo.reset()
    assert _entries(tmp_path) and os.path.isfile(next(Path(tmp_path).glob("*/meta.json")))


def test_an_edited_helper_beside_the_step_changes_the_key(tmp_path):
    """The step calls a helper in its own file: editing that file recompiles."""
    src = tmp_path / "mystep.py"
    body = textwrap.dedent("""
        import torch
        from cadence_fx.models.toy import PromptRetainedToy

        def helper(y):
            return y * {factor}

        class Helped(PromptRetainedToy):
            def forward(self, x, cache):
                y, cache = super().forward(x, cache)
                return helper(y), cache
    """)
    sys.path.insert(0, str(tmp_path))
    try:
        for factor, traces in ((2, 4), (2, 0), (3, 4)):
            src.write_text(body.format(factor=factor))
            sys.modules.pop("mystep", None)
            import mystep
            c = _stream(mystep.Helped(), cache_dir=tmp_path / "cache")
            assert (c.counters.traces, c.counters.cache_loads) == (traces, 4 - traces), factor
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mystep", None)


def test_a_restarted_conformer_server_loads_every_class_through_its_lifecycle(tmp_path):
    """The streaming conformer (tests/streaming_conformer.py) as a server runs it: speakers primed
    mid-stream, flushes, turn resets; then a restarted step on the same cache directory, which
    loads every class (the priming class included), streams bit-exact against stock, and takes a
    retry from a cloned older state under another grad mode."""
    from streaming_conformer import (CONFORMER_ADAPTER, chunk_feats, clone_state, make_model,
                                     prime, run_turns)
    turns = [(0, [8, 12, 12, 8, 8, 12, 4]), (1, [12, 8, 8, 12]), (0, [8, 8, 12, 4])]
    model = make_model()
    want, want_rng = run_turns(model, turns, seed=3)

    def served():
        step = cadence_fx.compile(model, CONFORMER_ADAPTER, cache_dir=tmp_path)
        got, rng = run_turns(step, turns, seed=3)
        assert torch.equal(rng, want_rng) and len(got) == len(want)
        assert all(torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in b[1])
                   for a, b in zip(got, want))
        assert (step.counters.fallbacks, step.counters.compiled_calls) == (0, len(want))
        return step

    first = served()
    n = len(first.classes)
    assert (first.counters.traces, first.counters.cache_loads, n) == (n, 0, 6)
    restarted = served()
    assert _loads(restarted) == (0, n, n)       # the priming class too: it makes the carries
    state = prime(restarted, 1)
    before = clone_state(state)
    (x,) = chunk_feats([8], seed=9)
    torch.manual_seed(4)
    with torch.inference_mode():
        y, _ = restarted(x, state)
    torch.manual_seed(4)
    with torch.no_grad():
        retried, _ = restarted(x, before)               # a retry from the cloned older state
        torch.manual_seed(4)
        ref, _ = model(x, clone_state(before))
    assert torch.equal(y, ref) and torch.equal(retried, ref)
    # inference mode is part of the class: that one class is new, traced once and cached
    assert (restarted.counters.traces, restarted.counters.fallbacks) == (1, 0)
    assert len(_entries(tmp_path)) == n + 1


# -- what a compiled entry keeps of the module: state by path, constants by value -------------
SHIFT = torch.tensor([0.25])        # a tensor the step reads that is neither module state nor a literal


class CountingToy(PromptRetainedToy):
    """Streaming state in a plain tensor attribute, written in place by the step."""

    def __init__(self):
        super().__init__()
        self.frames_seen = torch.zeros(())

    def forward(self, x, cache=None):
        y, cache = super().forward(x, cache)
        self.frames_seen.add_(x.shape[1])
        return y * (1 + self.frames_seen / 100), cache


class GlobalShiftToy(PromptRetainedToy):
    def forward(self, x, cache=None):
        y, cache = super().forward(x, cache)
        return y + SHIFT, cache


class LazyScaleToy(PromptRetainedToy):
    """Registers a buffer on its first call, as Mimi does its codebook cache."""

    def forward(self, x, cache=None):
        if "scale" not in self._buffers:
            self.register_buffer("scale", torch.full((x.shape[-1],), 0.5), persistent=False)
        y, cache = super().forward(x, cache)
        return y * self.scale, cache


@pytest.mark.parametrize("kind", ["class", "trace"])
def test_module_state_is_bound_to_the_live_module_on_load(tmp_path, kind):
    """A loaded class (compiled, or its trace) writes the module's own ``frames_seen``, not a
    copy stored with it: a restarted server's module advances exactly as stock's does."""
    first = CountingToy()
    _stream(first, stock=copy.deepcopy(first), cache_dir=tmp_path, verify=kind == "trace")
    assert len(_entries(tmp_path, kind)) == 4
    restarted, stock = CountingToy(), CountingToy()
    c = _stream(restarted, stock=stock, cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 4 if kind == "class" else 0)
    assert restarted.frames_seen.item() == stock.frames_seen.item() == sum(WIDTHS)
    if kind == "trace":
        return
    entry = next(iter(c.classes.values()))
    written = [t for m in entry.gm.modules() for t in getattr(m, "written_attributes", ())]
    assert written and all(getattr(m, t) is restarted.frames_seen
                           for m in entry.gm.modules() for t in getattr(m, "written_attributes", ()))


def test_a_class_reading_a_foreign_tensor_is_not_cached(tmp_path, caplog):
    """A tensor the code reads that is neither a constant nor module state cannot be found again
    by a later process, whose value may differ: the class is not stored in either form, with the
    reason in the log, and a restart compiles it."""
    import logging
    with caplog.at_level(logging.INFO, logger="cadence_fx"):
        _stream(GlobalShiftToy(), cache_dir=tmp_path)
    assert "neither a constant nor module state" in caplog.text
    assert (len(_entries(tmp_path)), len(_entries(tmp_path, "trace"))) == (0, 0)
    assert _loads(_stream(GlobalShiftToy(), cache_dir=tmp_path)) == (4, 0, 0)


def test_state_the_module_registers_on_its_first_call_is_compiled_for(tmp_path):
    """The first class is traced before the stock call registers ``scale``; the later ones read
    it. Restarted, the first loads compiled (no stock call), so the module has no ``scale`` when
    the second would load: that one is compiled instead, its probationary call registering it."""
    first = LazyScaleToy()
    _stream(first, stock=copy.deepcopy(first), cache_dir=tmp_path)
    restarted = LazyScaleToy()
    c = _stream(restarted, stock=copy.deepcopy(restarted), cache_dir=tmp_path)
    assert _loads(c) == (1, 3, 3) and "scale" in dict(restarted.named_buffers())


def test_another_pythons_bytecode_compiles_the_stored_source(tmp_path, monkeypatch):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    from cadence_fx import stored_class
    monkeypatch.setattr(stored_class, "MAGIC", b"\x00\x00\r\n")
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 4)


def test_the_report_of_a_loaded_step(tmp_path):
    _stream(PromptRetainedToy(), cache_dir=tmp_path)
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    report = c.report()
    rows = report.classes()
    assert len(rows) == 4 and all(r["traced_nodes"] > 0 and r["pieces"] for r in rows)
    assert any("piece_0" in line for line in report.graph_lines(0))
    assert "piece_0" in report._repr_html_()


def test_what_the_code_reads_is_stored_by_value_by_path_or_not_at_all():
    """The rule ``stored_class.attributes`` applies to each ``get_attr``: the passes' constants
    and tensor literals by value, module state by its path, anything else refused."""
    from cadence_fx.stored_class import Unstorable, attributes
    root = torch.nn.Module()
    names = ("_cadence_const_0", "_cadence_mask_value_0_index_put_", "_tensor_constant0", "state")
    for name in names:
        setattr(root, name, torch.zeros(2))
    graph = torch.fx.Graph()
    nodes = {name: graph.get_attr(name) for name in names}
    lift = graph.call_function(torch.ops.aten.lift_fresh_copy.default, (nodes["_tensor_constant0"],))
    graph.output((nodes["_cadence_const_0"], nodes["_cadence_mask_value_0_index_put_"], lift,
                  nodes["state"]))
    gm = torch.fx.GraphModule(root, graph)
    kinds = attributes(gm, {id(root.state): "layer.cache"})
    assert {k: v[0] for k, v in kinds.items()} == {
        "_cadence_const_0": "value", "_cadence_mask_value_0_index_put_": "value",
        "_tensor_constant0": "value", "state": "state"}
    assert kinds["state"][1] == "layer.cache"
    with pytest.raises(Unstorable, match="attribute state is a tensor that is neither"):
        attributes(gm, {})


def test_a_restarted_server_captures_its_whole_catalog_from_the_cache(tmp_path):
    """At start-up a server calls ``capture_catalog``: restarted, every class of the catalog
    loads compiled (no trace), and the stream that follows runs them bit-exact."""
    model = PromptRetainedToy()
    state = _prompt(model)
    x = torch.randn(1, 8, 64)
    first = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, cache_dir=tmp_path)
    with torch.no_grad():
        done = first.capture_catalog(x, state)
    assert len(done) == 6 and all(done.values()) and len(_entries(tmp_path)) == 6
    # what it did is returned (the step's counters stay as they were: preparing is not traffic)
    assert [r["how"] for r in done.rows] == ["traced"] * 6 and done.work["traces"] == 6
    assert first.counters.traces == 0
    restarted = cadence_fx.compile(PromptRetainedToy(), PROMPT_RETAINED_ADAPTER, cache_dir=tmp_path)
    with torch.no_grad():
        again = restarted.capture_catalog(x, state)
    assert again == done
    assert [r["how"] for r in again.rows] == ["loaded"] * 6
    assert (again.work["traces"], again.work["compiled_loads"]) == (0, 6)
    assert str(again).startswith("6 classes, 6 compiled;") and "compiled_loads 6" in str(again)
    # the priming pass and the partial flushes the admission clock lets in are named, with how
    assert [why.split(" (")[0].split(" of ")[0] for why in again.not_prepared] == [
        "the priming pass", "partial flushes"]
    with torch.no_grad():
        assert [r["how"] for r in restarted.capture_catalog(x, state).rows] == ["compiled before"] * 6
    from cadence_fx.stored_class import CodeModule
    assert len(restarted.classes) == 6
    assert all(isinstance(e.gm, CodeModule) and e.traced.loaded and e.records.probe_s == 0.0
               for e in restarted.classes.values())
    c = _stream(PromptRetainedToy(), cache_dir=tmp_path)
    assert _loads(c) == (0, 4, 4)
