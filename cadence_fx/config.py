"""What ``cadence_fx.compile`` was asked for: one frozen configuration, validated once.

``CompileConfig`` carries every switch and setting of ``compile`` (the pass ``options``, the
auditor, strict mode, device graphs, output copies, envelope release, the traces kept for the
report, the compile cache's directory, donated state), each checked when it is made: a value of
the wrong kind, or an ``options=`` that a keyword switch (``state_rule``, ``constants``,
``fuse``) disagrees with, is one ``ValueError`` naming the option and the fix. The compiled step
reads it and never changes it; a variant is ``dataclasses.replace(config, ...)``.

What a step is built *with* rather than asked for stays out of it: the module, and the objects
shared between steps (the carry store, the trace cache, a backend holding device graphs).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from .passes.pipeline import Options

__all__ = ["CompileConfig", "Options"]   # Options: the pass flags it carries

# compile's keyword for each pass switch it takes beside options=
_SWITCHES = {"state_rule": "state_rule", "constants": "constants", "fuse": "fuse_exact"}
_FLAGS = ("verify", "strict", "graphs", "copy_outputs", "release_envelopes", "keep_before",
          "donate_state")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """The options of one compiled step (``compile``'s docstring says what each does)."""

    options: Options = Options()     # the pass pipeline, one flag per pass
    verify: bool = False             # the shadow auditor on every carry write
    strict: bool = False             # raise instead of running the stock step
    graphs: bool = True              # device graphs where the backend has them
    copy_outputs: bool = True        # replayed results cloned before they leave the step
    release_envelopes: bool = False  # the stock envelopes' storage freed once carries replace them
    keep_before: bool = True         # each class's graph before the passes, for the report
    donate_state: bool = False       # a first state of the carry's layout becomes the carry
    tracing_mode: str = "fake"       # exact shapes with fake tensors: the only mode
    cache_dir: Optional[Union[str, os.PathLike]] = None   # the persistent compile cache

    def __post_init__(self):
        if not isinstance(self.options, Options):
            raise ValueError(f"compile(): options={self.options!r} ({type(self.options).__name__}) "
                             "is not pass options; give options=Options(...) "
                             "(cadence_fx.config.Options), one flag per pass")
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"compile(): {name}={value!r} is not a switch; give "
                                 f"{name}=True or {name}=False")
        if self.tracing_mode != "fake":
            raise ValueError(f"tracing_mode {self.tracing_mode!r}: cadence_fx traces exact shapes "
                             "with fake tensors, one graph per catalog signature (a 'real' trace "
                             "would run the step and write the user's module); use 'fake'")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"compile(): cache_dir={self.cache_dir!r} "
                             f"({type(self.cache_dir).__name__}) is not a directory; give a "
                             "directory path, or None (then CADENCE_FX_CACHE_DIR, when set)")

    @classmethod
    def of(cls, options: Optional[Options] = None, *, graphs: Optional[bool] = None,
           cache_dir=None, state_rule: Optional[bool] = None, constants: Optional[bool] = None,
           fuse: Optional[bool] = None, **settings) -> "CompileConfig":
        """The configuration of ``compile``'s keywords: ``graphs`` unset reads
        ``CADENCE_FX_DISABLE_GRAPHS``, ``cache_dir`` unset reads ``CADENCE_FX_CACHE_DIR``, and the
        pass switches given as keywords join ``options`` (default ``Options()``); one that
        disagrees with an explicit ``options`` is an error, not a silent override."""
        if graphs is None:
            graphs = os.environ.get("CADENCE_FX_DISABLE_GRAPHS", "0") in ("", "0")
        if cache_dir is None:
            cache_dir = os.environ.get("CADENCE_FX_CACHE_DIR") or None
        switches = {"state_rule": state_rule, "constants": constants, "fuse": fuse}
        return cls(options=_options(options, switches), graphs=graphs, cache_dir=cache_dir,
                   **settings)


def _options(options: Optional[Options], switches) -> Options:
    """``options`` with the keyword switches given (``{keyword: on or None}``)."""
    given = {_SWITCHES[k]: on for k, on in switches.items() if on is not None}
    for field, on in given.items():
        if not isinstance(on, bool):
            keyword = next(k for k, f in _SWITCHES.items() if f == field)
            raise ValueError(f"compile(): {keyword}={on!r} is not a switch; give {keyword}=True "
                             f"or {keyword}=False")
    if options is None:
        return Options(**given)
    if not isinstance(options, Options):
        return options   # refused by CompileConfig, naming the option
    clash = {f: on for f, on in given.items() if getattr(options, f) != on}
    if clash:
        said = ", ".join(f"{'fuse' if f == 'fuse_exact' else f}={on}" for f, on in clash.items())
        raise ValueError(f"compile(): {said} disagrees with options={options!r}; switch each pass "
                         "once, in options=Options(...) or as a keyword")
    return options
