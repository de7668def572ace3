"""``cadence-fx explain`` against build_catalog's numbers, and adapters named by module or file
for ``analyze``, ``explain`` and ``report``: the forms that work and the errors that name what
was tried."""
import html.parser
import json
import subprocess
import sys
import textwrap

import pytest

from cadence_fx import adapters
from cadence_fx.catalog import build_catalog
from cadence_fx.cli import main

ADAPTER_FILE = textwrap.dedent('''
    from cadence_fx import Adapter, Region, SlidingWindow

    NOT_AN_ADAPTER = 3
    MINE = Adapter(
        name="file-window", clocks={"chunk": 4, "window": 12, "width": 8},
        regions=(Region(name="kv", input="kv", output="1", dim=1, retention=SlidingWindow("window"),
                        advance="chunk", shape=("width", None)),),
        call_frames=("chunk",), call_input="x", call_dim=1)
''')


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.fixture
def adapter_file(tmp_path):
    path = tmp_path / "my_adapter.py"
    path.write_text(ADAPTER_FILE)
    return path


# -- explain ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["minicpmo-token2wav", "freeze-omni", "moshi", "llm-backbone"])
def test_explain_json_is_build_catalogs_numbers(capsys, name):
    d = _json(capsys, ["explain", name, "--json"])
    catalog = build_catalog(adapters.get(name))
    assert d["adapter"] == name and d["catalog_size"] == catalog.size
    assert d["admissible"] == catalog.admissible and d["call_widths"] == list(catalog.call_widths)
    assert [r["name"] for r in d["regions"]] == [r.name for r in catalog.regions]
    for r, rc in zip(d["regions"], catalog.regions):
        assert r["extents"] == list(rc.extents) and r["K"] == rc.K
        assert r["admissible"] == rc.admissible
        assert r["declared_extent"]["frames"] == rc.declared_extent
        assert r["declared_extent"]["bound"] + r["declared_extent"]["room"] == rc.declared_extent
        assert (r["stock_bytes"], r["declared_bytes"]) == (rc.stock_bytes, rc.declared_bytes)
        # the why: the extents start where the clocks say and stop at the cap
        assert r["why"]["start"]["frames"] == rc.extents[0]
        assert r["why"]["cap"]["frames"] == rc.bound
    # the stream's order is the catalog's: first call, growing extents, steady state
    joint = list(dict.fromkeys(e for e, _ in catalog.classes))
    phases = d["stream"]["phases"]
    assert [tuple(p["class"][0]) for p in phases] == joint
    assert phases[0]["phase"].startswith("first call") and phases[-1]["phase"].endswith("steady state")
    flush = d["stream"]["flush"]
    assert {(tuple(e), w) for e, w in flush["classes"]} | {(tuple(p["class"][0]), p["width"])
                                                          for p in phases} == set(catalog.classes)


def test_explain_token2wav_text_walks_through_the_regions(capsys):
    assert main(["explain", "minicpmo-token2wav"]) == 0
    out = capsys.readouterr().out
    for region in adapters.get("minicpmo-token2wav").regions:
        assert f"region {region.name}" in out
    assert "extents     302, 352, 402" in out
    assert "f_prompt + f_retained = 402" in out
    assert "A+ = 402 + 56 = 458 frames" in out and "att_cache_buffer" in out
    assert "K           3 (eq. 7) <= width limit 64: admissible (Criterion 3.5)" in out
    assert "first call" in out and "growing extents" in out and "steady state" in out
    assert "flush width 56 (f_call)" in out and "1..50 frames (f_chunk)" in out


def test_explain_a_wide_catalog_says_it_runs_stock(capsys):
    assert main(["explain", "llm-backbone"]) == 0
    out = capsys.readouterr().out
    assert "NOT admissible (Criterion 3.5)" in out and "2001" in out
    assert len(out.splitlines()) < 40   # 2001 extents, summarised


# -- adapters from modules and files --------------------------------------------------------------

def test_analyze_an_adapter_from_a_module(capsys):
    d = _json(capsys, ["analyze", "cadence_fx.models.toy:PROMPT_RETAINED_ADAPTER", "--json"])
    assert d["adapter"] == "toy-prompt-retained" and d["regions"][0]["extents"] == [24, 32, 40]


def test_analyze_and_explain_an_adapter_from_a_file(capsys, adapter_file):
    d = _json(capsys, ["analyze", f"{adapter_file}:MINE", "--json"])
    assert d["adapter"] == "file-window" and d["regions"][0]["extents"] == [0, 4, 8, 12]
    e = _json(capsys, ["explain", f"{adapter_file}:MINE", "--json"])
    assert e["regions"][0]["K"] == 4 and e["regions"][0]["declared_extent"]["frames"] == 16
    assert [p["phase"] for p in e["stream"]["phases"]] == [
        "first call", "growing extents", "growing extents", "steady state"]


def test_report_of_an_adapter_alone_runs_no_model(capsys, adapter_file, tmp_path):
    out = tmp_path / "catalog.html"
    assert main(["report", f"{adapter_file}:MINE", "--html", str(out)]) == 0
    text = out.read_text()
    html.parser.HTMLParser().feed(text)
    assert "file-window" in text and "steady state" in text


@pytest.mark.parametrize("command", ["analyze", "explain"])
def test_unknown_names_list_the_forms(capsys, command):
    err = _error(capsys, [command, "no-such-model"])
    assert "no adapter named 'no-such-model'" in err
    assert "minicpmo-token2wav" in err and "pkg.module:NAME" in err and "path/to/file.py:NAME" in err


def test_bad_module_spec(capsys):
    err = _error(capsys, ["analyze", "no_such_package_xyz.adapters:THING"])
    assert "importing module 'no_such_package_xyz.adapters' failed" in err
    assert "ModuleNotFoundError" in err and "path/to/file.py:NAME" in err


def test_bad_file_specs(capsys, adapter_file, tmp_path):
    missing = tmp_path / "missing.py"
    assert "does not exist" in _error(capsys, ["explain", f"{missing}:MINE"])
    err = _error(capsys, ["analyze", f"{adapter_file}:NOPE"])
    assert "has no attribute 'NOPE'; give one of its adapters (MINE)" in err
    err = _error(capsys, ["analyze", f"{adapter_file}:NOT_AN_ADAPTER"])
    assert "is a int, not a cadence_fx.Adapter; name an Adapter instance" in err
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1 / 0\n")
    err = _error(capsys, ["explain", f"{broken}:X"])
    assert "loading file" in err and "ZeroDivisionError" in err and "fix the file" in err
    out = tmp_path / "never.html"
    assert "does not exist" in _error(capsys, ["report", f"{missing}:MINE", "--html", str(out)])
    assert not out.exists()


def test_an_invalid_adapter_in_a_file_is_refused(capsys, tmp_path):
    path = tmp_path / "invalid.py"
    path.write_text(ADAPTER_FILE.replace('advance="chunk"', 'advance="no_clock"'))
    err = _error(capsys, ["explain", f"{path}:MINE"])
    assert "no_clock" in err


def test_help_loads_nothing_heavy():
    code = ("import sys\nfrom cadence_fx.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "heavy = {'cadence_fx.runtime', 'cadence_fx.demo', 'cadence_fx.report_html', "
            "'cadence_fx.explain', 'matplotlib'} & set(sys.modules)\nassert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "explain" in done.stdout and "report" in done.stdout
