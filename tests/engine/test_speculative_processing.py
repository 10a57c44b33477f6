"""Speculation stays lossless under vLLM's request-level processing (penalties, logit_bias, min_p, min_tokens):
the sampled marginal equals the processed target distribution for both sampling schemes, greedy speculative
decoding equals greedy plain decoding (and a dense reference) for K in {1, 3}, and the draft processes its steps
as the target does; stop_token_ids and min_tokens end sequences as vLLM's do."""

import pytest
import torch

import engine.proposers.draft_model as proposers
import engine.request.logits_processing as logits_processing
from engine import DraftModelProposer, ModelRunner, NgramProposer, SamplingParams, SpeculativeEngine
from engine.request.logits_processing import RowContext
from tests.conftest import make_tiny_model, perturbed_copy, total_variation_bound
from tests.engine.reference_processing import reference_greedy, reference_logits

EOS = 1  # the tiny tokenizer's </s>
PROMPT = [2, 3, 4, 5, 6, 3, 4]
PENALISED = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                           repetition_penalty=1.3, logit_bias=((11, 2.0), (44, -3.0)), min_tokens=3)


@pytest.fixture(scope="module")
def target_model():
    return make_tiny_model("llama", seed=0)


def engine_with(model, tokenizer, draft, k):
    runner = ModelRunner(model)
    proposer = {"ngram": lambda: NgramProposer(min_n=1, max_n=3), None: lambda: None,
                "perturbed": lambda: DraftModelProposer(ModelRunner(perturbed_copy(model, 0.02)), runner.vocab_size),
                "same": lambda: DraftModelProposer(ModelRunner(model), runner.vocab_size)}[draft]()
    return SpeculativeEngine(runner, tokenizer, proposer, k)


