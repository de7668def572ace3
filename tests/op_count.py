"""Counting the aten ops a call runs that launch a kernel (views excluded): the per-chunk kernel
count of a compiled step against its stock step."""
import collections

from torch.utils._python_dispatch import TorchDispatchMode


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:   # views launch no kernel
            self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def difference(ours: "OpCount", theirs: "OpCount") -> str:
    more = {str(op): n for op, n in (ours.ops - theirs.ops).most_common()}
    fewer = {str(op): n for op, n in (theirs.ops - ours.ops).most_common()}
    return f"{ours.total} kernels compiled vs {theirs.total} stock; more {more}, fewer {fewer}"
