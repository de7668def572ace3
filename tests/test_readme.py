"""The README's first snippet runs as written: on the real CFM step it compiles every call."""
import contextlib
import io
import pathlib
import re

import pytest

from cadence_fx.models import token2wav

try:
    token2wav.import_stock()
except ImportError as e:  # pragma: no cover - the optional model packages are absent
    pytest.skip(str(e), allow_module_level=True)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_snippet_runs_and_compiles_every_call():
    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, str(README), "exec"), namespace)
    printed, report = out.getvalue().split("\n", 1)
    assert printed.split() == ["4", "1"]        # compiled calls, carry addresses
    # ``compiled.report()`` on a line of its own: the text report follows
    assert report.startswith("cadence_fx report: adapter 'minicpmo-token2wav-cfm'")
    assert "compiled_calls=4" in report
    c = namespace["compiled"].counters
    assert (c.compiled_calls, c.fallbacks, c.carry_addresses) == (4, 0, 1)
    assert c.released_bytes >= 16 * 16 * 2 * 8 * 1000 * 128 * 4
