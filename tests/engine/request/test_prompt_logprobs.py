"""Prompt logprobs (engine/request/prompt_logprobs.py): the raw model's log_softmax at position t-1 for prompt token t,
its rank and the top n; the same whether the prompt is fed whole or in chunks, on both runners and in the in-process
engine; a request that does not ask never runs the LM head over its prompt."""

import pytest
import torch

from engine import ModelRunner, SamplingParams, SpeculativeEngine
from engine.models.static.runner import KVBudget, StaticRunner
from engine.request.prompt_logprobs import PIECE, PromptLogprobs, score_prefill, score_tokens
from tests.conftest import make_tiny_model

PROMPT = [(7 * t + 3) % 60 + 2 for t in range(2 * PIECE + 21)]  # longer than two pieces


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=0)


def direct(model, prompt):  # [L-1, V]: log_softmax of the model's logits at position t-1, for t = 1 .. L-1
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)


def runner_of(kind, model):
    if kind == "static":
        return StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=2), compile=False, prefill_chunk=32)
    return ModelRunner(model)


def test_score_tokens_is_the_log_softmax_with_vllms_rank_and_a_sorted_top():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=gen) * 3
    targets = [5, 9, 0, 63, 17, 17]
    want = logits.log_softmax(dim=-1)
    got = score_tokens(logits, targets, 4)
    for i, (entry, t) in enumerate(zip(got, targets)):
        assert entry.logprob == pytest.approx(want[i, t].item(), abs=1e-5)
        assert entry.rank == 1 + int((want[i] > want[i, t]).sum()), "1 + the tokens more likely"
        ids = [tid for tid, _ in entry.top]
        assert ids == want[i].argsort(descending=True)[:4].tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert (t in ids) == (entry.rank <= 4)
    assert [e.top for e in score_tokens(logits, targets, 0)] == [()] * 6


def score_in_chunks(runner, prompt, chunk, n):
    """What the target worker does with a prompt sent in chunks: each call's prompt positions through
    score_prefill, its last one through the batched forward, whose logits score the next chunk's first token."""
    runner.add("s")
    scored = [None] * len(prompt)
    for end in range(chunk, len(prompt) + chunk, chunk):
        known = prompt[:end]
        rest, run = score_prefill(runner, "s", known, runner.sync("s", known), len(prompt), n)
        logits = runner.forward(["s"], [rest], [1])[0]  # [1, V]
        runs = [run] if run is not None else []
        if end < len(prompt):
            runs.append(PromptLogprobs(end, score_tokens(logits, [prompt[end]], n)))
        for r in runs:
            for position, entry in enumerate(r.entries, r.first):
                assert scored[position] is None, "each position scored once"
                scored[position] = entry
    runner.release("s")
    return scored


@pytest.mark.parametrize("kind", ["model", "static"])
def test_prompt_logprobs_equal_the_models_forward_whole_or_in_chunks(model, kind):
    runner = runner_of(kind, model)
    want = direct(model, PROMPT)
    whole = score_in_chunks(runner, PROMPT, len(PROMPT), 3)
    chunked = score_in_chunks(runner, PROMPT, 40, 3)
    assert whole[0] is None and chunked[0] is None and None not in whole[1:] + chunked[1:]
    for t in range(1, len(PROMPT)):
        assert whole[t].logprob == pytest.approx(want[t - 1, PROMPT[t]].item(), abs=1e-4)
        assert whole[t].rank == 1 + int((want[t - 1] > want[t - 1, PROMPT[t]]).sum())
        assert [i for i, _ in whole[t].top] == want[t - 1].topk(3).indices.tolist()
        assert chunked[t].logprob == pytest.approx(whole[t].logprob, abs=1e-4)
        assert (chunked[t].rank, [i for i, _ in chunked[t].top]) == (whole[t].rank, [i for i, _ in whole[t].top])


def test_score_prefill_leaves_the_last_token_and_scores_nothing_past_the_prompt(model):
    runner = ModelRunner(model)
    runner.add("s")
    tokens = PROMPT[:10]
    rest, run = score_prefill(runner, "s", tokens, runner.sync("s", tokens), 10, 2)
    assert rest == [tokens[-1]] and run.first == 1 and len(run.entries) == 9
    runner.forward(["s"], [rest], [1])
    more = tokens + [4, 5, 6]  # output tokens: nothing to score
    rest, run = score_prefill(runner, "s", more, runner.sync("s", more), 10, 2)
    assert rest == [4, 5, 6] and run is None


class CountingRunner(ModelRunner):
    prompt_calls = 0

    def prompt_logits(self, seq_id, new_tokens):
        self.prompt_calls += 1
        return super().prompt_logits(seq_id, new_tokens)


def test_the_in_process_engine_returns_prompt_logprobs_only_when_asked(model, tiny_tokenizer):
    runner = CountingRunner(model)
    engine = SpeculativeEngine(runner, tiny_tokenizer, None, 0)
    plain = engine.generate([PROMPT[:30]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and runner.prompt_calls == 0, "the plain path never scores its prompt"
    asked = engine.generate([PROMPT[:30]], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2))[0]
    assert runner.prompt_calls == 1 and asked.token_ids == plain.token_ids
    want = direct(model, PROMPT[:30])
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == 30
    for t, entry in enumerate(asked.prompt_logprobs[1:], 1):
        assert entry.logprob == pytest.approx(want[t - 1, PROMPT[t]].item(), abs=1e-4)
        assert len(entry.top) == 2
