"""The one accept-and-commit path (engine/accept.py): greedy by argmax alone, sampled through the rejection sampler."""

import pytest
import torch

from engine.accept import TargetScores, Verdict, accept, commit, score
from engine.policy import AcceptanceTracker
from engine.rejection import rejection_sample
from engine.sampling import SamplingParams
from engine.sequence import SequenceState
from engine.stats import SpecStats

VOCAB = 7


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _dist(rows, seed):
    return torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(seed)).softmax(dim=-1)


def test_greedy_rows_keep_the_agreeing_prefix_then_the_targets_token_with_no_probabilities():
    drafts = [[5, 6, 7], [5, 6], [], [4, 4]]
    scores = TargetScores(argmax={0: [5, 6, 2, 3], 1: [5, 6, 1], 2: [3], 3: [0, 4, 4]}, probs={})
    verdicts = accept(drafts, scores, None, _gens(0, 1, 2, 3))
    assert verdicts == [Verdict([5, 6, 2], 2),  # rejected at the third: the target's token there (recovered)
                        Verdict([5, 6, 1], 2),  # all accepted: the bonus token
                        Verdict([3], 0),  # no drafts: plain decoding
                        Verdict([0], 0)]  # the first draft rejected: nothing after it counts


def test_sampled_rows_are_the_rejection_samplers_over_the_sampled_rows_alone():
    drafts = [[1, 2], [3], [0, 0, 0]]  # row 1 is greedy; rows 0 and 2 sample
    target = {0: _dist(3, 1), 2: _dist(4, 2)}
    draft = {0: _dist(2, 3), 2: _dist(3, 4)}
    scores = TargetScores(argmax={1: [3, 6]}, probs=target)
    got = accept(drafts, scores, draft, _gens(10, 11, 12))

    draft_ids = torch.tensor([[1, 2, -1], [0, 0, 0]])
    target_probs = torch.zeros(2, 4, VOCAB)
    target_probs[0, :3], target_probs[1] = target[0], target[2]
    draft_probs = torch.zeros(2, 3, VOCAB)
    draft_probs[0, :2], draft_probs[1] = draft[0], draft[2]
    want = rejection_sample(draft_ids, draft_probs, target_probs, torch.tensor([2, 3]), _gens(10, 12))
    assert got[0] == Verdict(want.tokens(0), int(want.num_accepted[0]))
    assert got[2] == Verdict(want.tokens(1), int(want.num_accepted[1]))
    assert got[1] == Verdict([3, 6], 1)


def test_ngram_drafts_are_one_hot_so_a_draft_the_target_cannot_produce_is_always_rejected():
    target = torch.zeros(2, VOCAB)
    target[:, 4] = 1.0  # the target puts no mass on token 2
    for seed in range(20):
        [verdict] = accept([[2]], TargetScores({}, {0: target}), None, _gens(seed))
        assert verdict == Verdict([4], 0)


def test_a_sampled_model_draft_without_its_probabilities_is_refused():
    with pytest.raises(AssertionError, match="no draft probabilities"):
        accept([[1]], TargetScores({}, {0: _dist(2, 0)}), {}, _gens(0))


def test_score_gives_greedy_rows_their_argmax_and_sampled_rows_distributions_of_their_width():
    logits = torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(0))
    scores = score(logits, [SamplingParams(), SamplingParams(temperature=0.8, top_k=3)], [4, 2])
    assert scores.argmax == {0: logits[0].argmax(dim=-1).tolist()} and set(scores.probs) == {1}
    assert scores.probs[1].shape == (2, VOCAB)
    assert torch.allclose(scores.probs[1].sum(dim=-1), torch.ones(2))
    assert ((scores.probs[1] > 0).sum(dim=-1) == 3).all(), "processed like the draft's: top-k applied"


def test_commit_appends_records_and_cuts_at_eos(tiny_tokenizer):
    seq = SequenceState.create("r", [2, 3], SamplingParams(max_tokens=10), 3, 64, frozenset({1}), tiny_tokenizer)
    stats, own, population = SpecStats(), AcceptanceTracker(), AcceptanceTracker()
    out = commit(seq, 3, Verdict([5, 1, 6], 2), stats, (own, population))
    assert out.new_token_ids == [5, 1] and out.finished and out.finish_reason == "stop", "EOS kept, 6 dropped"
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_emitted_tokens) == (3, 2, 2)
    assert seq.stats.num_accepted_tokens == 2
    assert own.accepted == population.accepted > AcceptanceTracker().accepted, "both trackers saw the round"
