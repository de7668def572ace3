"""Host checks on constants, made once per class: ``istft``'s window check.

Case handled -- HiFT's inverse STFT. Its kernel checks, through ``.item()``, that the overlap-add
envelope of the squared window is nowhere below 1e-11 (the NOLA condition): a host sync, so the
call and everything around it stayed out of the device graph::

    y = aten.istft(spec, 16, 4, 16, self._cadence_const_0)     # before: an eager piece

    t = aten.transpose(spec, 1, 2)                              # after: capturable
    frames = aten._fft_c2r(t, [2], 2, 16)
    y = aten.unfold_backward(frames * window.view(1, 1, 16), [1, L], 1, 16, 4)
    env = aten.unfold_backward(window.pow(2).expand(1, n, 16), [1, L], 1, 16, 4)
    y = y[:, 8:L - 8] / env[:, 8:L - 8]

The window is a constant (hoisted by ``hoist_constants``, or a tensor the adapter declares
constant) and a class's shapes are fixed, so the envelope is the same on every call of the class:
the pass computes it once from the real window with the same ops and checks it as the kernel
does. The call is then replaced by torch's own decomposition of ``istft`` (``torch._refs.istft``:
the kernel's aten ops without the check), traced at the node's shapes. A window that fails the
check keeps the stock call, which raises as stock does. The envelope's ops read only constants
and are hoisted like any other. Invariant: outputs unchanged bit for bit
(the decomposition runs the kernel's ops in its order; tests compare the two on the CPU and on the
device); no host sync left.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.operator_schemas import normalize_function
from torch.fx.passes.infra.pass_base import PassResult

from .context import PassContext
from .fx_utils import aten, attr_value, val

from .hoist_constants import hoist_constants

__all__ = ["host_checks", "NOLA_EPS"]

NOLA_EPS = 1e-11   # the kernel's bound on the window envelope


def host_checks(gm: GraphModule, ctx: PassContext) -> PassResult:
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.istft.default:
            continue
        kwargs = normalize_function(n.target, n.args, n.kwargs,
                                    normalize_to_only_use_kwargs=True).kwargs
        window = kwargs.get("window")
        why = _why_not(gm, ctx, kwargs, window)
        if why is not None:
            ctx.note("near_miss", None, f"{n.name}: istft kept (its host check stays): {why}")
            continue
        try:
            sub = _decomposition(gm, kwargs, window)
        except Exception as e:  # noqa: BLE001 - the stock call stays, with the reason
            ctx.note("near_miss", None, f"{n.name}: istft kept (its host check stays): its "
                     f"decomposition could not be traced ({type(e).__name__}: {e})")
            continue
        _inline(gm, n, sub, (kwargs["input"], window))
        ctx.note("host_check", None, f"{n.name}: istft's window check made once (envelope min "
                 f"above {NOLA_EPS:g}); the call decomposed to its aten ops, no host sync")
        rewritten += 1
    if rewritten:   # the envelope reads only constants: computed once, like any other constant
        hoist_constants(gm, ctx)
    return PassResult(gm, rewritten > 0)


def _why_not(gm: GraphModule, ctx: PassContext, kwargs: dict, window) -> Optional[str]:
    """Why this istft keeps its stock call, or None: the window must be a constant whose envelope
    passes the kernel's check at this class's shapes."""
    if not isinstance(window, Node) or window.op != "get_attr":
        return ("its window is not a constant of the class (declare the tensor it comes from in "
                "Adapter.constants if it never changes)")
    w = attr_value(gm, window.target)
    if not (window.target.startswith("_cadence_const_") or id(w) in ctx.constant_ids):
        return f"its window {window.target} is module state not declared constant (Adapter.constants)"
    spec = val(kwargs["input"])
    if spec is None or not spec.is_complex() or kwargs.get("return_complex"):
        return "only the complex-to-real form is decomposed"
    if w.is_complex():
        return "a complex window"
    if spec.device != w.device:
        return "its window is on another device"
    lowest = _envelope(w, spec, kwargs).abs().min()
    if not bool(lowest >= NOLA_EPS):
        return f"its window envelope falls to {float(lowest):g}, the stock call raises"
    return None


def _envelope(w: torch.Tensor, spec: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The overlap-add envelope of the squared window over the output the call keeps, computed
    as the kernel computes it."""
    n_fft = kwargs["n_fft"]
    hop = kwargs.get("hop_length") or n_fft // 4
    win_length = kwargs.get("win_length") or n_fft
    if win_length != n_fft:
        left = (n_fft - win_length) // 2
        w = aten.constant_pad_nd(w, (left, n_fft - win_length - left), 0)
    frames = spec.shape[-1]
    full = n_fft + hop * (frames - 1)
    env = aten.unfold_backward(w.pow(2).expand((1, frames, n_fft)), (1, full), 1, n_fft, hop)
    start = n_fft // 2 if kwargs.get("center", True) else 0
    length = kwargs.get("length")
    end = start + length if length is not None else (full - n_fft // 2 if kwargs.get("center", True)
                                                     else full)
    return env[:, start:min(end, full)]


def _decomposition(gm: GraphModule, kwargs: dict, window: Node) -> GraphModule:
    """``torch._refs.istft`` traced at the node's shapes, with its input and window as inputs."""
    static = {k: v for k, v in kwargs.items() if k not in ("input", "window")}
    spec = val(kwargs["input"])

    def decomposed(x, win):
        return torch._refs.istft(x, window=win, **static)

    example = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
    return make_fx(decomposed, tracing_mode="fake")(example, attr_value(gm, window.target))


def _inline(gm: GraphModule, node: Node, sub: GraphModule, inputs) -> None:
    """Replace ``node`` by the graph of ``sub``, its placeholders bound to ``inputs``."""
    env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], inputs))
    out = None
    with gm.graph.inserting_before(node):
        for s in sub.graph.nodes:
            if s.op == "placeholder":
                continue
            if s.op == "output":
                out = env[s.args[0]]
                continue
            if s.op == "get_attr":   # a tensor the decomposition made (none for a given window)
                name = f"_cadence_const_istft_{len(gm.graph.nodes)}"
                gm.register_buffer(name, attr_value(sub, s.target), persistent=False)
                env[s] = gm.graph.get_attr(name)
            else:
                env[s] = gm.graph.node_copy(s, lambda a: env[a])
            env[s].meta = dict(s.meta)
    out.meta = dict(out.meta, **{k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
