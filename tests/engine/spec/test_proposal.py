"""Draft token choice by scheme and the compact proposal (engine/spec/proposal.py): the rejection sampler against the
truncated q~ the draft sampled from is still exact."""

import math

import torch

from engine.spec.proposal import CompactProposal, RowScheme, choose_draft_tokens, dense
from engine.spec.randomness import ACCEPT, RESIDUAL, gumbel, seeds_tensor, uniforms
from engine.spec.rejection import rejection_sample

VOCAB = 40
TOP = 6
SAMPLES = 20_000


def _dist(seed, scale=2.0):
    return (torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale).softmax(-1)


def tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def test_each_scheme_picks_its_own_way():
    probs = torch.stack([_dist(0), _dist(1), _dist(2)])
    schemes = [RowScheme(True, False, 1, 5), RowScheme(False, True, 9, 7), RowScheme(False, False, 3, 4)]
    tokens, ids, values = choose_draft_tokens(probs, schemes, TOP)
    assert int(tokens[0]) == int(probs[0].argmax())
    noise = gumbel(seeds_tensor([9]), torch.tensor([[7]]), VOCAB)[0, 0]
    assert int(tokens[1]) == int((probs[1].log() + noise).argmax()), "the noise the target uses at position 7"
    assert torch.equal(ids[2].long(), probs[2].topk(TOP).indices)
    assert torch.equal(values[2], probs[2].topk(TOP).values), "q itself at its top-N; the rest is the tail's"
    assert not values[:2].any(), "only unseeded sampled rows carry a proposal"


def test_drafts_follow_the_compact_proposal_top_n_and_uniform_tail():
    """The draft's tokens are distributed as q~ (its top-6 of 40 tokens, the rest of the mass spread evenly), which
    `dense` rebuilds at the target; a flat q keeps most of its mass in the tail."""
    q = _dist(12, 0.5)
    schemes = [RowScheme(False, False, s, 30) for s in range(SAMPLES)]
    tokens, ids, values = choose_draft_tokens(q.expand(SAMPLES, -1), schemes, TOP)
    q_tilde = dense([CompactProposal(ids[:1], values[:1])], 1, VOCAB, "cpu")[0, 0]
    assert math.isclose(float(q_tilde.sum()), 1.0, rel_tol=1e-5) and float(values[0].sum()) < 0.5
    drafted = torch.bincount(tokens, minlength=VOCAB).float() / SAMPLES
    bound = 4 * 0.5 * math.sqrt(2 * VOCAB / (math.pi * SAMPLES))
    assert tv(drafted, q_tilde) < bound
    outside = [t for t in range(VOCAB) if t not in ids[0].tolist()]
    assert (drafted[outside] > 0).all(), "every token outside the top-N is reachable"
    renormalised = torch.zeros(VOCAB).scatter_(0, ids[0].long(), values[0] / values[0].sum())
    assert tv(drafted, renormalised) > 2 * bound, "the control: a renormalised top-N alone would be far off"


def test_rejection_sampling_against_the_truncated_proposal_is_exact():
    """The draft samples from q~ (its top-6 of 40 tokens and a uniform tail); the output still follows the target's
    p (TV bound), while the drafts themselves are measurably not p: the check can fail."""
    target_p, draft_q = _dist(10, 1.0), _dist(11, 1.0)
    schemes = [RowScheme(False, False, s, 30) for s in range(SAMPLES)]
    tokens, ids, values = choose_draft_tokens(draft_q.expand(SAMPLES, -1), schemes, TOP)
    proposals = [CompactProposal(ids[i : i + 1], values[i : i + 1]) for i in range(SAMPLES)]
    draft_probs = dense(proposals, 1, VOCAB, "cpu")
    seeds, positions = seeds_tensor(list(range(SAMPLES))), torch.tensor([[30, 31]]).expand(SAMPLES, -1)
    result = rejection_sample(tokens[:, None], draft_probs, target_p.expand(SAMPLES, 2, VOCAB),
                              torch.ones(SAMPLES, dtype=torch.long), uniforms(seeds, positions[:, :1], ACCEPT),
                              uniforms(seeds, positions, RESIDUAL))
    out = torch.bincount(result.output_token_ids[:, 0], minlength=VOCAB).float() / SAMPLES
    bound = 4 * 0.5 * math.sqrt(2 * VOCAB / (math.pi * SAMPLES))
    assert tv(out, target_p) < bound
    drafted = torch.bincount(tokens, minlength=VOCAB).float() / SAMPLES
    assert tv(drafted, target_p) > 2 * bound
    # acceptance is sum_x min(p(x), q~(x)), the truncated proposal's own
    q_tilde = draft_probs[0, 0]
    expected = torch.minimum(target_p, q_tilde).sum().item()
    assert abs((result.num_accepted == 1).float().mean().item() - expected) < 0.02


def test_dense_scatters_each_rows_proposal_and_leaves_the_rest_zero():
    prop = CompactProposal(torch.tensor([[3, 1], [0, 2]], dtype=torch.int32), torch.tensor([[0.7, 0.3], [0.4, 0.6]]))
    out = dense([prop, None, prop.head(1)], 2, 5, "cpu")
    assert out.shape == (3, 2, 5)
    assert torch.allclose(out[0], torch.tensor([[0, 0.3, 0, 0.7, 0], [0.4, 0, 0.6, 0, 0]]))
    assert not out[1].any() and not out[2, 1].any()
    tail = CompactProposal(torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([[0.5, 0.2]]))
    assert torch.allclose(dense([tail], 1, 5, "cpu")[0, 0], torch.tensor([0.1, 0.2, 0.1, 0.5, 0.1])), "tail 0.3 / 3"
