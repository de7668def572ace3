"""No module reads another's private attributes: the seams between modules are their methods.

The rule, checked over every module of ``cadence_fx/``, ``passes/`` and ``adapters/`` with ``ast``:
outside ``self`` and ``cls``, a module touches a private attribute (``x._name``, one leading
underscore; ``getattr``/``setattr``/``hasattr`` with such a name written out count too) only
when

* a class of its own defines ``_name`` (assigned on ``self``/``cls``, or in its class body): a
  class may read its own kind's private state on another instance; or
* ``_name`` is one of torch's (or a model library's) internals on ``ALLOWED`` below, each with
  the reason it is read, or is read through one of torch's private modules on
  ``TORCH_INTERNALS`` (``torch._C._get_cudnn_enabled``); or it is an operator of ``aten``
  (``aten._to_copy``: underscored ops are aten's public operators).

Every listed name must still be read somewhere (a stale entry fails too).

So ``cs._rejected`` in the class compiler fails (``CompiledStep`` in ``runtime.py`` would define
it), and so does a new read of a torch internal until it is listed here with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cadence_fx", "passes", "adapters")

# torch's private modules: what is read through them is torch's own (``torch._C._get_cudnn_enabled``)
TORCH_INTERNALS = {
    "_C": "dispatch and backend switches torch exposes nowhere else (the signature's global modes)",
    "_dynamo": "torch._dynamo.config: the recompile limits the backend raises to the catalog's size",
    "_inductor": "torch._inductor: the compiler of the fused regions (region_kernels.py)",
    "_ops": "torch._ops.OpOverload: the type of an aten op as a graph's node target",
    "_refs": "torch._refs.istft: istft as aten ops, once its host-side check is made",
}
# single private attributes of torch (and of a model library) read on purpose, and why
ALLOWED = {
    # torch.nn.Module's own state dicts: a module's own parameters, buffers and hooks, not its
    # children's (named_parameters and named_buffers recurse)
    "_parameters": "nn.Module: a submodule's own parameters",
    "_buffers": "nn.Module: a submodule's own buffers",
    "_forward_hooks": "nn.Module: a hooked module is not copied by the splicer",
    "_forward_pre_hooks": "nn.Module: a hooked module is not copied by the splicer",
    # torch.fx, operators and the interpreter
    "_root": "torch.fx.Graph: the node list's sentinel, for a walk from the end",
    "_schema": "an OpOverload's schema: which arguments an op writes or aliases",
    "_enter_autocast": "torch.amp.autocast_mode: the autocast markers make_fx records",
    "_exit_autocast": "torch.amp.autocast_mode: the autocast markers make_fx records",
    "_fused_sdp_choice": "which attention kernel torch picks: a cat rewrite must not change it",
    "_reload_python_module": "Inductor's module loader, replaced to load marshalled code objects",
    "_getframe": "sys._getframe: a report shows itself when it is the caller's last expression",
    # set by passes/carry_retention.py on the torch GraphModule it rewrote: keeps the auditor alive
    "_cadence_auditor": "an attribute of our own on a torch object",
    # the Moshi library's streaming API (cadence_fx/models/): its state lives in private fields
    "_streaming_state": "moshi: a streaming module's state",
    "_apply_named_streaming": "moshi: every streaming submodule by name",
    "_step": "moshi: LMGen's one-frame step",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_aten(node: ast.AST) -> bool:
    """``aten`` or ``torch.ops.aten``: its underscored attributes are operators."""
    return (isinstance(node, ast.Name) and node.id == "aten") or \
        (isinstance(node, ast.Attribute) and node.attr == "aten")


def _through_torch(node: ast.AST) -> bool:
    """Whether ``node`` is reached through one of torch's private modules (``torch._C``, or a
    name bound to it)."""
    while isinstance(node, ast.Attribute):
        if node.attr in TORCH_INTERNALS:
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in TORCH_INTERNALS


def defined(tree: ast.AST) -> Set[str]:
    """The private names a module's classes define: on ``self``/``cls``, or in a class body."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _is_self(node.value) and _private(node.attr):
            names.add(node.attr)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = []
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    targets = item.targets
                elif isinstance(item, ast.AnnAssign):
                    targets = [item.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def accesses(tree: ast.AST):
    """``(line, name)`` of every private attribute touched on something not ``self``/``cls``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value) \
                and not _is_aten(node.value) and not _through_torch(node.value):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) and not _is_self(node.args[0]):
            yield node.lineno, node.args[1].value


def violations(sources: Dict[str, str]) -> List[str]:
    """``module:line: x._name`` for each access the rule refuses, over ``{module: source}``."""
    trees = {name: ast.parse(src, name) for name, src in sources.items()}
    owners: Dict[str, List[str]] = {}
    for name, tree in trees.items():
        for attr in defined(tree):
            owners.setdefault(attr, []).append(name)
    out = []
    for name, tree in trees.items():
        own = defined(tree)
        for line, attr in accesses(tree):
            if attr in own or attr in ALLOWED or attr in TORCH_INTERNALS:
                continue
            where = ", ".join(o for o in owners.get(attr, ()) if o != name) or "no module here"
            out.append(f"{name}:{line}: .{attr} (defined by a class in {where})")
    return sorted(out)


def _modules() -> Dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text()
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_module_reads_another_modules_private_attributes():
    found = violations(_modules())
    assert not found, ("these modules read private attributes that a class of theirs does not "
                       "define; give the owning class a method (or a public attribute) and use "
                       "it, or, for torch's own internals, list the name in ALLOWED with why:\n"
                       + "\n".join(found))


def test_the_rule_catches_what_it_is_for():
    owner = "class Step:\n    def __init__(self):\n        self._rejected = {}\n"
    sources = {
        "runtime.py": owner,
        # another module's private state, read, written through, and by name: refused
        "compiler.py": "def f(cs, key):\n    cs._rejected[key] = 'why'\n    return cs._rejected\n",
        "report.py": "def g(c):\n    return getattr(c, '_rejected')\n",
        # an unlisted torch internal: refused
        "backend.py": "import torch\nlimit = torch._secret_knob\n",
        # near misses that must pass: self, a class's own kind, aten's ops, listed internals
        "store.py": ("class Store:\n    def __init__(self):\n        self._rejected = {}\n"
                     "    def merge(self, other):\n        self._rejected.update(other._rejected)\n"),
        "passes.py": ("def h(aten, m, torch):\n    aten._to_copy(m)\n    return m._buffers, "
                      "torch._dynamo.config, torch._C._get_cudnn_enabled()\n"),
    }
    found = violations(sources)
    assert found == ["backend.py:2: ._secret_knob (defined by a class in no module here)",
                     "compiler.py:2: ._rejected (defined by a class in runtime.py, store.py)",
                     "compiler.py:3: ._rejected (defined by a class in runtime.py, store.py)",
                     "report.py:2: ._rejected (defined by a class in runtime.py, store.py)"]


def test_every_listed_internal_is_still_read():
    touched = {attr for src in _modules().values() for _, attr in _all_private(ast.parse(src))}
    stale = sorted((set(ALLOWED) | set(TORCH_INTERNALS)) - touched)
    assert not stale, f"ALLOWED or TORCH_INTERNALS lists {stale}, which no module reads; drop them"


def _all_private(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.attr
