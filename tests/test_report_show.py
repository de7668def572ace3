"""``compiled.report()`` on a line of its own shows itself: its text on stdout in a script, its
HTML through IPython's display in a notebook. Kept, passed on or read for numbers, it shows
nothing; ``show=True``/``False`` decide instead; a REPL's echo is its text."""
import json
import subprocess
import sys
import textwrap

import torch

import cadence_fx
import cadence_fx.backend
from cadence_fx.models.toy import RING_ADAPTER, RingToy

HEADER = "cadence_fx report: adapter 'toy-ring'"


def _compiled():
    compiled = cadence_fx.compile(RingToy(), RING_ADAPTER)
    with torch.no_grad():
        compiled(torch.randn(1, 1, 32), torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long))
    assert compiled.counters.compiled_calls == 1
    return compiled


def test_a_report_on_a_line_of_its_own_prints_its_text(capsys):
    compiled = _compiled()
    capsys.readouterr()
    kept = compiled.report()
    memory = compiled.report().memory()
    print(compiled.report().as_dict()["adapter"])
    compiled.report(show=False)
    assert capsys.readouterr().out == "toy-ring\n"
    assert kept.c is compiled and memory["carry_bytes"] > 0
    compiled.report()
    out = capsys.readouterr().out
    assert out.startswith(HEADER) and "compiled_calls=1" in out and out == f"{kept}\n"
    forced = compiled.report(show=True)
    assert capsys.readouterr().out == out and forced.c is compiled
    assert repr(kept) == str(kept)      # what a REPL echoes


def test_the_backend_report_on_a_line_of_its_own_prints_its_text(capsys):
    cadence_fx.backend.report()
    out = capsys.readouterr().out
    assert out.startswith("the cadence backend has compiled no step") or out.startswith("== dynamo graph")
    shown = cadence_fx.backend.report()
    assert capsys.readouterr().out == "" and str(shown) == out.rstrip("\n")


NOTEBOOK = textwrap.dedent('''
    import json, sys, torch
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.display_formatter.active_types = ["text/plain", "text/html"]
    published = []
    shell.display_pub.publish = lambda data, metadata=None, **kw: published.append(sorted(data))
    echoed = []
    shell.displayhook.write_format_data = lambda data, md=None: echoed.append(sorted(data))
    setup = """
    import torch, cadence_fx
    from cadence_fx.models.toy import RING_ADAPTER, RingToy
    compiled = cadence_fx.compile(RingToy(), RING_ADAPTER)
    with torch.no_grad():
        compiled(torch.randn(1, 1, 32), torch.zeros(2, 1, 2, 16, 16), torch.zeros(1, dtype=torch.long))
    """
    assert shell.run_cell(setup).success
    # a report in the middle of a cell is displayed; the last expression is echoed, not twice
    assert shell.run_cell("compiled.report()\\nkept = compiled.report()\\nx = 1").success
    assert shell.run_cell("compiled.report()").success
    print("SEEN", json.dumps({"published": published, "echoed": echoed}))
''')


def test_in_ipython_a_report_is_displayed_as_html_once():
    done = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.split("SEEN", 1)[1])
    assert seen == {"published": [["text/html", "text/plain"]],
                    "echoed": [["text/html", "text/plain"]]}
