"""The HTML report: well-formed, every region and class in it, each rewrite as code before and
after the passes, the pieces strip, escaped text, tables without matplotlib, and a real headless
browser rendering the CLI's page (skipped without chromium)."""
import html.parser
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import cadence_fx
from cadence_fx import report_charts
from cadence_fx.cli import main
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from cadence_fx.report_rewrites import region_rewrites

VOID = {"meta", "br", "img", "hr", "input", "link", "col", "area", "base", "source", "wbr"}


class _Checker(html.parser.HTMLParser):
    """Every element closed in order (SVG's self-closed ones included); collects text and the
    class of every ``div`` line of code."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.text, self.svgs, self.code = [], [], 0, []
        self._cls = []

    def handle_starttag(self, tag, attrs):
        self.svgs += tag == "svg"
        if tag not in VOID:
            self.stack.append(tag)
            self._cls.append(dict(attrs).get("class"))

    def handle_startendtag(self, tag, attrs):
        self.svgs += tag == "svg"

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()
        self._cls.pop()

    def handle_data(self, data):
        self.text.append(data)
        if self.stack and self.stack[-1] == "div" and self._cls[-1] in (
                "del", "add", "write", "kept", "audit", "ctx", "other", "gap"):
            self.code.append((self._cls[-1], data))


def _parse(text: str) -> _Checker:
    p = _Checker()
    p.feed(text)
    p.close()
    assert not p.stack, f"unclosed: {p.stack}"
    return p


def _stream(**kw):
    model = PromptRetainedToy()
    with torch.no_grad():
        _, state = model(torch.randn(1, 24, 64), None)
    compiled = cadence_fx.compile(model, PROMPT_RETAINED_ADAPTER, **kw)
    state = {k: v.clone() for k, v in state.items()}
    for width in (8, 8, 8, 10):   # growing extents, steady state, a longer last call
        with torch.no_grad():
            _, state = compiled(torch.randn(1, width, 64), state)
    return compiled


@pytest.fixture(scope="module")
def audited():
    return _stream(verify=True)   # the graph before the passes is kept by default


def test_the_page_holds_every_region_class_rewrite_and_piece(audited):
    p = _parse(audited._repr_html_())
    text = "".join(p.text)
    assert "Regions: stock vs declared bytes" in text and "att" in text
    for (extents, width) in (k[0] for k in audited.classes):
        assert f"class extents={list(extents)} width={width}" in text
    assert "not reached" in text          # the catalog's (24,) x 10 class: no call of it yet
    assert "Pieces in graph order" in text and "piece_0" in text and "piece_1" in text
    assert "shadow audit compares on the host" in text and "No fallbacks." in text
    assert "before the passes" in text and "region att: envelope, retention" in text
    if report_charts.available():
        assert p.svgs >= 1 + 2 * len(audited.classes)   # regions chart, and per class two


def test_a_rewrite_shows_the_concat_that_went_and_the_carry_writes_that_came(audited):
    entry = next(e for k, e in audited.classes.items() if k[0] == ((40,), 8))
    att = next(g for g in region_rewrites(audited, entry) if g["region"] == "att")
    # per layer the stock slice assignment, now into the carry, and the retention's two moves
    assert att["before_kept"] and att["writes"] == 2 + 2 and att["audits"] == 1
    before = [line for h in att["hunks"] for line in h["before"]]
    after = [line for h in att["hunks"] for line in h["after"]]
    # the stock state: the envelope slices feeding the retention concat, gone from the output
    assert any(m == "del" and "arg" in t and "att_cache_buffer" in t for m, t in before)
    assert any(m == "del" and t.startswith("return") for m, t in before)
    assert any(m == "ctx" and "aten.cat.default" in t for m, t in before)
    # the carry: read in place of the envelope, written in place of the concat, audited
    assert any(m == "add" and "carry_att: carry att" in t for m, t in after)
    assert sum(m == "write" and "aten.copy_.default" in t for m, t in after) == 2
    assert sum(m == "kept" and "aten.copy_.default" in t for m, t in after) == 2
    assert any(m == "audit" and "check_carry_write" in t and "'retention'" in t for m, t in after)
    p = _parse(audited._repr_html_())
    assert ("write", "+ " + next(t for m, t in after if m == "write")) in p.code


def test_the_trace_cache_gives_the_before_graph_too():
    compiled = _stream(trace_cache={}, keep_before=False)
    assert compiled.before == {}
    entry = next(e for k, e in compiled.classes.items() if k[0] == ((40,), 8))
    att = next(g for g in region_rewrites(compiled, entry) if g["region"] == "att")
    assert att["before_kept"] and any("aten.cat.default" in t
                                      for h in att["hunks"] for m, t in h["before"])


def test_without_the_trace_the_lines_that_touch_the_carry_are_shown():
    compiled = _stream(keep_before=False)
    assert compiled.before == {}
    text = compiled._repr_html_()
    _parse(text)
    assert "The trace before the passes was not kept" in text and "before the passes</div>" not in text
    entry = next(e for k, e in compiled.classes.items() if k[0] == ((40,), 8))
    att = next(g for g in region_rewrites(compiled, entry) if g["region"] == "att")
    assert not att["before_kept"] and att["writes"] == 4
    assert all(h["before"] is None for h in att["hunks"])
    assert any(m == "write" for h in att["hunks"] for m, _ in h["after"])


def test_text_is_escaped_and_tables_stand_in_for_the_charts(audited, monkeypatch):
    audited.counters.fallback("<script>alert('x')</script> & more")
    try:
        monkeypatch.setattr(report_charts, "available", lambda: False)
        text = audited._repr_html_()
        p = _parse(text)
    finally:
        del audited.counters.reasons["<script>alert('x')</script> & more"]
        audited.counters.fallbacks -= 1
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert "<script>alert('x')</script> & more" in "".join(p.text)
    assert p.svgs == 0 and "<table>" in text and "128.0 KiB" in text   # the stock envelope


def test_save_html_writes_a_document(audited, tmp_path):
    path = tmp_path / "report.html"
    audited.report().save_html(path)
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and "toy-prompt-retained" in text
    _parse(text)


@pytest.fixture(scope="module")
def cli_page(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "toy.html"
    assert main(["report", "--html", str(path), "--model", "toy", "--chunks", "6", "--verify"]) == 0
    return path


def test_cli_report_of_the_toy_stream(cli_page):
    text = cli_page.read_text()
    p = _parse(text)
    body = "".join(p.text)
    assert "cadence_fx report: toy" in body and "adapter toy-prompt-retained" in body
    assert "<details open>" in text    # the first class that writes a carry, unfolded
    assert any(m == "audit" for m, _ in p.code) and any(m == "write" for m, _ in p.code)


def test_cli_report_refuses_an_unknown_model(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["report", "--html", str(tmp_path / "x.html"), "--model", "nope"])
    assert main(["report", "toy", "--model", "toy", "--html", str(tmp_path / "x.html")]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_a_headless_browser_renders_the_page(cli_page, tmp_path):
    png = tmp_path / "page.png"
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tempfile.mkdtemp()}", f"--screenshot={png}", "--window-size=1400,2000",
         cli_page.as_uri()], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000   # not a blank page
