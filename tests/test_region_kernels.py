"""Fused regions' compiled code and verdicts in the compile cache (``cadence_fx/region_kernels.py``):
a process started with only the cache directory -- empty Inductor and Triton caches -- runs every
fused region from its stored code without compiling or verifying it; regions with one kernel key
share one entry; an edited pass gives new keys (a recompile); a damaged, truncated or foreign
entry is reported and compiled again; a stored kernel met at another layout is verified again;
``CADENCE_FX_RECHECK_FUSION=1`` verifies every region. On the CPU the regions are Inductor's C++
(``exact_ops.DEVICES`` opened to the CPU), on the device its Triton kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cadence_fx
from cadence_fx import fusion, region_kernels
from cadence_fx.fusion import FusedRegion, regions
from cadence_fx.passes import exact_ops
from cadence_fx.region_kernels import KernelStore

from streaming_conformer import one_thread  # noqa: F401 - autouse: one intra-op thread per file
from streaming_decoder import DECODER_ADAPTER, make_decoder
from test_decoder_lifecycle import _same, fresh_process, script

HERE = Path(__file__).parent


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    monkeypatch.setattr(exact_ops, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(KernelStore, "_open", {})
    yield
    region_kernels.compiler_digest.cache_clear()        # a test may have read edited sources


@pytest.fixture(scope="module")
def stock():
    return script(make_decoder())


def _kernels(d):
    return sorted((Path(d) / "kernels").glob("*.kernel"))


def _regions(compiled):
    return [r for e in compiled.classes.values() for r in regions(e.gm)]


def _fresh_process(tmp_path, code):
    """Run ``code`` in a new Python with empty Inductor and Triton cache directories; returns
    the process and the JSON of its last line."""
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    inductor.mkdir(), triton.mkdir()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor), TRITON_CACHE_DIR=str(triton))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1])


def test_a_fresh_process_with_empty_inductor_caches_starts_warm(fuse_on_cpu, stock, tmp_path):
    """The cache directory alone makes a start warm: a child process with empty Inductor and
    Triton cache directories and no compiler loads every class and every region's code."""
    cold = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path / "cache")
    assert _same(stock, script(cold))
    found = _regions(cold)
    # a later class's region whose key an earlier class stored takes that verdict and code
    assert 0 < cold.counters.fusions_loaded < cold.counters.fused_regions
    # one entry per kernel key: the decoder's two layers make the same regions at the same shapes
    keys = {r._key(fusion._modes() + r.layout) for r in found}
    assert len(_kernels(tmp_path / "cache")) == len(keys) < len(found)
    code = textwrap.dedent(f"""
        import json, sys; sys.path.insert(0, {str(HERE)!r})
        import pytest, torch
        import cadence_fx
        from cadence_fx import fusion
        from cadence_fx.passes import exact_ops
        from streaming_decoder import DECODER_ADAPTER, make_decoder
        from test_decoder_lifecycle import _same, script
        exact_ops.DEVICES = ("cuda", "cpu")
        def no_compiler(module, args, graph=None):
            raise AssertionError("compiled again")
        fusion.compile_region = no_compiler
        torch.set_num_threads(1)
        stock = script(make_decoder())
        warm = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir={str(tmp_path / "cache")!r})
        out = script(warm)
        k = warm.counters
        print(json.dumps({{"same": _same(stock, out), "traces": k.traces, "loads": k.compiled_loads,
                          "fused": k.fused_regions, "loaded": k.fusions_loaded,
                          "refused": k.fusions_refused, "fallbacks": k.fallbacks,
                          "kernels": warm.kernel_store.loads}}))
    """)
    run, got = _fresh_process(tmp_path, code)
    assert got == {"same": True, "traces": 0, "loads": len(cold.classes),
                   "fused": cold.counters.fused_regions, "loaded": len(found),
                   "refused": cold.counters.fusions_refused, "fallbacks": 0, "kernels": len(keys)}
    assert "cadence_fx compile cache" not in run.stderr


