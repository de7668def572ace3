"""Every ContractError and GuardError names the fix, not only the cause.

The rule (``names_a_fix``): some clause of the message -- the text after a ``;``, ``:``, ``.``,
``(``, a comma, "or" or "then" -- starts with an imperative from ``FIX_VERBS`` ("fix `output`",
"set it to ...", "pass the state as ...", "lower the region's `advance` ..."). Two walks apply
it: every raise site in the source, read statically (the string constants of its message), and
every site a test can trigger, read from the raised message (messages that carry a reason made
elsewhere, as strict mode's do, are checked there).
"""
import ast
import dataclasses
import pathlib
import re

import pytest
import torch
from torch import nn

import cadence_fx
from cadence_fx import adapters
from cadence_fx.catalog import build_catalog
from cadence_fx.contract import Adapter, PromptRetained, Region, Ring, SlidingWindow
from cadence_fx.errors import ContractError, GuardError

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted([*ROOT.glob("cadence_fx/*.py"), *ROOT.glob("passes/*.py"), *ROOT.glob("adapters/*.py")])
FIX_VERBS = {"fix", "use", "set", "give", "declare", "add", "remove", "pass", "call", "keep",
             "move", "cast", "compile", "lower", "raise", "rename", "name", "put", "draw", "serve",
             "restart", "prime", "leave", "drop", "clone", "count", "override", "install"}
# Sites whose message is a reason made elsewhere (a fallback reason raised in strict mode, an
# error of another library): the triggered walk below checks what reaches them.
WRAPPERS = {("runtime.py", "strict mode: "), ("admission.py", "strict mode: ")}
# The CLI's adapter-spec errors name what was tried but not yet what to type instead.
def names_a_fix(message: str) -> bool:
    for clause in re.split(r"[;:.()]|\bor\b|\bthen\b", message):
        for part in clause.split(","):
            words = part.strip().strip("`'\"").split()
            if words and words[0].lower() in FIX_VERBS:
                return True
    return False


def test_the_rule_tells_a_fix_from_a_cause():
    assert names_a_fix("region 'k': frame dim 5 outside its 3-d shape; set `dim` to ...")
    assert names_a_fix("To retry a chunk, keep state.clone() before the call")
    assert not names_a_fix("state arrived as torch.float32 on cpu, but its carry is "
                           "torch.bfloat16 on cpu")
    assert not names_a_fix("region 'k0' extent 4 is not in the catalog [0, 8, 12] derived from "
                           "its retention clocks")


# -- every raise site, read from the source ------------------------------------------------------

