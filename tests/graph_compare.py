"""Node-for-node comparison of two traced graphs, for tests of what makes tracing and the passes
faster: the faster path must give the graph the plain one gives."""
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef


def difference(ga, gb):
    """None when the graphs match node for node, else the first difference."""
    na, nb = list(ga.graph.nodes), list(gb.graph.nodes)
    if len(na) != len(nb):
        return f"{len(na)} vs {len(nb)} nodes"
    pa, pb = {n: i for i, n in enumerate(na)}, {n: i for i, n in enumerate(nb)}
    ab, ba = {}, {}
    for i, (x, y) in enumerate(zip(na, nb)):
        if x.op != y.op or (x.op != "get_attr" and x.target != y.target):
            return f"node {i}: {x.op} {x.target} vs {y.op} {y.target}"
        if x.op == "get_attr" and not torch.equal(getattr(ga, x.target), getattr(gb, y.target)):
            return f"node {i}: constants {x.target} and {y.target} differ"
        fa = pytree.tree_map(lambda v: ("node", pa[v]) if isinstance(v, torch.fx.Node) else v, (x.args, x.kwargs))
        fb = pytree.tree_map(lambda v: ("node", pb[v]) if isinstance(v, torch.fx.Node) else v, (y.args, y.kwargs))
        if repr(fa) != repr(fb):
            return f"node {i} ({x.name}): arguments {fa} vs {fb}"
        va, vb = pytree.tree_leaves(x.meta.get("val")), pytree.tree_leaves(y.meta.get("val"))
        if len(va) != len(vb):
            return f"node {i} ({x.name}): value structure differs"
        for u, w in zip(va, vb):
            if not isinstance(u, torch.Tensor) or not isinstance(w, torch.Tensor):
                if u != w:
                    return f"node {i} ({x.name}): value {u!r} vs {w!r}"
                continue
            gu = (u.shape, u.stride(), u.storage_offset(), u.dtype, u.untyped_storage().nbytes())
            gw = (w.shape, w.stride(), w.storage_offset(), w.dtype, w.untyped_storage().nbytes())
            if gu != gw:
                return f"node {i} ({x.name}): geometry {gu} vs {gw}"
            su, sw = StorageWeakRef(u.untyped_storage()), StorageWeakRef(w.untyped_storage())
            if ab.setdefault(su, sw) != sw or ba.setdefault(sw, su) != su:
                return f"node {i} ({x.name}): storage sharing differs"
    return None
