"""The documented examples run, and their output is what the documents say.

``docs/writing-an-adapter.md``: the ``analyze --json`` example against the command's output, the
Python catalog example against the values in its comments, the worked example's declaration,
bytes and extents against the registered Token2Wav adapter, and the catalog-width table against
the registered adapters. README: when adapter paths are checked, what ``cadence-fx analyze``
prints, the adapter spec forms ``explain`` takes, and what ``compiled.report()`` shows in a
script. Everything here derives numbers from the adapters or runs the small toy steps: no model
is built, so it stays fast on a CPU. (The README's first snippet runs in ``test_readme.py``.)"""
import contextlib
import dataclasses
import io
import json
import pathlib
import re
import shlex

import pytest
import torch

import cadence_fx
from cadence_fx import adapters, cli
from cadence_fx.catalog import build_catalog
from cadence_fx.errors import ContractError

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "writing-an-adapter.md").read_text()
README = (ROOT / "README.md").read_text()


def _block(text: str, lang: str, after: str) -> str:
    """The first fenced ``lang`` block after the text ``after``."""
    start = text.index(after)
    return re.search(rf"```{lang}\n(.*?)```", text[start:], re.S).group(1)


def _run_cli(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()


def _assert_within(doc, actual, where="output"):
    """Every value the document shows is the actual one; lists have every element."""
    if isinstance(doc, dict):
        assert isinstance(actual, dict), where
        for k, v in doc.items():
            assert k in actual, f"{where}: the document shows {k!r}, the command prints none"
            _assert_within(v, actual[k], f"{where}.{k}")
    elif isinstance(doc, list):
        assert isinstance(actual, list) and len(doc) == len(actual), f"{where}: {doc} vs {actual}"
        for i, (a, b) in enumerate(zip(doc, actual)):
            _assert_within(a, b, f"{where}[{i}]")
    else:
        assert doc == actual, f"{where}: the document says {doc!r}, the command prints {actual!r}"


# -- docs/writing-an-adapter.md ------------------------------------------------------------------

def test_the_analyze_json_example_is_what_the_command_prints():
    block = _block(GUIDE, "console", "Then look at what the declarations imply")
    command, shown = block.split("\n", 1)
    assert command.startswith("$ cadence-fx ")
    actual = json.loads(_run_cli(shlex.split(command[2:])[1:]))
    doc = json.loads(shown)
    _assert_within(doc, actual)
    # what the example leaves out is named in the paragraph after it
    after = GUIDE[GUIDE.index(block) + len(block):].split("```python")[0]
    left_out = set(actual["regions"][0]) - set(doc["regions"][0])
    assert left_out and all(f"`{k}`" in after for k in left_out), left_out
    assert set(actual) == set(doc)


def test_the_python_catalog_example_gives_the_values_in_its_comments():
    block = _block(GUIDE, "python", "The same numbers come from Python")
    namespace: dict = {}
    lines = block.splitlines()
    exec("\n".join(line for line in lines if line.startswith(("from ", "catalog ="))), namespace)
    checked = 0
    for line in lines:
        code, _, said = line.partition("#")
        said = said.strip()
        if not code.strip() or code.startswith(("from ", "catalog =")):
            continue
        value = eval(code, namespace)
        if re.fullmatch(r"[\d.]+(\.\.\.)?", said):
            assert f"{value}".startswith(said.rstrip(".")), (code, value, said)
            checked += 1
        elif said.startswith("what --json prints"):   # the rest is named in the comment
            printed = json.loads(_run_cli(["analyze", "minicpmo-token2wav", "--json"]))
            more = set(value) - set(printed)
            more |= set(value["regions"][0]) - set(printed["regions"][0])
            comment = " ".join(x.partition("#")[2] for x in lines[lines.index(line):])
            assert more and all(k in comment for k in more), more
            checked += 1
    assert checked == 3


def test_the_worked_example_is_the_registered_token2wav_adapter():
    from cadence_fx.adapters import minicpmo_token2wav as t2w
    block = _block(GUIDE, "python", "declares the paper's operating point")
    shown = dict(re.findall(r'"(\w+)": (\d+)', block.split("ESTIMATOR_ATT")[0]))
    assert shown and {k: int(v) for k, v in shown.items()} == {k: t2w.CLOCKS[k] for k in shown}
    namespace = {name: getattr(t2w, name) for name in ("Region", "PromptRetained", "PREPEND")}
    exec("ESTIMATOR_ATT" + block.split("ESTIMATOR_ATT", 1)[1], namespace)
    assert namespace["ESTIMATOR_ATT"] == t2w.ESTIMATOR_ATT
    catalog = build_catalog(adapters.get("minicpmo-token2wav"))
    est = catalog.region("estimator_att_cache")
    text = GUIDE[GUIDE.index("Reading it in the paper's terms"):]
    assert f"{est.stock_bytes:,} bytes" in text and f"{est.declared_bytes:,} bytes" in text
    assert f"rho = {est.rho:.2f}" in text and f"A-dagger = {est.bound} + {est.room} = " \
        f"{est.declared_extent}" in text
    assert "Extents {" + ", ".join(map(str, est.extents)) + "}" in text
    mel, source = catalog.region("hift_mel_cache"), catalog.region("hift_source_cache")
    assert (f"{{{', '.join(map(str, mel.extents))}}} mel frames and "
            f"{{{', '.join(map(str, source.extents))}}} samples, K = {mel.K}") in text


@pytest.mark.parametrize("family,adapter,region", [
    ("Token2Wav", "minicpmo-token2wav", "estimator_att_cache"),
    ("Moshi / PersonaPlex", "moshi", "lm_kv"),
    ("Freeze-Omni", "freeze-omni", "att_cache"),
    ("LLM backbone", "llm-backbone", "kv")])
def test_the_catalog_width_table_is_what_the_adapters_imply(family, adapter, region):
    row = next(line for line in GUIDE.splitlines() if line.startswith(f"| {family} |"))
    _, _, extents, K, verdict = [c.strip() for c in row.strip("|").split("|")]
    r = build_catalog(adapters.get(adapter)).region(region)
    shown = [int(x.replace(",", "")) for x in re.findall(r"[\d,]+", extents)]
    assert (shown if "..." not in extents else [shown[0], shown[-1]]) == \
        (list(r.extents) if "..." not in extents else [r.extents[0], r.extents[-1]])
    assert int(K) == r.K and verdict == ("admissible" if r.admissible else "excluded")


def test_the_guide_names_a_field_only_if_the_region_has_it():
    table = GUIDE[GUIDE.index("| field | meaning |"):GUIDE.index("**Retention policies**")]
    named = re.findall(r"^\| `(\w+)`", table, re.M)
    fields = {f.name for f in dataclasses.fields(cadence_fx.contract.Region)}
    assert set(named) <= fields and "room" in named


# -- README ----------------------------------------------------------------------------------------

def _toy():
    from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
    return PromptRetainedToy(), PROMPT_RETAINED_ADAPTER


def test_readme_an_argument_path_is_refused_at_compile_time():
    assert "is refused at compile time, with the\nstep's arguments and the adapter or " \
           "`adapter.select(...)` that fits" in README
    from cadence_fx.models.toy import CONV_ADAPTER, ConvLeftContextToy
    region = dataclasses.replace(CONV_ADAPTER.regions[0], input="conv_cach")
    bad = dataclasses.replace(CONV_ADAPTER, regions=(region,) + CONV_ADAPTER.regions[1:])
    with pytest.raises(ContractError, match=r"the step's arguments are \['x', 'conv_cache', "
                                            r"'att_cache'\]\. Use adapter\.select\('att'\)"):
        cadence_fx.compile(ConvLeftContextToy(), bad)


def test_readme_a_key_is_refused_at_the_first_call_that_hands_it_over():
    assert "checked at the first call that hands the\nargument over: a key it does not hold is " \
           "refused there, with the keys it holds" in README
    model, adapter = _toy()
    bad = dataclasses.replace(adapter, regions=(dataclasses.replace(adapter.regions[0],
                                                                    input="cache.atx"),))
    compiled = cadence_fx.compile(model, bad)        # compile time cannot see the dict's keys
    with torch.no_grad():
        _, state = compiled(torch.randn(1, 24, 64), None)     # the priming pass hands none over
        with pytest.raises(ContractError, match=r"the step's 'cache' holds \['att'\]; fix the "
                                                r"region's `input`"):
            compiled(torch.randn(1, 8, 64), {"att": state["att"].clone()})


def test_readme_analyze_prints_what_it_says():
    said = re.search(r"`cadence-fx analyze minicpmo-token2wav` prints (.*?)\.\n", README, re.S).group(1)
    assert "extents, catalog width K" in said and "stock vs declared bytes" in said
    out = _run_cli(["analyze", "minicpmo-token2wav"])
    est = build_catalog(adapters.get("minicpmo-token2wav")).region("estimator_att_cache")
    line = next(x for x in out.splitlines() if "estimator_att_cache" in x)
    assert f"K={est.K}" in line and "extents [302, 352, 402]" in line and "admissible" in line
    assert "stock 2,000.0 MiB -> declared 572.5 MiB" in line


@pytest.mark.parametrize("spec", ["cadence_fx.models.toy:CONV_ADAPTER",
                                  "tests/streaming_decoder.py:DECODER_ADAPTER"])
def test_readme_explain_takes_a_module_or_a_file_and_a_name(spec, monkeypatch):
    assert "may also be named `pkg.module:NAME` or `path/to/file.py:NAME`" in README
    monkeypatch.chdir(ROOT)
    assert "regions" in json.loads(_run_cli(["explain", spec, "--json"]))


def test_readme_report_on_a_line_of_its_own_prints_its_text(capsys):
    assert "compiled.report()                             # prints catalog, rewrites, pieces, " \
           "counters (HTML in notebooks)" in README
    model, adapter = _toy()
    compiled = cadence_fx.compile(model, adapter)
    with torch.no_grad():
        compiled(torch.randn(1, 24, 64), None)
    capsys.readouterr()
    compiled.report()
    out = capsys.readouterr().out
    assert out.startswith("cadence_fx report: adapter 'toy-prompt-retained'")
    assert "\ncatalog:\n" in out and "\ncounters: calls=1, compiled_calls=1" in out
    (entry,) = compiled.classes.values()
    rewrites = [f"{w.kind:<11} {w.region}: {w.detail}" for w in entry.records.rewrites]
    assert rewrites and all(f"  {w}\n" in out for w in rewrites), rewrites
    assert re.search(r"\n  piece_0 +graph \d+ nodes", out)
