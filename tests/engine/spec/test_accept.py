"""The one accept step (engine/spec/accept.py) over verify logits: greedy by argmax, seeded rows by Gumbel coupling,
unseeded sampled rows by the rejection sampler with counter uniforms; logprobs where asked; commit."""

import math

import pytest
import torch

from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from engine.request.sequence import SequenceState
from engine.spec.accept import RowVerify, TokenLogprob, Verdict, commit, token_logprobs, verify_rows
from engine.spec.policy import AcceptanceTracker
from engine.spec.proposal import CompactProposal, RowScheme
from engine.spec.randomness import ACCEPT, RESIDUAL, gumbel, seeds_tensor, uniforms
from engine.spec.rejection import rejection_sample
from engine.spec.stats import SpecStats

VOCAB = 7
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


def _logits(batch, width, seed=0):
    return torch.randn(batch, width, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _row(params, drafts, seed=5, coupled=False, position=10, proposal=None):
    return RowVerify(params, RowScheme(params.greedy, coupled, seed, position), drafts, proposal)


def test_greedy_rows_keep_the_agreeing_prefix_then_the_targets_token():
    logits = _logits(3, 4)
    argmax = logits.argmax(-1).tolist()
    drafts = [argmax[0][:2] + [(argmax[0][2] + 1) % VOCAB], argmax[1][:3], []]
    verdicts = verify_rows(logits, [_row(GREEDY, d) for d in drafts])
    assert verdicts == [Verdict(argmax[0][:3], 2),  # rejected at the third: the target's token there (recovered)
                        Verdict(argmax[1][:4], 3),  # all accepted: the bonus token
                        Verdict(argmax[2][:1], 0)]  # no drafts: plain decoding


def test_unseeded_rows_are_the_rejection_sampler_with_the_rows_counter_uniforms():
    logits = _logits(2, 3, seed=1)
    ids = torch.tensor([[0, 3, 5], [1, 2, 6]], dtype=torch.int32)
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    proposal = CompactProposal(ids, probs)
    rows = [_row(SAMPLED, [3, 2], seed=41, position=9, proposal=proposal), _row(SAMPLED, [5], seed=42, position=4,
                                                                               proposal=proposal.head(1))]
    got = verify_rows(logits, rows)

    target = logits_to_probs(logits, BatchSampling.from_params([SAMPLED, SAMPLED]))
    dense = torch.zeros(2, 2, VOCAB)
    dense[0].scatter_(-1, ids.long(), probs)
    dense[1, :1].scatter_(-1, ids[:1].long(), probs[:1])
    seeds = seeds_tensor([41, 42])
    positions = torch.tensor([[9, 10, 11], [4, 5, 6]])
    want = rejection_sample(torch.tensor([[3, 2], [5, -1]]), dense, target, torch.tensor([2, 1]),
                            uniforms(seeds, positions[:, :2], ACCEPT), uniforms(seeds, positions, RESIDUAL))
    assert [(v.tokens, v.num_accepted) for v in got] == [(want.tokens(b), int(want.num_accepted[b])) for b in (0, 1)]


def test_seeded_rows_emit_the_targets_gumbel_choice_at_each_position():
    logits = _logits(1, 4, seed=2)
    probs = logits_to_probs(logits, BatchSampling.from_params([SAMPLED]))[0]
    choice = (probs.log() + gumbel(seeds_tensor([77]), torch.tensor([[20, 21, 22, 23]]), VOCAB)[0]).argmax(-1)
    choice = choice.tolist()
    for drafts, accepted in (([], 0), (choice[:3], 3), (choice[:1] + [(choice[1] + 1) % VOCAB, 0], 1)):
        [verdict] = verify_rows(logits, [_row(SAMPLED, drafts, seed=77, coupled=True, position=20)])
        assert verdict.num_accepted == accepted
        assert verdict.tokens == choice[: accepted + 1], "the drafts decide only how many tokens come at once"


def test_ngram_drafts_are_one_hot_so_a_draft_the_target_cannot_produce_is_always_rejected():
    logits = torch.full((1, 2, VOCAB), -1e4)
    logits[..., 4] = 0.0  # the target puts (all but) no mass on token 2
    for seed in range(20):
        [verdict] = verify_rows(logits, [_row(SAMPLED, [2], seed=seed)])
        assert verdict == Verdict([4], 0)


def test_a_sampled_model_draft_without_its_proposal_beside_one_with_is_refused():
    proposal = CompactProposal(torch.zeros(1, 3, dtype=torch.int32), torch.tensor([[1.0, 0.0, 0.0]]))
    with pytest.raises(AssertionError, match="proposal"):
        verify_rows(_logits(2, 2), [_row(SAMPLED, [0], proposal=proposal), _row(SAMPLED, [1])])


def test_logprobs_come_only_when_asked_from_the_processed_distribution():
    logits = _logits(2, 2, seed=3)
    top_k = SamplingParams(temperature=0.5, top_k=3, logprobs=2)
    verdicts = verify_rows(logits, [_row(top_k, [1]), _row(SAMPLED, [1])])
    assert verdicts[1].logprobs is None
    lps = verdicts[0].logprobs
    assert len(lps) == len(verdicts[0].tokens) and all(isinstance(t, TokenLogprob) for t in lps)
    processed = logits_to_probs(logits[:1], BatchSampling.from_params([top_k]))[0]
    for pos, (token, lp) in enumerate(zip(verdicts[0].tokens, lps)):
        assert math.isclose(lp.logprob, math.log(processed[pos, token]), rel_tol=1e-5)
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
        assert lp.top[0][0] == int(processed[pos].argmax())
    [greedy] = verify_rows(logits[:1], [_row(SamplingParams(logprobs=0), [])])
    assert greedy.logprobs[0].top == () and math.isclose(
        greedy.logprobs[0].logprob, float(logits[0, 0].log_softmax(-1).max()), rel_tol=1e-5), "greedy: raw logprobs"


def test_token_logprobs_shapes():
    lps = token_logprobs(torch.log_softmax(torch.randn(2, 5), -1), [1, 3], 3)
    assert [len(t.top) for t in lps] == [3, 3]


def test_commit_appends_records_and_cuts_at_eos_with_the_logprobs(tiny_tokenizer):
    seq = SequenceState.create("r", [2, 3], SamplingParams(max_tokens=10), 3, 64, frozenset({1}), tiny_tokenizer)
    stats, own, population = SpecStats(), AcceptanceTracker(), AcceptanceTracker()
    lps = [TokenLogprob(-0.1, ()), TokenLogprob(-0.2, ()), TokenLogprob(-0.3, ())]
    out = commit(seq, 3, Verdict([5, 1, 6], 2, lps), stats, (own, population))
    assert out.new_token_ids == [5, 1] and out.finished and out.finish_reason == "stop", "EOS kept, 6 dropped"
    assert out.logprobs == lps[:2], "logprobs cut with their tokens"
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_emitted_tokens) == (3, 2, 2)
    assert seq.stats.num_accepted_tokens == 2
    assert own.accepted == population.accepted > AcceptanceTracker().accepted, "both trackers saw the round"


def test_every_request_has_a_seed_its_own_or_one_drawn_at_admission(tiny_tokenizer):
    mine = SequenceState.create("a", [2], SamplingParams(temperature=1.0, seed=9), 0, 64, frozenset(), tiny_tokenizer)
    drawn = [SequenceState.create("b", [2], SAMPLED, 0, 64, frozenset(), tiny_tokenizer) for _ in range(2)]
    assert mine.seed == 9 and mine.coupled
    assert drawn[0].seed != drawn[1].seed and not drawn[0].coupled


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
