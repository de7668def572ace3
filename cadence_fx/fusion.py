"""Fused regions at run time: a run of pointwise ops compiled into fewer kernels, admitted only when
it computes the same bits as the stock kernels it replaces (``passes/fuse_exact.py`` finds them and
emits a ``RegionSpec`` each; ``make_regions`` puts a ``FusedRegion`` in each one's place).

States of a region: pending -> fused (verified) or stock (with the reason).

* A pending region is compiled on its first call, on the class's real inputs, by Inductor with
  eager numerics (``NUMERICS``): IEEE division, no flush-to-zero, every low-precision round trip
  kept, no FMA contraction, the CUDA toolkit's libdevice. Then both forms run on those inputs and
  every output is compared: its bits (``-0`` is not ``+0``, NaN payloads count), dtype, shape and
  strides; the call returns the stock result either way. Equal: the region runs fused from then
  on. Different, or the compile failed: it runs stock for good, and the reason is kept for the
  report. One input is a sample: what makes the fused form exact on every input is that a region
  holds only ops whose fused arithmetic is ATen's (``passes/fuse_exact.py``), each checked against
  ATen over edge inputs on the device; the verification catches what that argument missed.
* A region may end on a write (``passes/fuse_exact.py``: a copy of one of its values into a
  buffer): its fused code writes that input in place. The verification then puts the buffer
  back between the two runs and compares what each wrote too; a region refused leaves the stock
  run's bits there. On every eager call the written input must not share storage with another
  input (the fused kernel would read what it writes): then that call runs stock.
* Verification syncs with the host, so it may not happen under capture: the device-graph backend
  runs a piece whose regions are pending once eagerly first (as its warm-up runs a piece: side
  stream, everything the piece writes put back), and captures the fused kernels after that.
* With a compile cache (``region_kernels.py``), each verdict is stored with the compiled code,
  once per kernel key (the region's ops, its inputs' layout, the numerics, the compiler's source
  and the machine). A region made again in a later process -- a warm start -- takes both from
  there before its first call (``resolve``): it is fused or stock without compiling, verifying or
  an eager run before its capture. It checks its inputs' layout on its first fused call; a layout
  other than the one its key was made for sends it back to pending (verified on those inputs).
* ``compile_region`` is the compiler; tests swap it to see a region refused.
"""
from __future__ import annotations

import copy
import functools
import logging
from typing import Callable, List, Optional, Sequence

import torch

from . import region_kernels
from .passes.exact_ops import reciprocal
from .passes.fx_utils import val

__all__ = ["FusedRegion", "NUMERICS", "compile_region", "input_layout", "make_regions",
           "pending_regions", "regions", "resolve_regions"]

log = logging.getLogger(__name__)

# Inductor settings that keep its arithmetic to what the stock kernels do; a name this torch does
# not have is left out (``eager_numerics.use_pytorch_libdevice`` is new in 2.13; on 2.11
# ``emulate_precision_casts`` switches the toolkit's libdevice on by itself).
NUMERICS = {
    "eager_numerics.division_rounding": True,   # x / y as div_rn, not div.full
    "eager_numerics.disable_ftz": True,          # subnormals kept, as ATen's kernels keep them
    "eager_numerics.use_pytorch_libdevice": True,
    "emulate_precision_casts": True,             # bf16 round trips between ops; no FMA contraction
    "fallback_random": True,
    "use_fast_math": False,                      # libdevice's accurate exp, not an approximation
    # one launch configuration per pointwise kernel, not the best of two timed on the first call:
    # the same arithmetic per element either way, and no timing run (with its cache-flushing
    # buffer, the size of the L2 cache) inside a region's verification
    "triton.autotune_pointwise": False,
    "triton.cudagraphs": False,                  # the lowering captures; Inductor must not
    "freezing": False,
}


@functools.lru_cache(maxsize=None)
def _numerics_items() -> tuple:
    import torch._inductor.config as config
    have = config.get_config_copy()    # a deep copy of Inductor's config: about 3-9 ms, once
    return tuple((k, v) for k, v in NUMERICS.items() if k in have)


def _numerics() -> dict:
    return dict(_numerics_items())


