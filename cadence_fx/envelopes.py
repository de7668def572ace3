"""Envelope memory: the stock buffers the carries replaced, freed while the compiled path runs.

With ``release_envelopes=True`` a compiled step frees the storage of the module's stock envelope
buffers (Token2Wav's (16, 16, 2, 8, 1000, 128) ``att_cache_buffer``) once every class it compiled
reads the carries instead: the memory the state rule saves. The tensors keep their shape, so later
classes still trace; stock code reading them before they are restored fails loudly. The storage
comes back, zero-filled as the stock module starts it, while a class compiles (the probationary
call runs stock code, the carry pass reads the buffers it replaces) and for good when the stock
step runs as a fallback.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
from typing import Dict, Iterable, Iterator, List, Set, Tuple

import torch
import torch.utils._pytree as pytree

from .contract import Adapter
from .counters import Counters
from .errors import ContractError

__all__ = ["Envelopes"]


def _own_methods(cls) -> List[str]:
    """Public methods the model's classes define (``nn.Module``'s own -- ``parameters``,
    ``state_dict``, ``to`` -- never read an envelope's values and stay unwrapped)."""
    base = set(torch.nn.Module.__mro__)
    names: Dict[str, None] = {}
    for klass in cls.__mro__:
        if klass in base:
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(value):
                names.setdefault(name, None)
    return list(names)

log = logging.getLogger(__name__)


class Envelopes:
    """Which envelope buffers are released, and their bytes. ``params``/``buffers`` are the
    compiled step's own name -> tensor dicts (they grow when stock code registers buffers late)."""

    def __init__(self, params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor],
                 counters: Counters):
        self._params = params
        self._buffers = buffers
        self._counters = counters
        self.released: Dict[str, int] = {}   # buffer name -> bytes of its freed storage

    def release(self, names: Iterable[str]) -> None:
        """Free the storage of these buffers unless other tensors share it (a view, or storage a
        parameter or another buffer uses: freeing it would free them)."""
        shared = collections.Counter(t.untyped_storage().data_ptr() for t in
                                     [*self._params.values(), *self._buffers.values()]
                                     if t.untyped_storage().nbytes())
        for name in names:
            if name in self.released:
                continue   # released before (its storage is empty now): nothing to do
            buf = self._buffers[name]
            storage = buf.untyped_storage()
            whole = (buf.storage_offset() == 0 and shared[storage.data_ptr()] == 1
                     and storage.nbytes() == buf.numel() * buf.element_size())
            if not whole:
                log.info("stock envelope %s shares its storage; it is kept", name)
                continue
            if storage.nbytes():
                self.released[name] = storage.nbytes()
                storage.resize_(0)
                log.debug("released stock envelope %s (%d bytes)", name, self.released[name])
        self._counters.released_bytes = sum(self.released.values())

    def restore(self, keep: bool) -> None:
        """Give every released envelope its storage back, zero-filled (the stock step overwrites
        the rows it returns before reading them). ``keep``: for good, counted as restored bytes."""
        for name, nbytes in list(self.released.items()):
            buf = self._buffers[name]
            buf.untyped_storage().resize_(nbytes)
            with torch.no_grad():
                buf.untyped_storage().fill_(0)
            del self.released[name]
            if keep:
                self._counters.restored_bytes += nbytes
        self._counters.released_bytes = sum(self.released.values())

    @contextlib.contextmanager
    def held_back(self) -> Iterator[Set[str]]:
        """Restore the released envelopes for the duration of a class compile; afterwards release
        them again, with the names the caller added to the yielded set (newly replaced ones)."""
        released = set(self.released)
        self.restore(keep=False)
        replaced: Set[str] = set()
        try:
            yield replaced
        finally:
            self.release(sorted(released | replaced))

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """The released envelopes back, zero-filled, for one stock call that needs them (a
        declared priming method), and released again afterwards. The peak holds them meanwhile."""
        released = sorted(self.released)
        self.restore(keep=False)
        try:
            yield
        finally:
            self.release(released)

    def guard(self, module: torch.nn.Module, adapter: Adapter,
              priming: List[Tuple[torch.nn.Module, str]]) -> None:
        """Make stock code that would read a released envelope fail with the fix instead of a
        storage error: every method of an envelope's owning module checks first; the adapter's
        declared priming methods borrow the envelopes instead (``lent``), and copy out any result
        that lives in one before they are released again."""
        names = {r.envelope for r in adapter.regions if r.envelope}
        owners = [(path, sub) for path, sub in module.named_modules()
                  if any(n in sub._buffers for n in names)]
        for path, sub in owners:
            held = [f"{path}.{n}" if path else n for n in names if n in sub._buffers]
            for name in _own_methods(type(sub)):
                if name in vars(sub):
                    continue
                setattr(sub, name, self._guarded(getattr(sub, name), f"{type(sub).__name__}.{name}",
                                                 held, adapter))
        for sub, name in priming:
            setattr(sub, name, self._lending(getattr(sub, name)))

    def _guarded(self, method, label: str, held: List[str], adapter: Adapter):
        @functools.wraps(method)
        def guarded(*args, **kwargs):
            if self.released:
                raise ContractError(
                    f"{label} reads the stock envelope(s) {held}, whose storage this compiled step "
                    f"released (release_envelopes=True). Prime through the compiled step (call it "
                    f"with the state None), declare the stock priming method in the adapter's "
                    f"`priming` (adapter {adapter.name!r} declares {list(adapter.priming)}), call "
                    f"compiled.close() first, or compile without release_envelopes")
            return method(*args, **kwargs)
        return guarded

    def _lending(self, method):
        @functools.wraps(method)
        def lending(*args, **kwargs):
            if not self.released:
                return method(*args, **kwargs)
            names = list(self.released)
            with self.lent():
                envelopes = {self._buffers[n].untyped_storage().data_ptr() for n in names}
                out = method(*args, **kwargs)
                self._counters.primes_lent += 1
                return pytree.tree_map_only(
                    torch.Tensor, lambda t: t.clone() if t.untyped_storage().data_ptr() in envelopes
                    else t, out)
        return lending
