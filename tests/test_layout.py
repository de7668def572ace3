"""The house rules a reader relies on: no import cycle inside the package, passes/ one layer that
imports no runtime module, no module past what one reader can hold, no function past what one
screen shows. Walks the source, so it fails when a change breaks any of them."""
import ast
import pathlib
import subprocess
import sys
from typing import List, Optional

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# package name -> directory, as pyproject.toml installs them
PACKAGES = {"cadence_fx": ROOT / "cadence_fx", "cadence_fx.models": ROOT / "cadence_fx" / "models",
            "cadence_fx.passes": ROOT / "passes", "cadence_fx.adapters": ROOT / "adapters",
            "cadence_fx.serve": ROOT / "cadence_fx" / "serve"}
MAX_FUNCTION_LINES = 60   # CONTRIBUTING.md, "Short functions"
MAX_LINES = 420   # "about 400" (CONTRIBUTING.md, "Short functions"), with a little slack for a docstring
# what a module of passes/ may import ("Passes are one layer", CONTRIBUTING.md): passes/, the
# adapter contract and errors of cadence_fx, torch, networkx and the standard library
LAYER = ("cadence_fx.passes", "cadence_fx.contract", "cadence_fx.errors")
LAYER_LIBRARIES = {"torch", "networkx", "__future__"} | set(sys.stdlib_module_names)


def _modules():
    for package, directory in PACKAGES.items():
        for path in sorted(directory.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            yield name, package, path


def _from_module(node: ast.ImportFrom, name: str, package: str, is_package: bool) -> str:
    """The absolute name of the module a ``from ... import`` reads (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = (name if is_package else package).split(".")
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, package: str, path: pathlib.Path):
    """Every cadence_fx module ``path`` imports, at module level or inside a function."""
    is_package = path.stem == "__init__"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, package, is_package)
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith("cadence_fx"):
                yield t


def _graph() -> nx.DiGraph:
    known = {name for name, _, _ in _modules()}
    g = nx.DiGraph()
    for name, package, path in _modules():
        g.add_node(name)
        for target in _imports(name, package, path):
            if target in known and target != name:
                g.add_edge(name, target)
    return g


def test_the_walk_sees_the_package():
    g = _graph()
    assert {"cadence_fx.runtime", "cadence_fx.class_compiler", "cadence_fx.passes.carry_retention"} <= set(g)
    assert g.has_edge("cadence_fx.runtime", "cadence_fx.class_compiler")
    assert g.has_edge("cadence_fx.tracing", "cadence_fx.splice")


def test_no_import_cycle_between_modules():
    g = _graph()
    # a package's __init__ importing its own modules is how a package exports; only cycles
    # between modules count
    g.remove_nodes_from(list(PACKAGES))
    cycles = sorted(sorted(c) for c in nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles}"


def _outside_the_layer(name: str, path: pathlib.Path, source: Optional[str] = None) -> List[str]:
    """What a module of passes/ imports beyond ``LAYER`` and ``LAYER_LIBRARIES``, at module level
    or inside a function (``from cadence_fx import fusion`` is an import of cadence_fx.fusion)."""
    known = {n for n, _, _ in _modules()}
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, "cadence_fx.passes", path.stem == "__init__")
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [t for t in targets if t.split(".")[0] not in LAYER_LIBRARIES
                  and not any(t == allowed or t.startswith(allowed + ".") for allowed in LAYER)]
    return sorted(set(found))


PASSES = [(n, p) for n, package, p in _modules() if package == "cadence_fx.passes"]


@pytest.mark.parametrize("name,path", PASSES, ids=lambda v: str(v))
def test_passes_are_one_layer(name, path):
    """A module of passes/ imports passes/, the adapter contract and errors, torch and networkx:
    runtime objects are built from the specs it emits (``passes/specs.py``), not by it."""
    outside = _outside_the_layer(name, path)
    assert not outside, (f"{name} imports {outside}; emit a spec (passes/specs.py) for the runtime "
                         "to build, or move what it needs into passes/")


def test_the_layer_check_sees_an_import_of_the_runtime():
    path = ROOT / "passes" / "lower_guarded.py"
    assert len(PASSES) > 20
    assert _outside_the_layer("cadence_fx.passes.lower_guarded", path,
                              "import operator\nimport torch.fx\nimport networkx as nx\n"
                              "from cadence_fx.contract import APPEND\nfrom .context import PassContext\n"
                              "from cadence_fx.errors import CadenceError\n") == []
    assert _outside_the_layer("cadence_fx.passes.lower_guarded", path,
                              "from cadence_fx.replay import GuardedPiece\nimport numpy\n"
                              "def f():\n    from cadence_fx import fusion\n"
                              "    from .. import audit\n") == \
        ["cadence_fx.audit", "cadence_fx.fusion", "cadence_fx.replay", "numpy"]


@pytest.mark.parametrize("name,path", [(n, p) for n, _, p in _modules()], ids=lambda v: str(v))
def test_module_fits_one_reader(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it along the architecture"


@pytest.mark.parametrize("name,path", [(n, p) for n, _, p in _modules()], ids=lambda v: str(v))
def test_no_function_is_longer_than_a_screen(name, path):
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines, line {f.lineno})"
            for f in ast.walk(ast.parse(path.read_text()))
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{name}: {', '.join(long)}; split each into the steps it is made of"


def test_the_command_line_help_does_not_import_torch():
    """``cadence-fx --help`` (and each subcommand's) answers without loading torch."""
    code = ("import sys\nfrom cadence_fx.cli import main\n"
            "for argv in (['--help'], ['demo', '--help'], ['analyze', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: cadence-fx" in out.stdout and out.stdout.strip().endswith("False")
    import cadence_fx
    assert callable(cadence_fx.pin_deterministic_kernels)


def test_every_test_that_needs_cuda_is_marked_gpu(request):
    """The device runs ``pytest -m gpu``: a CUDA test without the mark would never run anywhere."""
    unmarked = [item.nodeid for item in request.session.items
                if any("CUDA" in m.kwargs.get("reason", "") for m in item.iter_markers("skipif"))
                and item.get_closest_marker("gpu") is None]
    assert not unmarked
