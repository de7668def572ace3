"""Layout probe: do two stock kernels of the Token2Wav DiT give the same bits when their inputs
arrive in another memory layout, and what does each layout cost on this GPU?

    python bench/probe_layouts.py --out layouts.json

* ``conv``: the causal conv of ``CausalConvBlock`` (conv1d 512 -> 512, kernel 3, batch 2 (CFG),
  50 and 56 frames + 2 cached) on its stock input, ``cat([cache, x.transpose(1, 2)], 2)`` (NCL:
  cuDNN transposes it, and the weight, to NHWC for its kernel on every call), against the same
  values written channels-last, ``cat([cache.transpose(1, 2), x], 1).transpose(1, 2)`` (NLC), with
  the weight as stock (PyTorch makes it channels-last per call) and pre-converted.
* ``sdpa``: the estimator's attention on ``k = cat([k_new, k_cache], 2)`` (contiguous, as stock)
  against ``k``/``v`` as the two halves of one preallocated ``(b, h, t + L, 2 * d)`` buffer the
  cache is written into (strided views).

Each comparison is ``torch.equal`` on the bit patterns over ``--draws`` random inputs; times are
CUDA-event medians over ``--iters`` calls after warm-up; the kernels each form launches are read
from the profiler.
"""
from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F

from common import parser, run_info, write_result


def bits(t):
    return t.contiguous().view(torch.int32)


def timed(fn, iters):
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [[e.key[:110], round(e.device_time_total, 2), e.count] for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def conv_probe(frames, draws, iters):
    g = torch.Generator(device="cuda").manual_seed(frames)
    dev, c, k = "cuda", 512, 3
    w = torch.randn(c, c, k, device=dev, generator=g) * 0.02
    b = torch.randn(c, device=dev, generator=g) * 0.01
    w_cl = w.transpose(1, 2).contiguous().transpose(1, 2)   # (out, in, k) as NHWC's KRSC

    def stock(x, cache):
        return F.conv1d(torch.cat([cache, x.transpose(1, 2)], 2), w, b)

    def nlc(x, cache, weight=w):
        return F.conv1d(torch.cat([cache.transpose(1, 2), x], 1).transpose(1, 2), weight, b)

    same = {"nlc": 0, "nlc_weight_cl": 0}
    for _ in range(draws):
        x = torch.randn(2, frames, c, device=dev, generator=g)
        cache = torch.randn(2, c, k - 1, device=dev, generator=g)
        ref = stock(x, cache)
        same["nlc"] += torch.equal(bits(ref), bits(nlc(x, cache)))
        same["nlc_weight_cl"] += torch.equal(bits(ref), bits(nlc(x, cache, w_cl)))
    out = nlc(x, cache)
    return {"frames": frames, "draws": draws, "bit_equal": same,
            "out_strides": {"stock": list(ref.stride()), "nlc": list(out.stride())},
            "us": {"stock": timed(lambda: stock(x, cache), iters),
                   "nlc": timed(lambda: nlc(x, cache), iters),
                   "nlc_weight_cl": timed(lambda: nlc(x, cache, w_cl), iters)},
            "kernels": {"stock": kernels(lambda: stock(x, cache)),
                        "nlc": kernels(lambda: nlc(x, cache)),
                        "nlc_weight_cl": kernels(lambda: nlc(x, cache, w_cl))}}


def sdpa_probe(frames, held, draws, iters):
    g = torch.Generator(device="cuda").manual_seed(held)
    dev, h, d = "cuda", 8, 64

    def stock(q, k, v, cache):
        k_cache, v_cache = cache.chunk(2, dim=3)
        kk, vv = torch.cat([k, k_cache], 2), torch.cat([v, v_cache], 2)
        kv = torch.cat([kk, vv], 3)
        return F.scaled_dot_product_attention(q, kk, vv), kv

    buf = torch.empty(2, h, frames + held, 2 * d, device=dev)

    def in_place(q, k, v, cache):
        buf[:, :, :frames, :d] = k
        buf[:, :, frames:, :] = cache
        buf[:, :, :frames, d:] = v
        return F.scaled_dot_product_attention(q, buf[..., :d], buf[..., d:]), buf

    same = 0
    for _ in range(draws):
        q, k = (torch.randn(2, h, frames, d, device=dev, generator=g) for _ in range(2))
        v = torch.randn(2, frames, h, d, device=dev, generator=g).transpose(1, 2)
        cache = torch.randn(2, h, held, 2 * d, device=dev, generator=g)
        a, kv_a = stock(q, k, v, cache)
        b_, kv_b = in_place(q, k, v, cache)
        same += torch.equal(bits(a), bits(b_)) and torch.equal(bits(kv_a), bits(kv_b))
    return {"frames": frames, "held": held, "draws": draws, "bit_equal": same,
            "us": {"stock": timed(lambda: stock(q, k, v, cache), iters),
                   "in_place": timed(lambda: in_place(q, k, v, cache), iters)},
            "kernels": {"stock": kernels(lambda: stock(q, k, v, cache)),
                        "in_place": kernels(lambda: in_place(q, k, v, cache))}}


def main():
    a = parser(__doc__, draws=20, iters=200).parse_args()
    res = run_info(cudnn=torch.backends.cudnn.version(),
                   conv=[conv_probe(f, a.draws, a.iters) for f in (50, 56)],
                   sdpa=[sdpa_probe(50, held, a.draws, a.iters) for held in (302, 352)])
    print(json.dumps({k: ([{x: r[x] for x in ("bit_equal", "us")} for r in v]
                          if isinstance(v, list) else v) for k, v in res.items()}, indent=1))
    write_result(a.out, res)


if __name__ == "__main__":
    main()
