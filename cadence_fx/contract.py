"""The adapter contract: a model family's clocks, state regions and effects, as plain data.

An adapter declares numbers and names only (paper §3.1). Everything else -- extents, the catalog,
memory prices, which graph nodes the carry pass rewrites -- is derived from them. ``Adapter.validate``
rejects inconsistent declarations before any model runs, naming the clock or region at fault.

Paths name a tensor inside a step's arguments or results: ``"att_cache"`` is the argument of that
name, ``"cache.estimator_att_cache"`` a dict entry inside it, ``"2"`` the third positional result.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional, Tuple, Union

from .errors import ContractError

__all__ = [
    "Adapter", "Region", "PromptRetained", "Ring", "SlidingWindow", "Effects",
    "Retention", "PREPEND", "APPEND",
]

PREPEND = "prepend"  # new frames enter at index 0 of the frame dimension (Token2Wav's caches)
APPEND = "append"    # new frames enter at the end (conv left-context, most KV caches)

Dim = Union[int, str, None]  # a literal size, a clock name, or None for the frame dimension


@dataclasses.dataclass(frozen=True)
class PromptRetained:
    """Keep the first ``prompt`` frames and the last ``retained`` frames (Token2Wav, eq. 3).

    Attended extents start at ``prompt`` (after the priming pass) and grow by the advance clock until
    retention caps them at ``prompt + retained``.
    """
    prompt: str
    retained: str

    def clocks(self) -> Tuple[str, ...]:
        return (self.prompt, self.retained)


@dataclasses.dataclass(frozen=True)
class Ring:
    """A ring buffer of ``window`` frames written in place (Moshi's RingKVCache): one extent."""
    window: str

    def clocks(self) -> Tuple[str, ...]:
        return (self.window,)


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """Keep the last ``window`` frames; extents start at ``start`` (0 if omitted) and grow to it."""
    window: str
    start: Optional[str] = None

    def clocks(self) -> Tuple[str, ...]:
        return (self.window,) if self.start is None else (self.window, self.start)


Retention = Union[PromptRetained, Ring, SlidingWindow]


@dataclasses.dataclass(frozen=True)
class Effects:
    """What a step may do besides computing: draw device (Philox) or host randomness."""
    device_rng: bool = False
    host_rng: bool = False


@dataclasses.dataclass(frozen=True)
class Region:
    """A persistent state region: one tensor, its frame dimension and its retention policy.

    ``input``/``output`` are the paths of the state in the step's arguments and results. ``shape``
    is the declared shape with ``None`` at the frame dimension (entries may be clock names);
    ``stock_shape`` is what the stock code reserves (its envelope) and ``envelope`` the module
    buffer holding it, if any. A sliding window, and stock code that writes the pre-retention
    state into its envelope, need ``room`` beyond the retention bound: a clock, the most frames
    one call adds. Left out, it is the widest call the adapter admits (its call widths and
    admission clock) when those count the region's frames, else ``advance``
    (``catalog.region_room``). A prompt-retained region gets room only when it declares it; a
    ring never has any. ``fixed_address`` regions live in a carry whose ``data_ptr()`` never
    changes for the stream's lifetime.
    """
    name: str
    input: str
    output: str
    dim: int
    retention: Retention
    advance: str
    ordering: str = APPEND
    shape: Tuple[Dim, ...] = ()
    element_bytes: int = 4
    stock_shape: Optional[Tuple[Dim, ...]] = None
    envelope: Optional[str] = None
    room: Optional[str] = None
    fixed_address: bool = True


@dataclasses.dataclass(frozen=True)
class Adapter:
    """Everything cadence_fx needs to know about a model family, as declarations.

    ``call_frames`` names the clocks giving the frame width of a steady call (e.g. ``f_chunk`` and the
    last call's ``f_call``); ``call_input``/``call_dim`` say where that width is read from the step's
    arguments. ``admission`` names the clock bounding a partial flush: ``frames <= clocks[admission]``.
    ``constants`` names tensor attributes of the model (last path component, e.g. ``stft_window``)
    that hold constants: subgraphs computed from them are evaluated once and kept on the device.
    Factories and literals in the step's code need no declaration.
    ``width_limit`` is the largest catalog width K a region may have (Criterion 3.5).
    ``recapture_on_drift``: after a fixed-address input moves, capture the class again at the new
    addresses on its next call (else it stays eager).
    ``repeated`` names methods the step calls many times with the same argument shapes, as
    ``"<submodule>.<method>"`` with the submodule named by the last component of its path (e.g.
    ``"estimator.forward_chunk"``, once per Euler step): each signature is traced once and the
    later calls' nodes are copied, which the tracer checks is exact (``cadence_fx.splice``).
    ``priming`` names stock methods outside the step that prime a stream from a prompt (e.g.
    ``"flow.setup_cache"``): with ``release_envelopes=True`` they get the released envelopes back
    for the call (zero-filled) and release them again, their results copied out first.
    ``prompt_lengths`` are the prompt lengths a server accepts for the priming pass (a call
    without region state), in the units of ``call_input`` along ``call_dim``: a tuple of sizes
    or clock names, or a ``range`` (start, stop, step). Each is a class ``capture_catalog``
    prepares; a declared length not yet compiled runs stock once while its class compiles in a
    background thread; a length not declared runs stock, with the reason.
    """
    name: str
    clocks: Mapping[str, int]
    regions: Tuple[Region, ...]
    call_frames: Tuple[str, ...] = ()
    call_input: Optional[str] = None
    call_dim: int = -1
    admission: Optional[str] = None
    constants: Tuple[str, ...] = ()
    effects: Effects = Effects()
    width_limit: int = 64
    recapture_on_drift: bool = True
    repeated: Tuple[str, ...] = ()
    priming: Tuple[str, ...] = ()
    prompt_lengths: Union[Tuple[Union[int, str], ...], range] = ()
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "clocks", MappingProxyType(dict(self.clocks)))
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "call_frames", tuple(self.call_frames))
        object.__setattr__(self, "constants", tuple(self.constants))
        object.__setattr__(self, "repeated", tuple(self.repeated))
        object.__setattr__(self, "priming", tuple(self.priming))
        if not isinstance(self.prompt_lengths, range):
            lengths = self.prompt_lengths
            object.__setattr__(self, "prompt_lengths",
                               (lengths,) if isinstance(lengths, (int, str)) else tuple(lengths))

    # -- derived numbers -------------------------------------------------------------------
    def clock(self, name: str, *, who: str = "adapter") -> int:
        if name not in self.clocks:
            known = ", ".join(sorted(self.clocks)) or "none"
            raise ContractError(
                f"{who} of adapter {self.name!r} names clock {name!r}, which is not declared "
                f"(declared clocks: {known}); add it to `clocks` or fix the name")
        return self.clocks[name]

    def dim_size(self, d: Dim, region: Region) -> Optional[int]:
        return self.clock(d, who=f"region {region.name!r}") if isinstance(d, str) else d

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise ContractError(f"adapter {self.name!r} has no region {name!r}; use one it declares: "
                            f"{', '.join(r.name for r in self.regions)}")

    def call_widths(self) -> Tuple[int, ...]:
        return tuple(sorted({self.clock(c, who="call_frames") for c in self.call_frames}))

    def prompt_widths(self) -> Tuple[int, ...]:
        """The declared prompt lengths as sizes along ``call_dim`` of ``call_input``, sorted."""
        if isinstance(self.prompt_lengths, range):
            return tuple(self.prompt_lengths)
        return tuple(sorted({self.clock(p, who="prompt_lengths") if isinstance(p, str) else p
                             for p in self.prompt_lengths}))

    def admits(self, frames: int) -> bool:
        """The admission predicate: a call of ``frames`` frames may enter the catalog."""
        if frames in self.call_widths():
            return True
        return self.admission is not None and 0 < frames <= self.clock(self.admission)

    def with_clocks(self, **clocks: int) -> "Adapter":
        """The same declarations at other numbers (a smaller model, another operating point)."""
        unknown = sorted(set(clocks) - set(self.clocks))
        if unknown:
            raise ContractError(f"adapter {self.name!r} has no clock(s) {unknown} to override; "
                                f"override only declared clocks ({', '.join(sorted(self.clocks))}) "
                                "or add them to `clocks`")
        return dataclasses.replace(self, clocks={**self.clocks, **clocks}).validate()

    def select(self, *regions: str) -> "Adapter":
        """The same adapter restricted to some regions (a step that holds only part of the state)."""
        return dataclasses.replace(self, regions=tuple(self.region(n) for n in regions)).validate()

    # -- validation ------------------------------------------------------------------------
    def validate(self) -> "Adapter":
        """Reject inconsistent declarations with an error naming the culprit and the fix."""
        where = f"adapter {self.name!r}"
        if not self.name:
            raise ContractError("adapter has no name; give it a registry name such as 'moshi'")
        for k, v in self.clocks.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ContractError(f"{where}: clock {k!r} = {v!r}; set it to a non-negative "
                                    "integer (clocks count frames, samples, steps or layers)")
        if not self.regions:
            raise ContractError(f"{where} declares no regions; declare at least one state region")
        names = [r.name for r in self.regions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ContractError(f"{where}: region name(s) {dup} declared twice; rename one "
                                "(region names are unique)")
        for r in self.regions:
            self._validate_region(r)
        for c in self.call_frames:
            if self.clock(c, who="call_frames") <= 0:
                raise ContractError(f"{where}: call clock {c!r} is 0; set it to the call's width "
                                    "(a call advances at least one frame) or drop it from `call_frames`")
        if self.admission is not None:
            self.clock(self.admission, who="admission")
        if self.call_frames and self.call_input is None:
            raise ContractError(f"{where} declares call_frames but no call_input; name the argument "
                                "whose `call_dim` carries the call width")
        if self.width_limit < 1:
            raise ContractError(f"{where}: width_limit {self.width_limit} must be >= 1; set it "
                                "to the most classes a region may have (default 64)")
        self._validate_prompt_lengths(where)
        for field, example in (("repeated", "estimator.forward_chunk"), ("priming", "flow.setup_cache")):
            for r in getattr(self, field):
                owner, _, method = r.rpartition(".")
                if not owner or not method.isidentifier() or not owner.isidentifier():
                    raise ContractError(f"{where}: {field} call {r!r} is not '<submodule>.<method>' "
                                        f"(e.g. {example!r}); fix `{field}`")
        return self

    def _validate_prompt_lengths(self, where: str) -> None:
        lengths = self.prompt_lengths
        if not lengths:
            if isinstance(lengths, range):
                raise ContractError(f"{where}: prompt_lengths {lengths} is empty; give a range "
                                    "with start < stop and a positive step, e.g. range(100, 401, 50)")
            return
        if self.call_input is None:
            raise ContractError(f"{where} declares prompt_lengths but no call_input; name the "
                                "argument whose `call_dim` carries the prompt's length")
        if isinstance(lengths, range) and lengths.step <= 0:
            raise ContractError(f"{where}: prompt_lengths {lengths} steps by {lengths.step}; use "
                                "a positive step")
        for p in ([] if isinstance(lengths, range) else lengths):
            if isinstance(p, bool) or not isinstance(p, (int, str)):
                raise ContractError(f"{where}: prompt length {p!r} is neither a size nor a clock "
                                    "name; give integers, clock names or a range")
        widths = self.prompt_widths()
        if widths[0] <= 0:
            raise ContractError(f"{where}: prompt length {widths[0]} is not positive; give "
                                "lengths of at least one frame (a prompt has one)")
        if len(widths) > self.width_limit:
            raise ContractError(f"{where}: {len(widths)} prompt lengths, over the width limit "
                                f"{self.width_limit} (each is a class); declare fewer (a coarser "
                                "step) or raise `width_limit`")

    def _validate_region(self, r: Region) -> None:
        where = f"region {r.name!r} of adapter {self.name!r}"
        if r.ordering not in (PREPEND, APPEND):
            raise ContractError(f"{where}: ordering {r.ordering!r}; use 'prepend' or 'append'")
        if not r.input or not r.output:
            raise ContractError(f"{where}: input and output paths are required; give the "
                                "state's path in the step's arguments and results "
                                "(e.g. input='cache.att', output='1.att')")
        if self.clock(r.advance, who=f"region {r.name!r} (advance)") <= 0:
            raise ContractError(f"{where}: advance clock {r.advance!r} is 0, so the region never "
                                "grows; set it to the frames one call adds (a ring's too)")
        for c in r.retention.clocks():
            self.clock(c, who=f"region {r.name!r} (retention)")
        if r.room is not None:
            self.clock(r.room, who=f"region {r.name!r} (room)")
            if isinstance(r.retention, Ring):
                raise ContractError(f"{where}: a Ring is written in place at its window "
                                    f"{r.retention.window!r} and holds no room; remove `room`")
        if isinstance(r.retention, PromptRetained) and self.clocks[r.retention.retained] == 0:
            raise ContractError(f"{where}: retained clock {r.retention.retained!r} is 0, so "
                                "retention would keep no history; set it to the frames of history "
                                "the stock code keeps after the prompt")
        if isinstance(r.retention, (Ring, SlidingWindow)) and self.clocks[r.retention.window] == 0:
            raise ContractError(f"{where}: window clock {r.retention.window!r} is 0; set it to "
                                "the frames the stock code keeps")
        if isinstance(r.retention, SlidingWindow) and r.retention.start is not None:
            if self.clocks[r.retention.start] > self.clocks[r.retention.window]:
                raise ContractError(f"{where}: start {r.retention.start!r} exceeds window "
                                    f"{r.retention.window!r}, so extents would never reach the "
                                    "window; lower `start` to at most the window, or leave it out "
                                    "for a window that starts empty")
        self._validate_shapes(r, where)

    def _validate_shapes(self, r: Region, where: str) -> None:
        if r.shape:
            if not 0 <= r.dim < len(r.shape):
                raise ContractError(f"{where}: frame dim {r.dim} outside its {len(r.shape)}-d "
                                    "shape; set `dim` to the index of the frame dimension in "
                                    "`shape` (counted from 0)")
            if r.shape[r.dim] is not None:
                raise ContractError(f"{where}: shape[{r.dim}] must be None (the frame dimension is "
                                    f"derived from the clocks), got {r.shape[r.dim]!r}; put None "
                                    "there, or fix `dim`")
            for i, d in enumerate(r.shape):
                if i != r.dim:
                    if d is None:
                        raise ContractError(f"{where}: shape[{i}] is None, but only the frame "
                                            f"dim ({r.dim}) may be; give it a clock or a size, or "
                                            "fix `dim`")
                    if self.dim_size(d, r) <= 0:
                        raise ContractError(f"{where}: shape[{i}] = {d!r} is not a positive "
                                            "size; give it a clock or a size above 0")
        elif r.dim < 0:
            raise ContractError(f"{where}: dim must be non-negative (got {r.dim}); count the "
                                "frame dimension from 0, or declare `shape`")
        if r.stock_shape is not None:
            if len(r.stock_shape) != len(r.shape):
                raise ContractError(f"{where}: stock_shape has {len(r.stock_shape)} dims but shape "
                                    f"has {len(r.shape)}; declare both with the same rank")
            for d in r.stock_shape:
                if d is None:
                    raise ContractError(f"{where}: stock_shape entries must all be sizes; give "
                                        "each dimension the clock or size the stock code reserves")
                self.dim_size(d, r)
        if r.element_bytes not in (1, 2, 4, 8):
            raise ContractError(f"{where}: element_bytes {r.element_bytes} is not a dtype "
                                "width; use 1, 2, 4 or 8 (4 for fp32, 2 for bf16, 8 for int64)")