def compile_region(module, args: Sequence, graph: Optional[tuple] = None) -> Callable:
    """Inductor's code for ``module`` at exactly these inputs' shapes, with eager numerics. A
    region with the same ops (``graph_key``; ``graph`` when known already) on inputs of the same
    layout -- the next layer's, the next Euler step's -- shares the code compiled first in this
    process. ``module`` may be a region loaded from the compile cache as code: it is traced
    again only when no region like it was compiled yet."""
    layout = layout_key(args)
    if graph is None or (graph, layout) not in _COMPILED:
        if not isinstance(module, torch.fx.GraphModule):
            from torch.fx.experimental.proxy_tensor import make_fx
            module = make_fx(module, pre_dispatch=True)(*args)
        graph = graph_key(module)
    key = (graph, layout)
    if key not in _COMPILED:
        _COMPILED[key] = region_kernels.compile_artifact(inductor_form(module), args, _numerics())
    return _COMPILED[key]


def inductor_form(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The region as Inductor must see it to compute what ATen's kernels compute: a division by
    a Python number becomes the product with its reciprocal, made in the kernel's precision
    (ATen's ``div_true_kernel_cuda`` multiplies by ``opmath(1) / opmath(b)``; Inductor would
    divide). The region's own graph is left as it is: the verification runs that one."""
    divs = [n for n in module.graph.nodes if n.op == "call_function"
            and n.target is torch.ops.aten.div.Tensor and len(n.args) == 2
            and isinstance(n.args[1], (int, float)) and not n.kwargs]
    if not divs:
        return module
    gm = torch.fx.GraphModule(module, copy.deepcopy(module.graph))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.div.Tensor and len(n.args) == 2 \
                and isinstance(n.args[1], (int, float)) and not n.kwargs:
            n.target, n.args = torch.ops.aten.mul.Tensor, (n.args[0], reciprocal(n.args[1]))
    gm.recompile()
    return gm


_COMPILED: dict = {}
_KEYS: dict = {}      # (graph, layout, compiler digest) -> kernel key


def graph_key(module: torch.fx.GraphModule) -> tuple:
    """The region's ops with their arguments, earlier values by position: equal keys compute the
    same function of their inputs."""
    index = {}
    ops = []
    for k, n in enumerate(module.graph.nodes):
        index[n] = k
        mapped = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", index[a]))
        ops.append((n.op, str(n.target) if n.op != "placeholder" else "", repr(mapped)))
    return tuple(ops)


def layout_key(args: Sequence) -> tuple:
    """The inputs' layout as Inductor's code assumes it (alignment included), and the modes the
    region was compiled under: Inductor traces it again under the autocast state of the call."""
    return _modes() + input_layout(args)


def _modes() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu"))


def input_layout(values: Sequence) -> tuple:
    """Each input's shape, strides, dtype, device and 16-byte alignment; of fake values (the
    trace's) too, whose alignment is their storage offset's (the allocator aligns every base)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return tuple((tuple(a.shape), a.stride(), a.dtype, str(a.device),
                  (a.storage_offset() * a.element_size()) % 16 if isinstance(a, FakeTensor)
                  else a.data_ptr() % 16)
                 if isinstance(a, torch.Tensor) else ("value", repr(a)) for a in values)


class FusedRegion(torch.nn.Module):
    """One run of pointwise ops: ``stock`` is its graph (the stock kernels), ``ops`` what it holds,
    ``writes`` the positions of the inputs it writes in place (its last op a copy into one),
    ``layout`` its inputs' layout as traced (``input_layout``; the kernel key of a stored verdict)."""

    def __init__(self, stock: torch.fx.GraphModule, name: str, ops: Sequence[str], counters=None,
                 graph: Optional[tuple] = None, writes: Sequence[int] = (),
                 layout: Optional[tuple] = None):
        super().__init__()
        self.writes = tuple(writes)
        self.layout = layout
        self.store: Optional[region_kernels.KernelStore] = None   # where verdicts are kept
        self.loaded = False               # fused or stock by a stored verdict, not verified here
        self._checked = True              # a loaded kernel's inputs were seen at its layout
        self._verified_at: Optional[str] = None   # the layout its stored verdict was made at
        self._looked = False              # its first call looked its key up in ``store``
        self.stock = stock
        # ``graph_key`` of the stock graph (a region loaded as code has no graph of its own)
        self.graph = graph if graph is not None or not isinstance(stock, torch.fx.GraphModule) \
            else graph_key(stock)
        self.region_name = name
        self.ops = list(ops)
        self.counters = counters
        self.state = "pending"            # -> "fused" | "stock"
        self.reason: Optional[str] = None
        self._fused: Optional[Callable] = None

    def forward(self, *args):
        if self.state == "pending" and not self._looked:
            # a region with its key may have been verified since this one was built (the same
            # block earlier in this pass): its verdict is taken as a restart would take it
            self._looked = True
            self.resolve(self.store)
        if not self._checked:
            self._checked = True
            if repr(layout_key(args)) != self._verified_at:   # not what its verdict was made at
                log.info("%s: inputs at another layout than its stored kernel's; verified again",
                         self.region_name)
                self._unload()
        if self.state == "fused" and not (self.writes and self._written_shared(args) is not None):
            return self._fused(*args)
        if self.state != "pending":
            return self.stock(*args)
        return self.verify(args)

    def _written_shared(self, args) -> Optional[int]:
        """The input that shares storage with a written one, if any (then the call runs stock)."""
        for k in self.writes:
            mine = args[k].untyped_storage().data_ptr()
            for j, a in enumerate(args):
                if j != k and isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == mine:
                    return j
        return None

    def resolve(self, store: Optional[region_kernels.KernelStore]) -> None:
        """Keep verdicts in ``store``, and take this region's from there if it has one: fused
        with the stored code, or stock with the stored reason, before any call."""
        self.store = store
        if store is None or self.layout is None or self.graph is None or self.state != "pending" \
                or region_kernels.recheck():
            return
        found = store.get(self._key(_modes() + self.layout))
        if found is None:
            return
        self.loaded, self._checked, self._verified_at = True, False, found.layout
        if self.counters is not None:
            self.counters.fusions_loaded += 1
        if found.verdict == "fused":
            self._fused, self.state = found.fn, "fused"
            if self.counters is not None:
                self.counters.fused_regions += 1
        else:
            self._refuse(found.reason, None)

    def _unload(self) -> None:
        if self.counters is not None:
            self.counters.fusions_loaded -= 1
            if self.state == "fused":
                self.counters.fused_regions -= 1
            else:
                self.counters.fusions_refused -= 1
        self.state, self.reason, self._fused, self.loaded = "pending", None, None, False

    def _key(self, layout: tuple) -> str:
        memo = (self.graph, layout, region_kernels.compiler_digest())
        if memo not in _KEYS:   # thousands of regions share a few hundred keys
            _KEYS[memo] = region_kernels.kernel_key(self.graph, layout, _numerics())
        return _KEYS[memo]

    def _keep(self, args, verdict: str, reason: Optional[str], fused) -> None:
        """Store this region's verdict under its key as traced (what a later process finds it
        by), with the layout it was made at (a key already stored fused is rewritten only by a
        refusal: one region refused makes every region with its key run stock)."""
        if self.store is None or self.graph is None:
            return
        made_at = layout_key(args)
        key = self._key(made_at if self.layout is None else _modes() + self.layout)
        known = self.store.known(key)
        if known is None or (known == "fused" and verdict == "stock"):
            self.store.put(key, verdict, reason, fused, layout=repr(made_at))

    def verify(self, args) -> tuple:
        """Compile, run both forms on ``args``, admit the fused one only if every output, and
        every input it writes, is the same bits at the same layout. Returns the stock outputs
        (what the stock form wrote stays written)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fused region {self.region_name} must be verified before capture")
        written = [args[k] for k in self.writes]
        before = [w.clone() for w in written]
        # compiled first: a region loaded as code is traced on these inputs, which runs it
        if self.store is not None:
            self.store.keep_code()   # the modules Inductor makes now, loaded later as code
        try:
            fused, failed = compile_region(self.stock, args, self.graph), None
        except Exception as e:  # noqa: BLE001 - the region stays stock, with the reason
            fused, failed = None, f"compile failed: {_first_line(e)}"
        _put(written, before)
        expected = self.stock(*args)
        shared = self._written_shared(args) if self.writes else None
        if failed is None and shared is not None:
            failed = f"input {self.writes[0]}, which it writes, shares storage with input {shared}"
        if failed is not None:
            if shared is None:   # the region's own verdict (a shared input is this call's)
                self._keep(args, "stock", failed, None)
            return self._refuse(failed, expected)
        after = [w.clone() for w in written]
        _put(written, before)
        try:
            got = fused(*args)
        except _DEVICE_ERRORS:   # out of memory, a broken device context: not the region's verdict
            _put(written, after)
            raise
        except Exception as e:  # noqa: BLE001 - the region stays stock, with the reason
            _put(written, after)
            self._keep(args, "stock", f"the fused code failed: {_first_line(e)}", None)
            return self._refuse(f"the fused code failed: {_first_line(e)}", expected)
        reason = _difference(expected, got) or _written_difference(after, written)
        if reason:
            _put(written, after)
            self._keep(args, "stock", reason, None)
            return self._refuse(reason, expected)
        self._fused, self.state = fused, "fused"
        self._keep(args, "fused", None, fused)
        if self.counters is not None:
            self.counters.fused_regions += 1
        log.debug("%s fused: %d ops", self.region_name, len(self.ops))
        return expected

    def _refuse(self, reason: str, expected) -> tuple:
        self.state, self.reason = "stock", reason
        if self.counters is not None:
            self.counters.fusions_refused += 1
        log.info("%s stays stock: %s", self.region_name, reason)
        return expected

    def extra_repr(self) -> str:
        return f"{self.region_name}: {len(self.ops)} ops, {self.state}" + (
            " (stored verdict)" if self.loaded else "") + (
            f", writes input {self.writes[0]}" if self.writes else "") + (
            f" ({self.reason})" if self.reason else "")


_DEVICE_ERRORS = tuple(e for e in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None))
                       if e is not None)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _put(tensors: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v)


def _written_difference(expected, got) -> Optional[str]:
    """What differs between the bits each form wrote (the same tensors: only values can)."""
    for k, (e, g) in enumerate(zip(expected, got)):
        if not torch.equal(_bits(e), _bits(g)):
            bad = (_bits(e) != _bits(g)).sum().item()
            return f"written input {k} differs from stock in {bad} of {e.numel()} elements"
    return None


def _difference(expected, got) -> Optional[str]:
    expected, got = list(expected), list(got)
    if len(expected) != len(got):
        return f"{len(got)} outputs, stock has {len(expected)}"
    for k, (e, g) in enumerate(zip(expected, got)):
        if not isinstance(g, torch.Tensor) or (e.dtype, e.shape, e.stride()) != (g.dtype, g.shape, g.stride()):
            what = (g.dtype, tuple(g.shape), g.stride()) if isinstance(g, torch.Tensor) else type(g)
            return (f"output {k} is {what}, stock gives {(e.dtype, tuple(e.shape), e.stride())}")
        # bits, not values: torch.equal calls -0 and +0 equal, and a NaN unequal to itself
        if not torch.equal(_bits(e), _bits(g)):
            bad = (_bits(e) != _bits(g)).sum().item()
            return f"output {k} differs from stock in {bad} of {e.numel()} elements"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def make_regions(gm: torch.nn.Module, ctx) -> int:
    """The ``FusedRegion`` of each ``RegionSpec`` the passes emitted (``ctx.specs.regions``), put
    where its stock graph is: in ``gm``, or in the piece the partition moved it to. The region's
    layout is its inputs' as traced (its stock graph's placeholders carry the traced values)."""
    made = {}
    for spec in ctx.specs.regions:
        values = [val(n) for n in spec.stock.graph.nodes if n.op == "placeholder"]
        layout = input_layout(values) if all(isinstance(v, torch.Tensor) for v in values) else None
        made[id(spec.stock)] = FusedRegion(spec.stock, spec.name, spec.ops, ctx.counters,
                                           writes=spec.writes, layout=layout)
    for parent in list(gm.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in made:
                setattr(parent, name, made[id(child)])
    return len(made)


def regions(module) -> List[FusedRegion]:
    if not isinstance(module, torch.nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, FusedRegion)]


def pending_regions(module: torch.nn.Module) -> bool:
    return any(r.state == "pending" for r in regions(module))


def resolve_regions(module, store: Optional[region_kernels.KernelStore]) -> None:
    """Every fused region of ``module`` keeps its verdicts in ``store`` and takes the stored ones
    (``FusedRegion.resolve``)."""
    for r in regions(module):
        r.resolve(store)