def test_each_kernel_key_is_verified_once_per_process(fuse_on_cpu, stock, tmp_path, monkeypatch):
    """The first region of a key to run verifies it; every later one with that key, in the same
    class (the decoder's second layer) or a later one, takes its verdict as a restart would."""
    verified = []
    inner = FusedRegion.verify

    def counting(self, args):
        verified.append(self._key(fusion._modes() + self.layout))
        return inner(self, args)
    monkeypatch.setattr(FusedRegion, "verify", counting)
    cold = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path / "cache")
    assert _same(stock, script(cold))
    ran = [r for r in _regions(cold) if r.state != "pending"]
    keys = {r._key(fusion._modes() + r.layout) for r in ran}
    assert len(ran) > len(keys) and sorted(verified) == sorted(keys)
    assert cold.counters.fusions_loaded == len(ran) - len(keys)
    assert sum(r.state == "fused" for r in ran) == cold.counters.fused_regions > 0


def test_an_edited_pass_compiles_again(fuse_on_cpu, stock, tmp_path, monkeypatch):
    """The key covers the compiler's source: the same step with one pass file edited loads
    nothing of what the old pass compiled, its classes nor its regions' kernels."""
    real = fusion.compile_region
    edited = tmp_path / "src" / "fuse_exact.py"
    edited.parent.mkdir()
    edited.write_text((Path(fusion.__file__).parent.parent / "passes" / "fuse_exact.py").read_text())
    files = region_kernels.compiler_files
    monkeypatch.setattr(region_kernels, "compiler_files",
                        lambda: [f for f in files() if f.name != "fuse_exact.py"] + [edited])
    region_kernels.compiler_digest.cache_clear()
    cache = tmp_path / "cache"
    first = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=cache)
    assert _same(stock, script(first)) and first.counters.traces > 0
    stored = set(_kernels(cache))
    fresh_process(monkeypatch)
    same = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=cache)
    assert _same(stock, script(same))
    assert same.counters.traces == 0 and same.counters.fusions_loaded == len(_regions(same))
    edited.write_text(edited.read_text() + "\n# an edit\n")
    region_kernels.compiler_digest.cache_clear()        # a new process reads the sources again
    monkeypatch.setattr(fusion, "compile_region", real)   # the compiler back
    monkeypatch.setattr(KernelStore, "_open", {})
    again = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=cache)
    assert _same(stock, script(again))
    k = again.counters
    # as cold as the first: every class traced, no region's code from the old entries (only
    # what its earlier classes stored now, as in the first process)
    assert k.traces == first.counters.traces and k.compiled_loads == 0
    assert k.fusions_loaded == first.counters.fusions_loaded
    assert k.fused_regions == first.counters.fused_regions
    assert set(_kernels(cache)) > stored            # new keys beside the old entries



DAMAGE = [
    (lambda b: b[:-100], "truncated or corrupt"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "truncated or corrupt"),
    (lambda b: b"garbage\n" + b, "not a cadence_fx kernel entry"),
    (lambda b: b.replace(b'"format": 1', b'"format": 0', 1), "of another format"),
]


@pytest.mark.parametrize("damage,why", DAMAGE)
def test_a_damaged_kernel_entry_is_reported_and_compiled_again(fuse_on_cpu, stock, tmp_path,
                                                               monkeypatch, damage, why):
    cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
    _ = script(cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path))
    victim = _kernels(tmp_path)[0]
    victim.write_bytes(damage(victim.read_bytes()))
    monkeypatch.setattr(KernelStore, "_open", {})
    monkeypatch.setattr(fusion, "_COMPILED", {})
    with pytest.warns(RuntimeWarning, match=why):
        again = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
        assert _same(stock, script(again))
    k = again.counters
    assert 0 < k.fusions_loaded < len(_regions(again))       # the others still loaded
    assert k.fused_regions + k.fusions_refused == len(_regions(again))
    header = json.loads(victim.read_bytes().partition(b"\n")[0])   # rewritten, whole again
    assert header["format"] == 1 and header["bytes"] == len(victim.read_bytes().partition(b"\n")[2])


