"""docs/benchmarks.md names every script in bench/ with its command, and bench/ stands on its own:
no script imports from tests/, and the scripts import each other without a cycle. Reads the
source only; nothing is run."""
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


def _bench_imports(path: pathlib.Path):
    local = {p.stem for p in BENCH.glob("*.py")}
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            yield name.split(".")[0] if name.split(".")[0] in local else name


def test_every_script_is_in_the_doc_with_its_command():
    doc = DOC.read_text()
    missing, no_command = [], []
    for path in _scripts():
        rel = f"bench/{path.name}"
        if rel not in doc:
            missing.append(rel)
        elif _runnable(path) and not _has_command(rel, doc):
            no_command.append(rel)
    assert not missing, f"docs/benchmarks.md never names {missing}: say what each measures"
    assert not no_command, (f"docs/benchmarks.md names {no_command} without a command "
                            "(`python bench/x.py --out f.json`)")


def test_the_check_sees_a_script_without_its_command():
    assert _has_command("bench/suite.py", "$ python bench/suite.py --out s.json")
    assert _has_command("bench/suite_report.py", "`bench/suite_report.py <json>` writes")
    assert not _has_command("bench/suite.py", "the suite, `bench/suite.py`, measures")
    assert not _has_command("bench/suite.py", "$ python bench/suite_whole.py --out c.json")


def test_nothing_in_bench_imports_from_tests():
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    offenders = {p.name: sorted(set(_bench_imports(p)) & tests) for p in BENCH.glob("*.py")}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"bench/ imports from tests/: {offenders}; move it to bench/common.py or the package"
    on_path = [p.name for p in BENCH.glob("*.py")
               if re.search(r"sys\.path\.\w+\([^\n]*tests", p.read_text())]
    assert not on_path, f"{on_path} put tests/ on the import path"


def test_no_import_cycle_in_bench():
    local = {p.stem for p in BENCH.glob("*.py")}
    g = nx.DiGraph()
    for path in BENCH.glob("*.py"):
        g.add_node(path.stem)
        g.add_edges_from((path.stem, m) for m in _bench_imports(path) if m in local and m != path.stem)
    assert g.has_edge("suite", "suite_whole") and g.has_edge("suite_whole", "common")
    cycles = sorted(sorted(c) for c in nx.simple_cycles(g))
    assert not cycles, f"import cycles in bench/: {cycles}"
