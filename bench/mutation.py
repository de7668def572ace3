"""Mutation testing of the core with mutmut (``pip install -e ".[mutation]"``); not run in CI.

    python bench/mutation.py                      # every core file (several hours on 2 cores)
    python bench/mutation.py --only passes/_carry_window.py cadence_fx/replay.py
    python bench/mutation.py --mutants 'cadence_fx.replay.*'   # re-run these mutants by name
    python bench/mutation.py --names-file NAMES --workers 30   # the names in a file (the device's cores)
    python bench/mutation.py --results            # per-file counts and the survivors, no run
    python bench/mutation.py --show NAME          # the diff of one mutant

The core (``CORE``): the carry pass, the replay guard, admission and absorption, the envelope
release/restore, the effect probe (``effects.py`` and ``probe_effects`` in
``class_probe.py``). ``cadence_fx/cudagraphs.py`` needs a GPU and is not mutated here.

mutmut copies ``[tool.mutmut] source_paths`` into ``mutants/`` and puts that directory first on
``sys.path``. The package maps ``passes/`` to ``cadence_fx.passes`` and ``adapters/`` to
``cadence_fx.adapters`` (pyproject ``package-dir``), which a copy of ``cadence_fx/`` alone would
miss: the tests would import the unmutated passes through the editable install. So the script
builds a staging tree under ``.mutation/`` (git-ignored) in which ``passes/`` and ``adapters/``
sit under ``cadence_fx/``, with ``tests/`` and ``pyproject.toml``, and runs mutmut there (its
results stay in ``.mutation/mutants/``). Files are copied only when their content changed, so
mutmut's cached results of unchanged files stay valid between runs. Before a run,
``self_check`` breaks a copy of a pass in a throwaway tree and checks that a test fails there
(and that the same test passes unbroken, importing the staged file); mutmut itself then runs its
forced-fail check against the mutated tree.

The tests (``[tool.mutmut] pytest_add_cli_args_test_selection``) are the fast CPU ones that
exercise the core; mutmut runs, for each mutant, only those that call the mutated function,
fastest first, stopping at the first failure. Hypothesis runs derandomized with shrinking off (a
conftest written into the staging tree only), so a mutant's verdict does not depend on the
draw. ``OMP_NUM_THREADS=1``, two workers.
"""
from __future__ import annotations

import argparse
import filecmp
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / ".mutation"

# repository path -> the names mutmut gives its mutants (by the staged module path)
CORE = {
    "passes/carry_retention.py": "cadence_fx.passes.carry_retention.*",
    "passes/_carry_window.py": "cadence_fx.passes._carry_window.*",
    "passes/_carry_envelope.py": "cadence_fx.passes._carry_envelope.*",
    "passes/_carry_graph.py": "cadence_fx.passes._carry_graph.*",
    "cadence_fx/replay.py": "cadence_fx.replay.*",
    "cadence_fx/admission.py": "cadence_fx.admission.*",
    "cadence_fx/envelopes.py": "cadence_fx.envelopes.*",
    "cadence_fx/effects.py": "cadence_fx.effects.*",
    "cadence_fx/class_probe.py": "cadence_fx.class_probe.x_probe_effects__mutmut_*",
}

# added to the staging tree's tests/conftest.py only: the property tests' verdicts must not depend on
# the draw, and a failing example is not shrunk (a killed mutant would take minutes)
STAGE_CONFTEST = '''\
import os
from hypothesis import Phase, settings

settings.register_profile("mutation", derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutation")
'''


def staged(path: str) -> str:
    """Where a repository file sits in the staging tree."""
    for top in ("passes/", "adapters/"):
        if path.startswith(top):
            return "cadence_fx/" + path
    return path