def _sites():
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("ContractError", "GuardError") and node.args):
                text = " ".join(c.value for c in ast.walk(node.args[0])
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                yield path.name, node.lineno, node.func.id, text


SITES = list(_sites())


def test_the_walk_finds_the_sites():
    files = {f for f, *_ in SITES}
    assert len(SITES) >= 55 and {"contract.py", "admission.py", "runtime.py", "replay.py",
                                 "sessions.py", "cli.py", "class_compiler.py"} <= files


@pytest.mark.parametrize("site", [s for s in SITES if s[0] != "cli.py"], ids=lambda s: f"{s[0]}:{s[1]}")
def test_every_raise_site_names_a_fix(site):
    file, line, kind, text = site
    if (file, text) in WRAPPERS:
        return   # its reasons are checked where they are made, and triggered below
    assert names_a_fix(text), f"{file}:{line} {kind}({text!r}) names no fix"


@pytest.mark.parametrize("site", [s for s in SITES if s[0] == "cli.py"], ids=lambda s: f"{s[0]}:{s[1]}")
def test_the_clis_errors(site):
    file, line, kind, text = site
    assert names_a_fix(text), f"{file}:{line} {kind}({text!r}) names no fix"


# -- the sites a test can trigger ----------------------------------------------------------------

_CLOCKS = {"P": 4, "R": 4, "W": 6, "s": 2, "c": 2, "d": 3, "zero": 0, "big": 9}
_REGION = Region(name="k", input="cache.k", output="1.k", dim=1, retention=SlidingWindow("W"),
                 advance="s", shape=("d", None))


def _adapter(**region):
    return Adapter(name="fixes", clocks=_CLOCKS, regions=(dataclasses.replace(_REGION, **region),),
                   call_frames=("c",), call_input="x", call_dim=1)


DECLARATIONS = {
    "unknown clock": lambda: _adapter(advance="nope").validate(),
    "negative clock": lambda: dataclasses.replace(_adapter(), clocks={**_CLOCKS, "s": -1}).validate(),
    "no regions": lambda: dataclasses.replace(_adapter(), regions=()).validate(),
    "twice": lambda: dataclasses.replace(_adapter(), regions=(_REGION, _REGION)).validate(),
    "zero call": lambda: dataclasses.replace(_adapter(), call_frames=("zero",)).validate(),
    "no call input": lambda: dataclasses.replace(_adapter(), call_input=None).validate(),
    "width limit": lambda: dataclasses.replace(_adapter(), width_limit=0).validate(),
    "repeated": lambda: dataclasses.replace(_adapter(), repeated=("nodot",)).validate(),
    "ordering": lambda: _adapter(ordering="sideways").validate(),
    "paths": lambda: _adapter(input="").validate(),
    "advance zero": lambda: _adapter(advance="zero").validate(),
    "retained zero": lambda: _adapter(retention=PromptRetained("P", "zero")).validate(),
    "window zero": lambda: _adapter(retention=SlidingWindow("zero")).validate(),
    "start past window": lambda: _adapter(retention=SlidingWindow("W", start="big")).validate(),
    "ring room": lambda: _adapter(retention=Ring("W"), room="c").validate(),
    "dim outside": lambda: _adapter(dim=5).validate(),
    "frame dim sized": lambda: _adapter(shape=("d", 4)).validate(),
    "other dim None": lambda: _adapter(shape=(None, None)).validate(),
    "dim zero size": lambda: _adapter(shape=("zero", None)).validate(),
    "negative dim": lambda: _adapter(shape=(), dim=-1).validate(),
    "stock rank": lambda: _adapter(stock_shape=("d",)).validate(),
    "stock None": lambda: _adapter(stock_shape=("d", None)).validate(),
    "element bytes": lambda: _adapter(element_bytes=3).validate(),
    "unknown region": lambda: _adapter().region("q"),
    "unknown override": lambda: _adapter().with_clocks(q=1),
    "catalog region": lambda: build_catalog(_adapter()).region("q"),
    "registry": lambda: adapters.get("mosh"),
}


@pytest.mark.parametrize("what", list(DECLARATIONS))
def test_a_wrong_declaration_names_the_fix(what):
    with pytest.raises(ContractError) as e:
        DECLARATIONS[what]()
    assert names_a_fix(str(e.value)), str(e.value)


class Window(nn.Module):
    """Keeps the last W frames of ``cat([cache, x])`` along dim 1; x: (d, frames)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, 1))

    def forward(self, x, cache):
        full = torch.cat([cache["k"], x * self.scale], 1)
        return full.sum(1), {"k": full[:, -6:]}


def _raised(call, kind=GuardError) -> str:
    with pytest.raises(kind) as e:
        call()
    return str(e.value)


def _call(step, x_frames, state_frames, dtype=torch.float32):
    with torch.no_grad():
        return step(torch.ones(3, x_frames, dtype=dtype), {"k": torch.zeros(3, state_frames, dtype=dtype)})


def test_a_state_off_the_catalog_names_the_advance_to_declare():
    """Calls of 2 and 4 frames with an advance of 4: a state of 2 frames is off the grid, and
    the fix is the gcd of the call widths. Not strict, the reason is the counted fallback's."""
    adapter = dataclasses.replace(_adapter(advance="big"), clocks={**_CLOCKS, "big": 4, "c4": 4},
                                  call_frames=("c", "c4"))
    message = _raised(lambda: _call(cadence_fx.compile(Window(), adapter, strict=True), 2, 2))
    assert "extent 2 is not in the catalog [0, 4, 6]" in message
    assert "lower the region's `advance` (big = 4) to 2 (the gcd of the call widths [2, 4]" in message
    assert names_a_fix(message)
    compiled = cadence_fx.compile(Window(), adapter)
    _call(compiled, 2, 2)
    (reason,) = compiled.counters.reasons
    assert compiled.counters.fallbacks == 1 and names_a_fix(reason) and reason in message
    # beyond the bound: the retention clocks
    assert "fix the retention clocks (W)" in _raised(
        lambda: _call(cadence_fx.compile(Window(), adapter, strict=True), 2, 8))


def test_every_admission_reason_names_its_fix_in_strict_mode():
    strict = cadence_fx.compile(Window(), _adapter(), strict=True)
    two = Adapter(name="two", clocks=_CLOCKS, regions=(
        _REGION, dataclasses.replace(_REGION, name="q", input="cache.q", output="1.q")),
        call_frames=("c",), call_input="x", call_dim=1)

    class Two(Window):
        def forward(self, x, cache):
            y, k = super().forward(x, {"k": cache["k"]})
            return y, {"k": k["k"], "q": torch.cat([cache["q"], x], 1)[:, -6:]}

    two_step = cadence_fx.compile(Two(), two, strict=True)
    messages = {
        "width": _raised(lambda: _call(strict, 3, 0)),
        "missing": _raised(lambda: two_step(torch.ones(3, 2), {"k": torch.zeros(3, 0), "q": None})),
        "together": _raised(lambda: two_step(torch.ones(3, 2), {"k": torch.zeros(3, 2),
                                                                 "q": torch.zeros(3, 0)})),
        "excluded": _raised(lambda: cadence_fx.compile(
            Window(), dataclasses.replace(_adapter(), width_limit=2), strict=True)),
    }
    for what, message in messages.items():
        assert message.startswith("strict mode: ") and names_a_fix(message), (what, message)


def test_a_state_of_another_dtype_than_its_carry_names_the_cast():
    """bf16 weights and a first bf16 state, under an adapter declaring fp32 (the default 4
    bytes): the carry is bf16, and a later fp32 state passes the placement check (4 bytes, as
    declared) but cannot be copied into it."""
    compiled = cadence_fx.compile(Window().to(torch.bfloat16), _adapter())
    _call(compiled, 2, 0, torch.bfloat16)
    message = _raised(lambda: _call(compiled, 2, 2, torch.float32), ContractError)
    assert "state arrived as torch.float32 on cpu, but its carry is torch.bfloat16 on cpu" in message
    assert "state.to('cpu', torch.bfloat16)" in message and names_a_fix(message)


def test_host_randomness_in_strict_mode_names_the_fix():
    from cadence_fx.models.toy import CONV_ADAPTER, HostRandomToy
    compiled = cadence_fx.compile(HostRandomToy(), CONV_ADAPTER, strict=True)
    with torch.no_grad():
        message = _raised(lambda: compiled(torch.randn(1, 32, 4), torch.zeros(1, 32, 2),
                                           torch.zeros(1, 64, 0)))
    assert "host randomness" in message and names_a_fix(message)


def test_a_piece_that_cannot_replay_in_strict_mode_names_the_fix():
    from replay_stand_in import StandInBackend
    compiled = cadence_fx.compile(Window(), _adapter(), strict=True,
                                  backend=StandInBackend(fail=RuntimeError("no room")))
    message = _raised(lambda: _call(compiled, 2, 0))
    assert "capture failed" in message and "graphs=False" in message and names_a_fix(message)
    moved = cadence_fx.compile(Window(), _adapter(), strict=True, backend=StandInBackend())
    _call(moved, 2, 0)
    _call(moved, 2, 2)     # the class at extent 2 captured at these addresses
    with torch.no_grad():
        moved.module.scale.data = moved.module.scale.data.clone()
    message = _raised(lambda: _call(moved, 2, 2))
    assert "moved" in message and "recapture_on_drift" in message and names_a_fix(message)