def test_a_foreign_kernel_entry_is_not_loaded(tmp_path):
    store = KernelStore(tmp_path)
    fn = lambda *a: a   # noqa: E731
    fn.artifact = b"payload"
    store.put("a" * 64, "fused", None, fn)
    (tmp_path / "kernels" / ("b" * 32 + ".kernel")).write_bytes(store.path("a" * 64).read_bytes())
    with pytest.warns(RuntimeWarning, match="foreign entry"):
        assert KernelStore(tmp_path).get("b" * 64) is None


def test_a_stock_verdict_is_stored_with_its_reason_and_no_code(tmp_path):
    store = KernelStore(tmp_path)
    store.put("c" * 64, "stock", "output 0 differs from stock in 3 of 8 elements", None)
    found = KernelStore(tmp_path).get("c" * 64)
    assert (found.verdict, found.reason, found.fn) == (
        "stock", "output 0 differs from stock in 3 of 8 elements", None)
    # a fused verdict without a serialized artifact (a compiler that cannot make one) is not kept
    store.put("d" * 64, "fused", None, lambda *a: a)
    assert not store.path("d" * 64).exists()


def _region(store, layout):
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    m = g.call_function(torch.ops.aten.mul.Tensor, (x, y))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (m, x)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    r = FusedRegion(gm, "fused_0", ["aten.mul.Tensor", "aten.add.Tensor"], layout=layout)
    r.resolve(store)
    return r


def test_a_stored_kernel_met_at_another_layout_is_verified_again(tmp_path, monkeypatch):
    compiled = []

    def compile_region(module, args, graph=None):
        compiled.append(tuple(args[0].shape))
        fn = lambda *a: module(*a)   # noqa: E731 - exact: the stock code itself
        fn.artifact = None
        return fn
    monkeypatch.setattr(fusion, "compile_region", compile_region)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    store = KernelStore(tmp_path)
    first = _region(store, fusion.input_layout([x, y]))
    out = first(x, y)
    assert first.state == "fused" and compiled == [(4, 3)]
    # stored with its verdict, but no artifact to store: keep one by hand, as a real compile does
    key = first._key(fusion.layout_key([x, y]))
    fn = lambda *a: first.stock(*a)   # noqa: E731
    fn.artifact = b"code"
    monkeypatch.setattr(region_kernels, "load_artifact", lambda blob: lambda *a: first.stock(*a))
    store.put(key, "fused", None, fn, layout=repr(fusion.layout_key([x, y])))
    loaded = _region(KernelStore(tmp_path), fusion.input_layout([x, y]))
    assert (loaded.state, loaded.loaded) == ("fused", True)
    assert torch.equal(loaded(x, y)[0], out[0]) and compiled == [(4, 3)]   # nothing compiled
    # a region traced at that layout but called at another (a fake value's strides that the
    # real kernel does not give): its first call sees the layout differ
    xt = torch.randn(3, 4).t()
    moved = _region(KernelStore(tmp_path), fusion.input_layout([x, y]))
    assert moved.state == "fused"
    got = moved(xt, y)
    assert torch.equal(got[0], xt * y + xt) and moved.state == "fused" and not moved.loaded
    assert compiled == [(4, 3), (4, 3)]                   # compiled and verified on these inputs


