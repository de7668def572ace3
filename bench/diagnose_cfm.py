"""Where does a CFM stream diverge on the GPU? Compares stock eager, the traced graph run eagerly
(graphs=False) and the replayed graph, chunk by chunk, with max |diff| of mel and state."""
import argparse
import json
from collections import Counter

import torch

import cadence_fx
from cadence_fx import adapters
from cadence_fx.models.token2wav import CFMStep, build_cfm, prime_cfm


def run(step, xs, spks, prompt):
    outs, state = [], prompt
    for i, (mu, cond) in enumerate(xs):
        if i == len(xs) // 2:
            state = prompt
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
            mel, state = step(mu, spks, cond, state)
        outs.append((mel.cpu(), state["estimator_att_cache"][:10].cpu(), state["estimator_cnn_cache"].cpu()))
    return outs


def diff(a, b):
    return [max((x - y).abs().max().item() for x, y in zip(p, q)) for p, q in zip(a, b)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
    step = CFMStep(build_cfm(a.depth, device="cuda"))
    spks, prompt = prime_cfm(step, device="cuda")
    g = torch.Generator().manual_seed(9)
    xs = [(torch.randn(1, 80, w, generator=g).cuda(), torch.zeros(1, 80, w, device="cuda"))
          for w in [50, 50, 50, 56, 50, 50, 50, 56]]
    ad = adapters.get("minicpmo-token2wav").select("estimator_att_cache")
    res = {"depth": a.depth, "deterministic": a.deterministic}
    s1, s2 = run(step, xs, spks, prompt), run(step, xs, spks, prompt)
    res["stock_vs_stock"] = diff(s1, s2)
    eager = cadence_fx.compile(step, ad, graphs=False)
    res["traced_eager_vs_stock"] = diff(s1, run(eager, xs, spks, prompt))
    replay = cadence_fx.compile(step, ad)
    res["replay_vs_stock"] = diff(s1, run(replay, xs, spks, prompt))
    res["replay_counters"] = replay.counters.as_dict()
    nostate = cadence_fx.compile(step, ad, graphs=False, state_rule=False, constants=False)
    res["traced_plain_vs_stock"] = diff(s1, run(nostate, xs, spks, prompt))
    e = next(iter(eager.classes.values()))
    res["attention_ops"] = Counter(str(n.target) for n in e.traced.gm.graph.nodes
                                   if "attention" in str(n.target))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(step, xs[:1], spks, prompt)
    res["stock_attention_kernels"] = sorted({ev.name for ev in prof.events() if "attention" in ev.name.lower() or "fmha" in ev.name.lower() or "flash" in ev.name.lower()})[:10]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(eager, xs[:1], spks, prompt)
    res["traced_attention_kernels"] = sorted({ev.name for ev in prof.events() if "attention" in ev.name.lower() or "fmha" in ev.name.lower() or "flash" in ev.name.lower()})[:10]
    print(json.dumps(res, indent=1))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
