"""The module's tensors as one compiled step reads them: parameters and buffers by name, the
private copies of the buffers its graphs write, and the tensors the adapter declares constant.

The compiled path never writes the user's module: a buffer a rewritten graph still writes in
place gets a private copy (``keep_private``), which the graphs read and write instead. The stock
step, when a call falls back to it, writes the module's own buffers, so the two are handed over
around it (``lent_to_stock``) and stay one stream of buffer state. Stock code may register
module state lazily, after ``compile`` (Mimi's codebook cache): ``refresh`` picks it up.

It does not decide which buffers are written (the class compiler does) nor release envelopes
(``envelopes.py``).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable

import torch

from .tracing import module_state_tensors

__all__ = ["ModuleTensors"]


class ModuleTensors:
    """``params`` and ``buffers`` (by name, the module's own tensors), ``private`` (buffer name
    -> the compiled path's copy) and ``constant_ids`` (ids of tensor attributes the adapter
    declares constant, e.g. HiFT's ``stft_window``)."""

    def __init__(self, module: torch.nn.Module, constants: Iterable[str] = ()):
        self.module = module
        self.params: Dict[str, torch.Tensor] = dict(module.named_parameters())
        self.buffers: Dict[str, torch.Tensor] = dict(module.named_buffers())
        self.private: Dict[str, torch.Tensor] = {}
        constants = set(constants)
        self.constant_ids = {id(t) for name, t in module_state_tensors(module).items()
                             if name.rsplit(".", 1)[-1] in constants}

    def refresh(self) -> None:
        """Take in parameters and buffers the module registered since (the dicts stay the same
        objects: admission and envelopes hold them)."""
        self.params.update(self.module.named_parameters())
        self.buffers.update(self.module.named_buffers())

    def buffer(self, name: str) -> torch.Tensor:
        """The buffer as compiled graphs read it: the private copy where there is one."""
        return self.private.get(name, self.buffers[name])

    def keep_private(self, name: str) -> None:
        """A private copy of the buffer ``name``, which compiled graphs write from now on."""
        if name not in self.private:
            with torch.inference_mode(False):   # written in place under any later mode
                self.private[name] = self.buffers[name].detach().clone()

    def on_cuda(self) -> bool:
        return any(p.is_cuda for p in self.params.values())

    @contextlib.contextmanager
    def lent_to_stock(self):
        """Around a stock call: the module's buffers get the private copies' latest values, and
        the copies take the stock step's writes back afterwards."""
        with torch.no_grad():
            for name, private in self.private.items():
                self.buffers[name].copy_(private)
        yield
        with torch.no_grad():
            for name, private in self.private.items():
                private.copy_(self.buffers[name])
