"""Mutation testing of the GPU-only lowering (``cadence_fx/cudagraphs.py``) with mutmut, on a CUDA
machine; not run in CI. The CPU core is ``bench/mutation.py``'s; this script reuses its staging
(``passes/`` and ``adapters/`` inside the package) in a tree of its own, ``.mutation-gpu/``.

    python bench/mutation_gpu.py --workers 8      # every mutant of cudagraphs.py
    python bench/mutation_gpu.py --results        # counts and the mutants not killed

The tests are the GPU tests of ``tests/test_gpu.py`` on the toy step (the real-model ones are left
out: they take tens of seconds each and reach the same code). mutmut runs in its forkserver mode:
the server collects the tests without creating a CUDA context
(``PYTORCH_NVML_BASED_CUDA_CHECK=1`` keeps ``torch.cuda.is_available()`` from initialising
CUDA), and every mutant runs in a forked child that creates its own, so several children share
the one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation as cpu  # noqa: E402  (bench/mutation.py: staging, verdict book-keeping)

REPO = cpu.REPO
STAGE = REPO / ".mutation-gpu"
TARGET = "cadence_fx/cudagraphs.py"
PATTERN = "cadence_fx.cudagraphs.*"
TESTS = ["tests/test_gpu.py", "tests/test_gpu_lowering.py"]
DESELECT = "not real and not moshi and not copied_dit and not freeze_omni"

def mutmut_section(exclude=()) -> str:
    deselect = " and ".join([DESELECT] + [f"not {name}" for name in exclude])
    return f'''[tool.mutmut]
source_paths = ["cadence_fx"]
only_mutate = ["{TARGET}"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "gpu", "-k", "{deselect}"]
pytest_add_cli_args_test_selection = {json.dumps(TESTS)}
process_isolation = "forkserver"
use_git_change_detection = false
'''


def stage(exclude=()) -> None:
    cpu.STAGE = STAGE
    cpu.stage()
    toml = STAGE / "pyproject.toml"
    text = (REPO / "pyproject.toml").read_text()
    text = re.sub(r"\[tool\.mutmut\].*?(?=\n\[|\Z)", mutmut_section(exclude), text, flags=re.S)
    if toml.read_text() != text:
        toml.write_text(text)


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTORCH_NVML_BASED_CUDA_CHECK="1",
             CUBLAS_WORKSPACE_CONFIG=":4096:8")
    # the staged tree must come first; keep the rest (the device's site folder of model wheels)
    e["PYTHONPATH"] = os.pathsep.join(p for p in e.get("PYTHONPATH", "").split(os.pathsep)
                                      if p and Path(p).resolve() != REPO)
    return e


def results() -> dict:
    from mutmut.stats import status_by_exit_code

    meta = STAGE / "mutants" / (TARGET + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    verdicts = {n: status_by_exit_code[c] for n, c in codes.items()}
    counts: dict = {}
    for s in verdicts.values():
        counts[s] = counts.get(s, 0) + 1
    return {"file": TARGET, "total": len(verdicts), "counts": counts,
            "not_killed": {n: s for n, s in sorted(verdicts.items()) if s != "killed"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--mutants", nargs="+", metavar="NAME", help="run these mutants only")
    ap.add_argument("--results", action="store_true", help="print the results, no run")
    ap.add_argument("--diffs", action="store_true", help="with the results: each survivor's diff")
    ap.add_argument("--exclude", nargs="+", default=(), metavar="TEST",
                    help="leave these tests out (e.g. ones failing on the unmutated code)")
    a = ap.parse_args(argv)
    stage(a.exclude)
    if not a.results:
        import torch
        if not torch.cuda.is_available():
            sys.exit("mutation_gpu: needs CUDA (the mutated code only runs on a GPU)")
        rc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children",
                             str(a.workers), *(a.mutants or [PATTERN])], cwd=STAGE, env=env()).returncode
        if rc != 0:
            return rc
    res = results()
    (STAGE / "results.json").write_text(json.dumps(res, indent=1))
    k = res["counts"].get("killed", 0)
    print(f"{TARGET}: {res['total']} mutants, {k} killed "
          f"({100 * k / max(res['total'], 1):.1f}%); {res['counts']}")
    for name, s in res["not_killed"].items():
        print(f"  {s}: {name}")
        if a.diffs:
            out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=STAGE,
                                 env=env(), capture_output=True, text=True).stdout
            print("\n".join("      " + ln for ln in out.splitlines() if ln[:1] in "+-"
                            and not ln.startswith(("+++", "---"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