def test_recheck_verifies_every_region_again(fuse_on_cpu, stock, tmp_path, monkeypatch):
    cold = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert _same(stock, script(cold))
    monkeypatch.setattr(KernelStore, "_open", {})
    monkeypatch.setenv("CADENCE_FX_RECHECK_FUSION", "1")
    again = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert _same(stock, script(again))
    k = again.counters
    assert k.fusions_loaded == 0 and k.fused_regions == cold.counters.fused_regions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_restart_on_the_device_captures_with_the_stored_kernels(tmp_path, monkeypatch):
    """On the device: the restarted decoder's regions are Triton kernels loaded from the cache,
    captured in its classes' graphs with no verification run before, replayed bit-exact."""
    monkeypatch.setattr(fusion, "_COMPILED", {})
    monkeypatch.setattr(KernelStore, "_open", {})
    stock = script(make_decoder().cuda(), "cuda")
    cold = cadence_fx.compile(make_decoder().cuda(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert _same(stock, script(cold, "cuda"))
    assert cold.counters.fused_regions > 0 and cold.backend.verifications > 0
    fresh_process(monkeypatch)
    warm = cadence_fx.compile(make_decoder().cuda(), DECODER_ADAPTER, cache_dir=tmp_path)
    assert _same(stock, script(warm, "cuda"))
    k = warm.counters
    assert k.traces == 0 and k.fallbacks == 0 and k.replays > 0
    assert k.fusions_loaded == k.fused_regions == cold.counters.fused_regions
    assert warm.backend.verifications == 0 and warm.backend.captured > 0


def test_a_region_traced_at_another_layout_than_it_runs_at_still_loads(tmp_path, monkeypatch):
    """A region is found by its traced layout's key and checked against the layout its verdict
    was made at: where the trace's fake strides differ from the real kernels' (consistently, in
    every process), a restart still loads it instead of verifying it again."""
    compiled = []

    def compile_region(module, args, graph=None):
        compiled.append(1)
        fn = lambda *a: module(*a)   # noqa: E731 - exact: the stock code itself
        fn.artifact = b"code"
        return fn
    monkeypatch.setattr(fusion, "compile_region", compile_region)
    monkeypatch.setattr(region_kernels, "load_artifact", lambda blob: lambda *a: (a[0] * a[1] + a[0],))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    traced = fusion.input_layout([torch.randn(3, 4).t(), y])      # what the trace said
    cold = _region(KernelStore(tmp_path), traced)
    cold(x, y)
    assert cold.state == "fused" and not cold.loaded and compiled == [1]
    warm = _region(KernelStore(tmp_path), traced)
    assert torch.equal(warm(x, y)[0], x * y + x)
    assert (warm.state, warm.loaded, compiled) == ("fused", True, [1])   # nothing compiled again


def test_generated_modules_load_as_kept_code_objects(fuse_on_cpu, stock, tmp_path):
    """Inductor's generated modules are compiled once: a fresh process with empty Inductor caches
    takes every one it loads from ``kernels/code`` and compiles none, and runs exact."""
    cold = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir=tmp_path / "cache")
    assert _same(stock, script(cold))
    assert sorted((tmp_path / "cache" / "kernels" / "code").glob("*.pyc"))
    code = textwrap.dedent(f"""
        import json, sys; sys.path.insert(0, {str(HERE)!r})
        import torch
        import cadence_fx
        from cadence_fx import code_objects, fusion
        from cadence_fx.passes import exact_ops
        from streaming_decoder import DECODER_ADAPTER, make_decoder
        from test_decoder_lifecycle import _same, script
        exact_ops.DEVICES = ("cuda", "cpu")
        torch.set_num_threads(1)
        stock = script(make_decoder())
        warm = cadence_fx.compile(make_decoder(), DECODER_ADAPTER, cache_dir={str(tmp_path / "cache")!r})
        out = script(warm)
        print(json.dumps(dict(code_objects.stats, same=_same(stock, out),
                              kernels=warm.kernel_store.loads)))
    """)
    _, got = _fresh_process(tmp_path, code)
    assert got["same"] and got["kernels"] > 0
    assert got["kept"] >= got["kernels"] and got["compiled"] == 0, got


def test_a_damaged_code_object_is_reported_and_compiled_again(tmp_path, monkeypatch):
    from cadence_fx import code_objects
    monkeypatch.setattr(code_objects, "_DIR", tmp_path)
    path = str(tmp_path / "module.py")
    source = "def f():\n    return 1234567\n"
    first = code_objects._code(source, path)
    (entry,) = tmp_path.glob("*.pyc")
    data = bytearray(entry.read_bytes())
    at = data.index((1234567).to_bytes(4, "little"))
    data[at] ^= 1                                   # another constant, same length
    entry.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="truncated or corrupt"):
        again = code_objects._code(source, path)
    namespace: dict = {}
    exec(again, namespace)
    assert namespace["f"]() == 1234567 and again.co_filename == path == first.co_filename
    kept = code_objects._code(source, str(tmp_path / "elsewhere.py"))   # rewritten, and refiled
    assert kept.co_filename.endswith("elsewhere.py") and kept.co_consts[0].co_filename == kept.co_filename
