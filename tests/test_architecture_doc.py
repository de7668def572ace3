"""docs/architecture.md is the map of the code, so it is checked against the code: every module
under cadence_fx/, passes/ and adapters/ is named in it, and the pass list of its "One call"
section is the pipeline ``build_pipeline`` makes from the default options, in order. A module
added or a pass registered without a line in the map fails here, naming what is missing."""
import pathlib
import re

from cadence_fx.passes.pipeline import Options, build_pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("cadence_fx", "passes", "adapters")
CHAIN = re.compile(r"`(\w+)`(?:\s*→\s*`\w+`)+")


def _modules():
    return sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _named(path: pathlib.Path, text: str, modules) -> bool:
    """A module is named by its path from the repository root in backticks (a package's
    ``__init__.py`` also by its folder, `cadence_fx/serve/`), or by its file name alone when no
    other module has that name (`splice.py` next to `cadence_fx/tracing.py`)."""
    rel = path.relative_to(ROOT).as_posix()
    if f"`{rel}`" in text or rel in re.findall(r"`([^`]+)`", text):
        return True
    if path.name == "__init__.py":
        return f"`{path.parent.relative_to(ROOT).as_posix()}/`" in text
    unique = sum(p.name == path.name for p in modules) == 1
    return unique and f"`{path.name}`" in text


def _pass_chain(text: str):
    section = text.split("## One call", 1)[1].split("\n## ", 1)[0]
    chains = [re.findall(r"`(\w+)`", m.group(0)) for m in CHAIN.finditer(section)]
    assert len(chains) == 1, f"the One call section should hold one pass chain (`a` → `b`), found {chains}"
    return chains[0]


def test_every_module_is_named():
    text = DOC.read_text()
    modules = _modules()
    missing = [p.relative_to(ROOT).as_posix() for p in modules if not _named(p, text, modules)]
    assert not missing, (f"docs/architecture.md never names {missing}; add a line saying what each "
                         "holds (its docstring's first sentence is a start)")


def test_the_check_sees_an_unnamed_module():
    text = DOC.read_text()
    modules = _modules()
    assert _named(ROOT / "cadence_fx" / "runtime.py", text, modules)
    assert not _named(ROOT / "cadence_fx" / "no_such_module.py", text, modules)
    # a shared file name counts only with its folder
    assert not _named(ROOT / "adapters" / "moshi.py", "`moshi.py`", modules)
    assert len(modules) > 60


def test_pass_list_is_the_pipeline():
    registered = [name for name, _ in build_pipeline(Options())]
    documented = _pass_chain(DOC.read_text())
    assert documented == registered, (f"docs/architecture.md lists the passes {documented}, the "
                                      f"pipeline runs {registered} (passes/pipeline.py)")
