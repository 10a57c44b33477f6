"""The static runner on CUDA (skipped without a GPU; run there by hand, bench/RESULTS.md): the same logits as the
CPU transformers forward, CUDA graphs == eager, and no host sync inside a step (CUDA's sync debug mode)."""

import pytest
import torch

from engine.model_runner import ModelRunner
from engine.static_runner import KVBudget, StaticRunner, forbid_host_sync
from tests.conftest import make_tiny_model
from tests.engine.test_static_runner import ROUNDS, assert_same_logits, scripted

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLOTS = KVBudget(gib=0.5, max_num_seqs=4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_cuda_static_forward_matches_cpu_transformers(family):
    model = make_tiny_model(family, seed=0)
    want = scripted(ModelRunner(model, fast_path=False), ROUNDS)
    got = scripted(StaticRunner(model.to("cuda"), budget=SLOTS, compile=False, prefill_chunk=16), ROUNDS)
    assert_same_logits([g.cpu() for g in got], want, atol=1e-3, rtol=1e-3)


def test_cuda_graphs_agree_with_eager_and_make_no_host_sync():
    model = make_tiny_model("llama", seed=4).to("cuda")
    eager = scripted(StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=32), ROUNDS)
    runner = StaticRunner(model, budget=SLOTS, compile=True, prefill_chunk=32)
    compiled = scripted(runner, ROUNDS)
    assert_same_logits([c.cpu() for c in compiled], [e.cpu() for e in eager], atol=1e-3, rtol=1e-3)
    step = runner._step

    def guarded(*args):
        with forbid_host_sync(runner.device):
            return step(*args)

    for guard in (False, True):  # the first pass compiles and captures this shape; the second replays it
        runner._step = guarded if guard else step
        for s in ("a", "b", "c"):
            runner.sync(s, runner.cached_tokens(s)[:3])
        runner.forward(["a", "b", "c"], [[5], [6], [7]], [1, 1, 1])


def test_bf16_static_greedy_equals_plain_decoding_of_the_same_dtype():
    model = make_tiny_model("llama", seed=5).to("cuda", torch.bfloat16)
    runner = StaticRunner(model, budget=SLOTS, compile=False)
    runner.add("s")
    tokens = [2, 3, 4, 5]
    logits = runner.forward(["s"], [tokens], [1])
    for _ in range(8):
        tokens.append(int(logits[0, -1].argmax()))
        logits = runner.forward(["s"], [runner.sync("s", tokens)], [1])
    with torch.no_grad():
        full = model(torch.tensor([tokens], device="cuda")).logits[0, 3:-1].float().argmax(-1).tolist()
    assert full == tokens[4:]
