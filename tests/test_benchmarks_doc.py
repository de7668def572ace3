"""docs/benchmarks.md names every script in bench/ with its command, and bench/ stands on its own:
no script imports from tests/, and the scripts import each other without a cycle. Reads the
source only; nothing is run. Each check also runs on a made-up case it must catch."""
import ast
import pathlib
import re

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DOC = ROOT / "docs" / "benchmarks.md"


def _scripts():
    return sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))


def _runnable(path: pathlib.Path) -> bool:
    """A script with a command line (a shell script, a ``__main__`` block, a pytest file), as
    opposed to a module the scripts import."""
    text = path.read_text()
    return path.suffix == ".sh" or "__main__" in text or path.name.startswith("test_")


def _has_command(rel: str, doc: str) -> bool:
    """``python bench/x.py ...``, ``bash bench/x.sh``, ``pytest bench/x.py``, or a code span that
    starts with the script and gives it arguments (`bench/x.py --out f.json`)."""
    name = re.escape(rel)
    return bool(re.search(rf"(?:python3?|bash|pytest) {name}\b", doc)
                or re.search(rf"`{name} [^`]+`", doc))


def _imports(text: str, local):
    """The modules ``text`` imports, a script of ``local`` by its name."""
    for node in ast.walk(ast.parse(text)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            yield name.split(".")[0] if name.split(".")[0] in local else name


def _undocumented(scripts, doc: str):
    """``(missing, no_command)``: the scripts (``{"bench/x.py": runnable}``) the doc never
    names, and the runnable ones it names without a command."""
    missing = [rel for rel in scripts if rel not in doc]
    no_command = [rel for rel, runnable in scripts.items()
                  if rel in doc and runnable and not _has_command(rel, doc)]
    return missing, no_command


def _from_tests(sources, tests):
    """``{script: [modules of tests/ it imports]}``, and the scripts that put tests/ on the
    import path, for ``sources`` (``{name: text}``)."""
    offenders = {name: sorted({m.split(".")[0] for m in _imports(text, sources)} & tests)
                 for name, text in sources.items()}
    on_path = [name for name, text in sources.items()
               if re.search(r"sys\.path\.\w+\([^\n]*tests", text)]
    return {k: v for k, v in offenders.items() if v}, on_path


def _import_graph(sources) -> nx.DiGraph:
    g = nx.DiGraph()
    for name, text in sources.items():
        g.add_node(name)
        g.add_edges_from((name, m) for m in _imports(text, sources) if m in sources and m != name)
    return g


def _cycles(g: nx.DiGraph):
    return sorted(sorted(c) for c in nx.simple_cycles(g))


def _bench_sources():
    return {p.stem: p.read_text() for p in BENCH.glob("*.py")}


def test_every_script_is_in_the_doc_with_its_command():
    scripts = {f"bench/{p.name}": _runnable(p) for p in _scripts()}
    missing, no_command = _undocumented(scripts, DOC.read_text())
    assert not missing, f"docs/benchmarks.md never names {missing}: say what each measures"
    assert not no_command, (f"docs/benchmarks.md names {no_command} without a command "
                            "(`python bench/x.py --out f.json`)")


def test_the_check_sees_a_script_without_its_command():
    assert _has_command("bench/suite.py", "$ python bench/suite.py --out s.json")
    assert _has_command("bench/suite_report.py", "`bench/suite_report.py <json>` writes")
    assert not _has_command("bench/suite.py", "the suite, `bench/suite.py`, measures")
    assert not _has_command("bench/suite.py", "$ python bench/suite_whole.py --out c.json")


def test_the_check_sees_a_script_the_doc_never_names():
    doc = "`python bench/suite.py --out s.json`; `bench/common.py` holds what they share"
    scripts = {"bench/suite.py": True, "bench/common.py": False, "bench/replay.py": True,
               "bench/warm.sh": True}
    assert _undocumented(scripts, doc) == (["bench/replay.py", "bench/warm.sh"], [])
    assert _undocumented({"bench/common.py": True}, doc) == ([], ["bench/common.py"])


def test_nothing_in_bench_imports_from_tests():
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    offenders, on_path = _from_tests(_bench_sources(), tests)
    assert not offenders, f"bench/ imports from tests/: {offenders}; move it to bench/common.py or the package"
    assert not on_path, f"{on_path} put tests/ on the import path"


def test_the_check_sees_an_import_from_tests():
    sources = {"a": "from helpers import same\nimport torch", "b": "import op_count.counts",
               "c": "import common\nfrom cadence_fx import compile",
               "d": "import sys\nsys.path.insert(0, str(ROOT / 'tests'))"}
    offenders, on_path = _from_tests(sources, {"helpers", "op_count", "conftest"})
    assert offenders == {"a": ["helpers"], "b": ["op_count"]} and on_path == ["d"]


def test_no_import_cycle_in_bench():
    g = _import_graph(_bench_sources())
    assert g.has_edge("suite", "suite_whole") and g.has_edge("suite_whole", "common")
    cycles = _cycles(g)
    assert not cycles, f"import cycles in bench/: {cycles}"


def test_the_check_sees_an_import_cycle():
    sources = {"sessions": "import common\nfrom sessions_churn import churn",
               "sessions_churn": "import sessions", "common": "import torch"}
    assert _cycles(_import_graph(sources)) == [["sessions", "sessions_churn"]]
    del sources["sessions_churn"]
    assert _cycles(_import_graph(sources)) == []
