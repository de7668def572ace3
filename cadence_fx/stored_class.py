"""A compiled class as the persistent compile cache stores it: its rewritten graph as code.

A restarted process that loads a class in this form skips tracing, the passes and the
probationary call; only the capture runs again (device graphs and addresses belong to one
process). What is kept, per class (``freeze``), and rebuilt by ``thaw``:

* every graph module of the rewritten step (the top-level graph and each piece) as torch.fx's
  own pickled form of a GraphModule keeps it -- the generated Python code with the import block
  of its globals (``torch.fx.graph_module._format_import_block``) -- plus the function's code
  object (``marshal``, the format of ``__pycache__``), so a load neither re-traces the code, as
  unpickling a GraphModule does, nor compiles it (about 0.4 s for 18k nodes): it executes the
  import block and binds the function. A Python whose bytecode differs compiles the source;
* the attributes the code reads: constants by value (literals written in the step, and the
  hoisted device-resident constants), module state by its attribute path in the module, bound
  to the live tensor on load (so writes reach the module and new values are read);
* per piece, the facts the lowering pass derived from fake tensors: its kind and reasons, which
  inputs are fixed-address and whose, which it writes, which outputs leave the step;
* per fused region, its stock code, ops and input layout; its compiled code and verdict are
  entries of their own (``region_kernels.py``), shared by every region with the same kernel
  key, and a loaded region takes them from there (compiled and verified again only without one);
* the class's input specs, result structure, records, region outputs, the carries it allocates
  (a priming pass), the buffers its graph writes (private copies) and the envelopes it replaces.

A class is stored only when all of that holds. With the shadow auditor in its graph or a global
without an import path, its trace alone is cached; with a tensor the code reads that is neither a
constant nor module state, nothing is (a later process could not find that tensor again). The
loaded modules have no ``graph``: the report shows their code (``code``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import linecache
import marshal
import types
from typing import Dict, List, Optional

import torch
import torch.utils._pytree as pytree

from .fusion import FusedRegion
from .passes.fx_utils import attr_value, written_bases
from .replay import GuardedPiece
from .tracing import TracedStep, module_state_tensors

__all__ = ["CodeModule", "Unstorable", "attributes", "freeze", "thaw"]

MAGIC = importlib.util.MAGIC_NUMBER    # this Python's bytecode format
# constants the passes make, computed once: hoisted subgraphs, and the device copy of a masked
# write's literal value (``mask_writes``)
PASS_CONSTANTS = ("_cadence_const_", "_cadence_mask_value_")


class Unstorable(Exception):
    """The class cannot be stored in compiled form (its trace may still be); the message says why."""


class CodeModule(torch.nn.Module):
    """A graph module loaded from the compile cache: its generated code, without the graph.
    ``code`` is the source; ``written_attributes`` the attributes the code writes in place."""

    code: str
    written_attributes: List[str]


# -- store ------------------------------------------------------------------------------------
def freeze(cs, entry, *, private: List[str], replaced: List[str],
           carries: Dict[str, tuple]) -> dict:
    """The payload that stores ``entry`` (a ``ClassEntry`` of the compiled step ``cs``);
    raises ``Unstorable``."""
    if cs.config.verify:
        raise Unstorable("the shadow auditor is part of the graph (verify=True)")
    state = {id(t): path for path, t in module_state_tensors(cs.module).items()}
    t = entry.traced
    records = entry.records.copy(graph=None)   # the graph is code now
    return {
        "module": _freeze_module(entry.gm, state),
        "inputs": list(entry.inputs), "records": records, "out_regions": dict(entry.out_regions),
        "writes": entry.writes, "retentions": entry.retentions,
        "materializations": entry.materializations,
        "traced_nodes": entry.traced_nodes,
        "traced": {"out_spec": pytree.treespec_dumps(t.out_spec), "out_paths": t.out_paths,
                   "out_constants": t.out_constants, "out_tensor_index": t.out_tensor_index,
                   "copied_calls": t.copied_calls, "refused": t.refused},
        "private": sorted(private), "replaced": sorted(replaced), "carries": carries,
    }


def _freeze_module(gm, state: Dict[int, str]) -> dict:
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    if not isinstance(gm, torch.fx.GraphModule):
        raise Unstorable(f"{type(gm).__name__} is not a graph module")
    if hasattr(type(gm), "real_recompile"):     # a lazy GraphModule: generate its code now
        gm.real_recompile()
    fn = type(gm).forward
    globals_ = {k: v for k, v in fn.__globals__.items() if k != "__builtins__"}
    try:
        imports = _format_import_block(globals_, sys_importer)
    except Exception as e:  # noqa: BLE001 - a global the code needs has no import path
        raise Unstorable(f"a global of the generated code cannot be imported: {e}") from e
    attrs = attributes(gm, state)
    children = {}
    for name, child in gm.named_children():
        if isinstance(child, GuardedPiece):
            children[name] = {"piece": {
                "kind": child.kind, "reasons": list(child.reasons), "fixed": list(child.fixed_names),
                "mutated": list(child.mutated), "escaping": list(child.escaping)},
                "module": _freeze_module(child.module, state)}
        elif isinstance(child, FusedRegion):   # verified again where it is loaded
            children[name] = {"fused": {"ops": list(child.ops), "graph": child.graph,
                                        "writes": list(child.writes), "layout": child.layout},
                              "module": _freeze_module(child.stock, state)}
        elif isinstance(child, torch.fx.GraphModule):
            children[name] = {"module": _freeze_module(child, state)}
        elif any(n.op == "call_module" and n.target == name for n in gm.graph.nodes):
            raise Unstorable(f"submodule {name} is a {type(child).__name__}")
    return {"name": type(gm).__name__, "src": gm.code, "imports": imports,
            "bytecode": marshal.dumps(fn.__code__), "magic": MAGIC, "attrs": attrs,
            "children": children,
            "written": [b.target for b in written_bases(gm.graph) if b.op == "get_attr"]}


def attributes(gm, state: Dict[int, str]) -> Dict[str, tuple]:
    """How each tensor the graph reads through ``get_attr`` is stored: ``("state", path)``,
    module state found again by its path in the module (``state``: id -> path), or
    ``("value", tensor)``, a constant; raises ``Unstorable`` for any other."""
    attrs = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in attrs:
            attrs[node.target] = _freeze_attr(node, attr_value(gm, node.target), state)
    return attrs


def _freeze_attr(node, value, state: Dict[int, str]) -> tuple:
    if not isinstance(value, torch.Tensor):
        raise Unstorable(f"attribute {node.target} is a {type(value).__name__}, not a tensor")
    if id(value) in state:                       # module state: bound to the live tensor
        return ("state", state[id(value)])
    literal = bool(node.users) and all(u.target is torch.ops.aten.lift_fresh_copy.default
                                       for u in node.users)
    if node.target.startswith(PASS_CONSTANTS) or literal:
        return ("value", value.detach())
    raise Unstorable(f"attribute {node.target} is a tensor that is neither a constant nor module "
                     "state the compiled module can find again")


# -- load -------------------------------------------------------------------------------------
def missing_state(cs, payload: dict) -> List[str]:
    """Module state the class reads that the module does not have (yet): stock code that
    registers a buffer on its first call (Mimi's codebook cache). Such a class is compiled."""
    have = {"param": cs.tensors.params, "buffer": cs.tensors.buffers}
    missing = [f"{s.kind} {s.name}" for s in payload["inputs"]
               if s.kind in have and s.name not in have[s.kind]]
    paths = set(module_state_tensors(cs.module))
    return missing + [f"attribute {p}" for p in _state_paths(payload["module"]) if p not in paths]


def _state_paths(m: dict):
    yield from (ref for kind, ref in m["attrs"].values() if kind == "state")
    for child in m["children"].values():
        yield from _state_paths(child["module"])


def thaw(cs, payload: dict, label: str) -> dict:
    """The fields of the ``ClassEntry`` stored in ``payload``, its runtime parts made for ``cs``:
    the guarded pieces on ``cs``'s backend and counters, attributes bound to ``cs.module``."""
    state = module_state_tensors(cs.module)
    gm = _thaw_module(cs, payload["module"], state, label)
    t = payload["traced"]
    traced = TracedStep(gm=None, inputs=list(payload["inputs"]),
                        out_spec=pytree.treespec_loads(t["out_spec"]), out_paths=t["out_paths"],
                        out_constants=t["out_constants"], out_tensor_index=t["out_tensor_index"],
                        seconds=0.0, copied_calls=t["copied_calls"], refused=t["refused"],
                        loaded=True)
    records = payload["records"].copy(probe_s=0.0)
    records.passes = [dataclasses.replace(p, seconds=0.0) for p in records.passes]   # none ran here
    return dict(gm=gm, inputs=list(payload["inputs"]), traced=traced, records=records,
                out_regions=payload["out_regions"], writes=payload["writes"],
                retentions=payload["retentions"], traced_nodes=payload["traced_nodes"],
                materializations=payload.get("materializations", 0))


# import block -> the globals it makes (thousands of regions share a few blocks)
_IMPORTED: Dict[str, dict] = {}


def _globals(imports: str) -> dict:
    if imports not in _IMPORTED:
        g: dict = {}
        exec(compile(imports, "<cadence_fx imports>", "exec"), g)  # noqa: S102 - torch's import block
        _IMPORTED[imports] = g
    return dict(_IMPORTED[imports])


def _thaw_module(cs, m: dict, state: Dict[str, torch.Tensor], label: str) -> CodeModule:
    g = _globals(m["imports"])
    filename = f"<cadence_fx cache: {label} {m['name']}>"
    if m["magic"] == MAGIC:
        code = marshal.loads(m["bytecode"]).replace(co_filename=filename)
        fn = types.FunctionType(code, g, "forward")
    else:   # another Python's bytecode: compile the source
        exec(compile(m["src"], filename, "exec"), g)  # noqa: S102
        fn = g.pop("forward")
    linecache.cache[filename] = (len(m["src"]), None, m["src"].splitlines(True), filename)
    cls = type(m["name"], (CodeModule,), {"forward": fn})
    module = cls()
    module.code = m["src"]
    module.written_attributes = list(m["written"])
    for target, (kind, ref) in m["attrs"].items():
        _assign(module, target, state[ref] if kind == "state" else ref)
    for name, child in m["children"].items():
        sub = _thaw_module(cs, child["module"], state, label)
        p = child.get("piece")
        if "fused" in child:
            sub = FusedRegion(sub, name, child["fused"]["ops"], cs.counters, child["fused"]["graph"],
                              writes=child["fused"]["writes"], layout=child["fused"].get("layout"))
            sub.resolve(getattr(cs, "kernel_store", None))
        elif p is not None:
            sub = GuardedPiece(sub, name, p["kind"], p["reasons"], p["fixed"], p["mutated"],
                               p["escaping"], cs.backend, cs.counters, strict=cs.config.strict,
                               recapture=cs.adapter.recapture_on_drift)
        setattr(module, name, sub)
    return module


def _assign(module: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *owners, name = target.split(".")
    for part in owners:
        if not hasattr(module, part):
            setattr(module, part, torch.nn.Module())
        module = getattr(module, part)
    setattr(module, name, value)


def carry_like(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What ``Admission.allocate`` reads of the tensor a carry is made like, storable."""
    return None if t is None else (tuple(t.shape), t.dtype, str(t.device))
