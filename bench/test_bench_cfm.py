"""pytest-benchmark view of the CFM loop (GPU only):  pytest bench/test_bench_cfm.py -m gpu

One steady 50-frame chunk of the suite's CFM stream (``suite_measure.CFMStream``: the real
Token2Wav CFM step at DiT depth 16, its first chunk) at the retention's fixed
point (402 frames in, 402 out: each round feeds the previous round's state back), stock eager (E)
against cadence_fx (SRc), each round synchronised. ``bench/suite.py`` is the full
suite (every configuration, memory, floor); this is the quick regression check."""
import pytest
import torch

import cadence_fx

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cfm():
    from cadence_fx import adapters
    from suite_measure import CFMStream   # the suite's CFM part: its step and first chunk
    stream = CFMStream(16, 12)
    step, spks, state = stream.step, stream.spks, stream.prompt
    mu, cond = stream.xs[0]
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
        for _ in range(2):                            # 302 -> 352 -> 402 frames
            _, state = step(mu, spks, cond, state)
    state = {k: v.clone() for k, v in state.items()}
    adapter = adapters.get("minicpmo-token2wav").select("estimator_att_cache", "estimator_cnn_cache")
    return step, adapter, (mu, spks, cond), state


def _chunk(step, args, holder):
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float32):
        mel, holder["state"] = step(*args, holder["state"])
    torch.cuda.synchronize()
    return mel


def test_cfm_chunk_stock(benchmark, cfm):
    step, _, args, state = cfm
    benchmark.pedantic(_chunk, args=(step, args, {"state": state}), rounds=10, warmup_rounds=2)


def test_cfm_chunk_cadence(benchmark, cfm):
    step, adapter, args, state = cfm
    compiled = cadence_fx.compile(step, adapter)
    mel = _chunk(compiled, args, {"state": state})    # traces and captures this class
    assert torch.equal(mel, _chunk(step, args, {"state": state}))
    holder = {"state": state}
    benchmark.pedantic(_chunk, args=(compiled, args, holder), rounds=10, warmup_rounds=2)
    assert compiled.counters.fallbacks == 0 and compiled.counters.absorptions == 2
    compiled.close()