def _processed_probs(model, prompt, output, params, eos):
    """The processed distribution plain decoding samples from after prompt + output (temperature 1, min-p)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, -1]
    probs = reference_logits(logits, prompt, output, params, eos).softmax(-1)
    return torch.where(probs >= params.min_p * probs.max(), probs, 0.0) / probs[probs >= params.min_p * probs.max()].sum()


def third_token_marginal(model, prompt, vocab, params, eos):
    p1 = _processed_probs(model, prompt, [], params, eos)
    p2 = torch.stack([_processed_probs(model, prompt, [a], params, eos) for a in range(vocab)])
    p3 = torch.stack([_processed_probs(model, prompt, [a, b], params, eos) for a in range(vocab) for b in range(vocab)])
    return torch.einsum("a,ab,abc->c", p1, p2, p3.view(vocab, vocab, vocab))


def _sampled_third_tokens(engine, params, n, seeded):
    outs = engine.generate([[2, 3, 4]] * n, [SamplingParams(**{**params.__dict__, "seed": i if seeded else None})
                                             for i in range(n)])
    return torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=8).float() / n


@pytest.mark.parametrize("seeded", [True, False], ids=["gumbel", "rejection"])
def test_sampled_marginal_is_the_processed_target_distribution(tiny_tokenizer, seeded, monkeypatch):
    """K = 2 over 3 tokens: the third token is often verify position 2, whose history includes both drafts. The
    control re-runs with the processors fed the committed tokens only (the drafts dropped from every position's
    context), drafting with the target itself so that nearly every third token comes from that position, and the
    same check must catch it."""
    vocab, n = 8, 3000
    target = make_tiny_model("llama", vocab=vocab, seed=3)
    draft = perturbed_copy(target, 0.25, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=1.0, repetition_penalty=1.5, logit_bias=((5, 1.5), (2, -1.0)),
                            min_p=0.05, min_tokens=2)
    exact = third_token_marginal(target, [2, 3, 4], vocab, params, (EOS,))
    plain = third_token_marginal(target, [2, 3, 4], vocab, SamplingParams(temperature=1.0), ())
    bound = total_variation_bound(vocab, n)
    assert 0.5 * (exact - plain).abs().sum() > 2 * bound, "the processing changes the distribution detectably"

    def run(draft):
        engine = SpeculativeEngine(ModelRunner(target), tiny_tokenizer, DraftModelProposer(ModelRunner(draft), vocab),
                                   2)
        got = _sampled_third_tokens(engine, params, n, seeded)
        return got, engine.stats.acceptance_rate

    got, acceptance = run(draft)
    assert 0.5 * (got - exact).abs().sum() < bound
    assert 0.1 < acceptance < 0.95, "both acceptances and rollbacks happened"
    if seeded:
        return  # one control suffices: it tests the context, not the scheme
    monkeypatch.setattr(logits_processing.RowProcessing, "context",
                        lambda self, drafts=(), first=0: RowContext(self.tokens, self.prompt_len))
    broken, _ = run(target)
    assert 0.5 * (broken - exact).abs().sum() > bound, "the control: committed-only processing is caught"


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", ["perturbed", "ngram"])
def test_greedy_speculative_equals_greedy_plain_decoding_with_processing(target_model, tiny_tokenizer, draft, k):
    params = [PENALISED, SamplingParams(max_tokens=24, repetition_penalty=2.0, logit_bias=((30, 1.0),)),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    prompts = [PROMPT, [20, 21, 22, 20, 21, 22, 20, 21], [7, 8, 9]]
    engine = engine_with(target_model, tiny_tokenizer, draft, k)
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, k=0)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for prompt, p, c in zip(prompts, params, spec):
        assert c.token_ids == reference_greedy(target_model, prompt, p, (EOS,))[: len(c.token_ids)]
    assert engine.stats.num_drafts > 0
    unpenalised = engine.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True), k=k)[0].token_ids
    assert unpenalised != spec[0].token_ids and len(set(unpenalised)) < len(unpenalised), (
        "the check can fail: without the penalties the text differs and repeats itself")
    assert len(set(spec[0].token_ids)) == len(spec[0].token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_identical_to_the_target_processes_its_steps_as_the_target_does(target_model, tiny_tokenizer,
                                                                                temperature, monkeypatch):
    """With the target as its own draft, every draft is accepted only if the draft's step j was processed with the
    j tokens drafted before it, as the target's position j is. The control drafts with the processing left out."""
    params = SamplingParams(**{**PENALISED.__dict__, "temperature": temperature})
    engine = engine_with(target_model, tiny_tokenizer, "same", 3)
    engine.generate([PROMPT], params)
    assert engine.stats.acceptance_rate > (0.999 if temperature else 1.0 - 1e-9)
    monkeypatch.setattr(proposers, "process_logits", lambda logits, *args: logits)
    control = engine_with(target_model, tiny_tokenizer, "same", 3)
    # 96 tokens: sampled with a drawn seed, 24 tokens' acceptance passed 0.9 in 1 of 30 tries (96: at most 0.56)
    control.generate([PROMPT], SamplingParams(**{**params.__dict__, "max_tokens": 96}))
    assert control.stats.acceptance_rate < 0.9


def test_a_stop_token_ends_the_sequence_and_min_tokens_holds_it_off(target_model, tiny_tokenizer):
    engine = engine_with(target_model, tiny_tokenizer, "perturbed", 3)
    forced = ((17, 100.0),)  # token 17 wins every position
    [stopped] = engine.generate([PROMPT], SamplingParams(max_tokens=20, logit_bias=forced, stop_token_ids=(17,)))
    assert stopped.token_ids == [17] and stopped.finish_reason == "stop" and stopped.text == "", (
        "the stop token is emitted, its text is not (vLLM)")
    [kept] = engine.generate([PROMPT], SamplingParams(max_tokens=20, logit_bias=forced, stop_token_ids=(17,),
                                                      include_stop_str_in_output=True))
    assert kept.text == "w17"
    [held] = engine.generate([PROMPT], SamplingParams(max_tokens=20, logit_bias=forced, stop_token_ids=(17,),
                                                      min_tokens=5))
    assert len(held.token_ids) == 6 and held.token_ids[-1] == 17 and 17 not in held.token_ids[:5]
    assert held.finish_reason == "stop"
    [eos] = engine.generate([PROMPT], SamplingParams(max_tokens=20, logit_bias=((EOS, 100.0),), min_tokens=4))
    assert len(eos.token_ids) == 5 and eos.token_ids[-1] == EOS and eos.finish_reason == "stop"
