"""The speculative loop on tiny random-weight models: greedy exactness, losslessness, stops, edge cases."""


import pytest
import torch

from engine import (
    DraftModelProposer,
    EmptyPromptError,
    ModelRunner,
    NgramProposer,
    PromptTooLongError,
    SamplingParams,
    SpeculativeEngine,
)
from engine.spec.policy import CostProfile
from tests.conftest import make_tiny_model, perturbed_copy, third_token_marginals, total_variation_bound

PROMPTS = [
    [2, 3, 4, 5, 6],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [20, 21, 22, 20, 21, 22, 20, 21],  # repetitive: n-gram lookup finds drafts
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target_model():
    return make_tiny_model("llama", seed=0)


def engine_with(target_model, tokenizer, draft="perturbed", k=4, eos=()):
    runner = ModelRunner(target_model)
    if draft == "ngram":
        proposer = NgramProposer(min_n=1, max_n=3)
    elif draft is None:
        proposer = None
    else:
        draft_model = {"perturbed": lambda: perturbed_copy(target_model, 0.02),
                       "same": lambda: target_model,
                       "unrelated": lambda: make_tiny_model("llama", seed=99)}[draft]()
        proposer = DraftModelProposer(ModelRunner(draft_model), runner.vocab_size)
    return SpeculativeEngine(runner, tokenizer, proposer, k, eos_token_ids=eos)


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft", ["perturbed", "ngram", "unrelated"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_decoding(target_model, tiny_tokenizer, draft, batch):
    prompts = PROMPTS[:batch]
    engine = engine_with(target_model, tiny_tokenizer, draft)
    spec = engine.generate(prompts, GREEDY)
    plain = engine.generate(prompts, GREEDY, k=0)
    for s, p, prompt in zip(spec, plain, prompts):
        assert s.token_ids == p.token_ids
        assert s.token_ids == hf_greedy(target_model, prompt, GREEDY.max_tokens)
    assert engine.target.num_live == 0, "finished sequences free their cache slots"
    if draft == "perturbed":
        assert 0.3 < engine.stats.acceptance_rate < 1.0, "a mix of accepted and rejected drafts was exercised"


def test_all_drafts_accepted_with_identical_draft(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer, "same")
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.rounds == 6  # 5 tokens per round (4 accepted + bonus)
    assert out.stats.mean_acceptance_length == 5.0
    assert out.stats.accepted_per_position == [6, 6, 6, 6]


def test_first_draft_rejected_still_exact(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer, "unrelated")
    out = engine.generate([PROMPTS[1]], GREEDY)[0]
    assert out.stats.accepted_per_position[0] < out.stats.num_drafts  # some rounds rejected the first draft
    assert out.token_ids == hf_greedy(target_model, PROMPTS[1], GREEDY.max_tokens)


def test_k_zero_is_plain_decoding_through_same_path(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer, "perturbed", k=0)
    out = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert out.stats.num_drafts == 0 and out.stats.rounds == GREEDY.max_tokens
    assert out.token_ids == hf_greedy(target_model, PROMPTS[0], GREEDY.max_tokens)


def test_eos_inside_a_draft_chunk_ends_there(target_model, tiny_tokenizer):
    plain = engine_with(target_model, tiny_tokenizer, None).generate([PROMPTS[0]], GREEDY)[0].token_ids
    eos = plain[2]  # first round with an identical draft emits tokens 0..4: EOS lands mid-chunk
    expected = plain[: plain.index(eos) + 1]
    engine = engine_with(target_model, tiny_tokenizer, "same", eos=[eos])
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=32))[0]
    assert out.token_ids == expected and out.finish_reason == "stop"