def _sync(src: Path, dst: Path, keep=()) -> None:
    """Mirror ``src`` into ``dst``, copying only changed files (the others keep their mtimes);
    entries of ``dst`` absent from ``src`` are removed. Entries named in ``keep`` are the staging
    tree's own: never copied over, never removed."""
    skip = ("__pycache__", ".pytest_cache", ".hypothesis")
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name in skip or entry.name in keep or entry.suffix == ".pyc":
            continue
        target = dst / entry.name
        if entry.is_dir():
            _sync(entry, target)
        elif not target.exists() or not filecmp.cmp(entry, target, shallow=False):
            shutil.copy2(entry, target)
    for entry in dst.iterdir():
        if entry.name not in skip and entry.name not in keep and not (src / entry.name).exists():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def stage() -> None:
    """Build or refresh ``.mutation/``: the package with its mapped subpackages inside it."""
    STAGE.mkdir(exist_ok=True)
    _sync(REPO / "cadence_fx", STAGE / "cadence_fx", keep=("passes", "adapters"))
    _sync(REPO / "passes", STAGE / "cadence_fx" / "passes")
    _sync(REPO / "adapters", STAGE / "cadence_fx" / "adapters")
    _sync(REPO / "tests", STAGE / "tests", keep=("conftest.py",))
    conftest = STAGE / "tests" / "conftest.py"   # the repository's fixtures, then the profile
    text = (REPO / "tests" / "conftest.py").read_text() + "\n" + STAGE_CONFTEST
    if not conftest.exists() or conftest.read_text() != text:
        conftest.write_text(text)
    for name in ("pyproject.toml", "README.md"):
        if not (STAGE / name).exists() or not filecmp.cmp(REPO / name, STAGE / name, shallow=False):
            shutil.copy2(REPO / name, STAGE / name)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CADENCE_FX_SCHEDULES="10")
    # the staged tree must come first: drop the repository from the path, keep the rest (the
    # device's site folder of carried wheels)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and Path(p).resolve() != REPO)
    return env


def self_check() -> None:
    """A broken staged pass must fail a test, and the unbroken one pass it: the tests import the
    staged tree, not the editable install."""
    check = STAGE / "check"
    shutil.rmtree(check, ignore_errors=True)
    check.mkdir()
    for name in ("cadence_fx", "tests", "pyproject.toml"):
        src = STAGE / name
        shutil.copytree(src, check / name) if src.is_dir() else shutil.copy2(src, check / name)
    cmd = [sys.executable, "-c",
           "import sys, pytest, cadence_fx.passes._carry_window as w; "
           "assert w.__file__.startswith(sys.argv[1]), w.__file__; "
           "sys.exit(pytest.main(['-x', '-q', '-p', 'no:cacheprovider', sys.argv[2]]))",
           str(check), "tests/test_carry_pass.py::test_envelope_stream_bit_exact"]
    # python -c puts the working directory first on sys.path, as mutmut puts mutants/ first
    ok = subprocess.run(cmd, cwd=check, env=_env(), capture_output=True, text=True)
    if ok.returncode != 0:
        sys.exit("self-check: the unbroken staging tree fails its test:\n" + ok.stdout + ok.stderr)
    broken = check / "cadence_fx" / "passes" / "_carry_window.py"
    broken.write_text(broken.read_text() + "\nraise RuntimeError('broken on purpose')\n")
    bad = subprocess.run(cmd, cwd=check, env=_env(), capture_output=True, text=True)
    if bad.returncode == 0:
        sys.exit("self-check: a broken staged pass still passes its test: the tests do not "
                 "import the staged tree")
    shutil.rmtree(check)
    print("self-check: the tests import the staged tree (a broken pass fails them)")


def mutmut(*args: str) -> int:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=STAGE, env=_env()).returncode


def results() -> dict:
    """Per core file: its mutants' verdicts. mutmut keeps the verdicts of its latest run in its
    metadata (a change of the test selection resets them all, and only the mutants named are
    run again); ``.mutation/verdicts.json`` keeps, per mutant, its first verdict and its latest
    one, so a re-run of the survivors after new tests adds to the first full run."""
    from mutmut.stats import status_by_exit_code

    book = STAGE / "verdicts.json"
    verdicts = json.loads(book.read_text()) if book.exists() else {}
    for path, pattern in CORE.items():
        meta = STAGE / "mutants" / (staged(path) + ".meta")
        if not meta.exists():
            continue
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if not fnmatch.fnmatch(name, pattern):
                continue
            status = status_by_exit_code[code]
            v = verdicts.setdefault(name, {"first": status, "last": status})
            if status != "not checked":
                if v["first"] == "not checked":
                    v["first"] = status
                v["last"] = status
    book.write_text(json.dumps(verdicts, indent=0, sort_keys=True))
    out = {}
    for path, pattern in CORE.items():
        mine = {n: v for n, v in verdicts.items() if fnmatch.fnmatch(n, pattern)}
        if not mine:
            continue
        counts: dict = {}
        for v in mine.values():
            counts[v["last"]] = counts.get(v["last"], 0) + 1
        out[path] = {"total": len(mine), "counts": counts,
                     "first_counts": {s: sum(v["first"] == s for v in mine.values())
                                      for s in {v["first"] for v in mine.values()}},
                     "not_killed": {n: v["last"] for n, v in sorted(mine.items())
                                    if v["last"] != "killed"},
                     "killed_on_rerun": sorted(n for n, v in mine.items()
                                               if v["first"] != "killed" and v["last"] == "killed")}
    return out


def print_results(res: dict) -> None:
    killed = total = 0
    first = sum(r["first_counts"].get("killed", 0) for r in res.values())
    for path, r in res.items():
        k = r["counts"].get("killed", 0)
        killed, total = killed + k, total + r["total"]
        rest = "  ".join(f"{n} {s}" for s, n in sorted(r["counts"].items()) if s != "killed")
        print(f"{path:32s} {r['total']:5d} mutants {k:5d} killed  {rest}")
    if total:
        print(f"{'all':32s} {total:5d} mutants {killed:5d} killed ({100 * killed / total:.1f}%); "
              f"{first} ({100 * first / total:.1f}%) at their first run")
    for r in res.values():
        for name, s in r["not_killed"].items():
            print(f"  {s}: {name}")


def diffs(names) -> dict:
    """Mutant name -> the lines it changes (``-`` original, ``+`` mutated)."""
    os.chdir(STAGE)   # mutmut reads its configuration from the working directory
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    out = {}
    for name in names:
        path = next(staged(p) for p, pattern in CORE.items() if fnmatch.fnmatch(name, pattern))
        lines = get_diff_for_mutant(name, path=path).splitlines()
        out[name] = [ln for ln in lines[2:] if ln[:1] in "+-"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="FILE", choices=sorted(CORE),
                    help="mutate these core files (repository paths) only")
    ap.add_argument("--mutants", nargs="+", metavar="NAME",
                    help="run these mutants (names or globs)")
    ap.add_argument("--names-file", metavar="FILE",
                    help="run the mutants named in this file (one name or glob a line)")
    ap.add_argument("--results", action="store_true", help="print the results of earlier runs")
    ap.add_argument("--show", metavar="NAME", help="print the diff of one mutant")
    ap.add_argument("--diffs", action="store_true",
                    help="with --results: the changed lines of every mutant not killed")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    if a.show:
        stage()
        return mutmut("show", a.show)
    if not a.results:
        stage()
        self_check()
        listed = Path(a.names_file).read_text().split() if a.names_file else []
        names = (a.mutants or []) + listed or [CORE[p] for p in (a.only or CORE)]
        rc = mutmut("run", "--max-children", str(a.workers), *names)
        if rc != 0:
            return rc
    res = results()
    (STAGE / "results.json").write_text(json.dumps(res, indent=1))
    print_results(res)
    if a.diffs:
        names = [n for r in res.values() for n, s in r["not_killed"].items() if s != "not checked"]
        for name, lines in diffs(names).items():
            print(f"\n{name} ({next(r['not_killed'][name] for r in res.values() if name in r['not_killed'])})")
            print("\n".join("    " + ln.strip() if ln[0] == "-" else "  + " + ln[1:].strip() for ln in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