def test_stop_string_inside_a_draft_chunk(target_model, tiny_tokenizer):
    plain = engine_with(target_model, tiny_tokenizer, None).generate([PROMPTS[0]], GREEDY)[0]
    words = plain.text.split(" ")
    stop = f"{words[6]} {words[7]}"
    assert stop not in " ".join(words[:7])
    out = engine_with(target_model, tiny_tokenizer, "same").generate(
        [PROMPTS[0]], SamplingParams(max_tokens=32, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[:8]  # the token completing the stop string is the last one
    assert out.text == " ".join(words[:6]) + " "  # the stop string itself is not returned


def test_max_tokens_reached_mid_chunk_never_overshoots(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer, "same")
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_empty_and_too_long_prompts_are_refused(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    with pytest.raises(EmptyPromptError, match="empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(PromptTooLongError, match="context window is 256"):
        engine.add_request("l", [5] * 300, GREEDY)
    assert engine.num_live == 0 and engine.target.num_live == 0


def test_seeds_reproduce_and_differ(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    run = lambda seed: engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=24, seed=seed,
                                                                    ignore_eos=True))[0].token_ids
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sequences_join_and_leave_between_rounds(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = {"a": [], "b": [], "c": []}
    rounds = 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        rounds += 1
        if rounds == 2:
            engine.add_request("c", PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
    for rid, prompt, n in [("a", PROMPTS[0], 20), ("b", PROMPTS[1], 6), ("c", PROMPTS[2], 12)]:
        assert tokens[rid] == hf_greedy(target_model, prompt, n)
    assert engine.timings.max_batch == 3


def test_abort_frees_caches_at_once(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.step()
    assert engine.target.num_live == 1 and engine.proposer.runner.num_live == 1
    engine.abort("a")
    assert engine.num_live == 0 and engine.target.num_live == 0 and engine.proposer.runner.num_live == 0


def test_streaming_deltas_add_up_to_the_text(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    deltas = []
    out = engine.generate([PROMPTS[0]], GREEDY, on_round=lambda outs: deltas.extend(o.new_text for o in outs))[0]
    assert "".join(deltas) == out.text == tiny_tokenizer.decode(out.token_ids)
    assert len([d for d in deltas if d]) > 1


@pytest.mark.parametrize("seeded", [True, False], ids=["gumbel", "rejection"])
def test_sampled_generation_is_lossless_end_to_end(tiny_tokenizer, seeded):
    """The 3rd generated token's marginal, under speculation with rollbacks, equals the target's exact marginal:
    seeded requests (Gumbel coupling, over many seeds) and unseeded ones (rejection sampling, seeds drawn)."""
    vocab = 8
    target = make_tiny_model("llama", vocab=vocab, seed=3)
    draft = perturbed_copy(target, 0.25, seed=4)
    prompt = [2, 3, 4]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    exact, draft_marginal = third_token_marginals(target, draft, prompt, vocab)
    n = 3000
    runner = ModelRunner(target)
    engine = SpeculativeEngine(runner, tiny_tokenizer, DraftModelProposer(ModelRunner(draft), vocab), 2)
    outs = engine.generate([prompt] * n, [SamplingParams(**{**params.__dict__, "seed": i if seeded else None})
                                          for i in range(n)])
    third = torch.tensor([o.token_ids[2] for o in outs])
    got = torch.bincount(third, minlength=vocab).float() / n
    bound = total_variation_bound(vocab, n)
    assert 0.5 * (got - exact).abs().sum() < bound
    assert 0.5 * (draft_marginal - exact).abs().sum() > 2 * bound, "the draft differs enough to be detectable"
    assert 0.1 < engine.stats.acceptance_rate < 0.95  # both acceptances and rollbacks happened


ADAPTIVE = CostProfile((1, 8), ((0.010, 0.0105, 0.011, 0.0115), (0.020, 0.021, 0.022, 0.023)), (0.0005, 0.001))


@pytest.mark.parametrize("draft", ["perturbed", "unrelated", "ngram"])
def test_a_seeded_request_gives_the_same_text_for_any_k_batch_policy_and_draft(target_model, tiny_tokenizer, draft):
    """Drafter invariance (Gumbel coupling): with a seed the text is that of plain decoding with that seed, whatever
    K, the batch it shares rounds with, the adaptive policy, or the draft; a different seed gives another text."""
    params = [SamplingParams(temperature=1.0, top_k=40, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    plain = engine_with(target_model, tiny_tokenizer, None).generate(PROMPTS[:1], params[:1])[0].token_ids
    engine = engine_with(target_model, tiny_tokenizer, draft, k=3)
    for k in (0, 1, 3):
        assert engine.generate(PROMPTS[:1], params[:1], k=k)[0].token_ids == plain, f"K = {k}"
    batch = engine.generate([PROMPTS[i % 4] for i in range(8)], params, k=3)  # batch 8, mixed prompts
    assert batch[0].token_ids == plain
    engine.profile = ADAPTIVE  # the adaptive plan: K by acceptance and batch, round by round
    adaptive = engine.generate([PROMPTS[i % 4] for i in range(8)], params)
    assert [c.token_ids for c in adaptive] == [c.token_ids for c in batch]
    assert engine.stats.num_drafts > 0, "drafts were made (and, with a random draft, mostly rejected)"
    other = engine.generate(PROMPTS[:1], [SamplingParams(**{**params[0].__dict__, "seed": 999})])[0].token_ids
    assert other != plain


def test_unseeded_requests_differ_from_each_other(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = engine.generate([PROMPTS[0]] * 2, params)
    assert a.token_ids != b.token_ids, "each request drew its own seed at admission"


def test_logprobs_ride_along_with_their_tokens(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    [done] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=12, seed=1, logprobs=3,
                                                          ignore_eos=True))
    assert len(done.logprobs) == len(done.token_ids) == 12
    assert all(len(lp.top) == 3 and lp.top[0][1] + 1e-6 >= lp.logprob for lp in done.logprobs)
    [plain] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert plain.logprobs is None and plain.token_ids == done.token_ids


def test_speculation_switches_off_above_the_batch_threshold(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer)
    engine.max_batch_for_speculation = 2
    big = engine.generate(PROMPTS[:3], GREEDY)  # 3 live > 2: plain rounds
    assert all(c.stats.num_drafts == 0 for c in big)
    small = engine.generate(PROMPTS[:2], GREEDY)
    assert all(c.stats.num_drafts > 0 for c in small)
    assert [c.token_ids for c in big[:2]] == [c.token_ids for c in small]
