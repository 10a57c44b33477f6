"""The samplers: lossless for every sampling setting (rejection sampling and Gumbel coupling), exact for greedy,
vLLM's accepted/recovered/bonus. Random numbers come from the counter RNG, one seed per sample."""

import math

import pytest
import torch

from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from engine.spec.randomness import ACCEPT, DRAFT, RESIDUAL, gumbel, inverse_cdf, uniforms
from engine.spec.rejection import gumbel_accept, rejection_sample

VOCAB = 6
SAMPLES = 20_000


def tv_bound(n: int, vocab: int = VOCAB) -> float:
    # E[TV] of an n-sample empirical distribution is at most 0.5 * sqrt(2 V / (pi n)); allow 4x that
    return 4 * 0.5 * math.sqrt(2 * vocab / (math.pi * n))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def empirical(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def counters(n: int, k: int, seed: int):
    """Seeds [N] and the absolute positions [N, K+1] of N independent samples (one request seed each)."""
    seeds = torch.arange(n, dtype=torch.long) + seed * 1_000_003
    positions = torch.arange(k + 1)[None, :].expand(n, -1) + 17
    return seeds, positions


def sampler_inputs(k: int, params: SamplingParams):
    """Known per-position target/draft logits: correlated (so later positions are reached often) but different."""
    gen = torch.Generator().manual_seed(1234 + k)
    target_logits = torch.randn(1, k + 1, VOCAB, generator=gen) * 1.5
    draft_logits = target_logits[:, :k] + torch.randn(1, k, VOCAB, generator=gen) * 1.2
    rows = BatchSampling.from_params([params])
    return logits_to_probs(target_logits, rows)[0], logits_to_probs(draft_logits, rows)[0]  # [K+1, V], [K, V]


def run_sampler(k: int, params: SamplingParams, seed: int = 0, draft_is_one_hot: bool = False):
    """Drafts drawn from the processed draft distribution with the DRAFT stream, then the rejection sampler."""
    target_p, draft_p = sampler_inputs(k, params)
    seeds, positions = counters(SAMPLES, k, seed)
    draft_u = uniforms(seeds, positions[:, :k], DRAFT)  # [N, K]
    drafts = torch.stack([inverse_cdf(draft_p[i].expand(SAMPLES, -1), draft_u[:, i]) for i in range(k)], dim=1)
    draft_probs = None if draft_is_one_hot else draft_p[None].expand(SAMPLES, k, VOCAB)
    result = rejection_sample(drafts, draft_probs, target_p[None].expand(SAMPLES, k + 1, VOCAB),
                              torch.full((SAMPLES,), k), uniforms(seeds, positions[:, :k], ACCEPT),
                              uniforms(seeds, positions, RESIDUAL))
    return target_p, draft_p, drafts, result


def run_gumbel(k: int, params: SamplingParams, seed: int = 0):
    """Gumbel coupling: the draft proposes argmax(log q + G), the target accepts its own argmax(log p + G)."""
    target_p, draft_p = sampler_inputs(k, params)
    seeds, positions = counters(SAMPLES, k, seed)
    noise = gumbel(seeds, positions, VOCAB)  # [N, K+1, V]
    drafts = (draft_p.log()[None] + noise[:, :k]).argmax(dim=-1)  # [N, K]
    result = gumbel_accept(drafts, target_p.log()[None].expand(SAMPLES, -1, -1), torch.full((SAMPLES,), k), noise)
    return target_p, draft_p, drafts, result


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("scheme", ["rejection", "gumbel"])
def test_output_distribution_matches_target(k, params, scheme):
    target_p, draft_p, _, result = (run_sampler if scheme == "rejection" else run_gumbel)(k, params)
    out = result.output_token_ids
    for pos in range(k + 1):
        reached = result.num_accepted >= pos  # this position was emitted (accepted, recovered or bonus)
        tokens = out[reached, pos]
        assert (tokens >= 0).all()
        assert len(tokens) >= 1000, "too few samples reach this position for the check to mean anything"
        got = empirical(tokens)
        bound = tv_bound(len(tokens))
        assert tv(got, target_p[pos]) < bound, f"position {pos}: {got} vs target {target_p[pos]}"
        if pos < k and tv(draft_p[pos], target_p[pos]) > 3 * bound:
            # the test can fail: the sampled distribution is measurably not the draft's
            assert tv(got, draft_p[pos]) > 2 * bound


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ngram_one_hot_drafts_are_lossless(k):
    target_p, _, _, result = run_sampler(k, SamplingParams(temperature=1.0), draft_is_one_hot=True)
    for pos in range(k + 1):
        reached = result.num_accepted >= pos
        got = empirical(result.output_token_ids[reached, pos])
        assert tv(got, target_p[pos]) < tv_bound(int(reached.sum()))


def test_accepting_every_draft_would_fail_the_check():
    """Power check: the raw drafts (what a sampler that accepts all would emit) are far from the target."""
    target_p, draft_p, drafts, _ = run_sampler(2, SamplingParams(temperature=1.0))
    assert tv(empirical(drafts[:, 0]), target_p[0]) > tv_bound(SAMPLES)


def test_acceptance_rate_matches_theory():
    """E[accept at position 0] = sum_x min(p(x), q(x)) (Leviathan et al., Definition 3.1)."""
    target_p, draft_p, _, result = run_sampler(1, SamplingParams(temperature=1.0))
    expected = torch.minimum(target_p[0], draft_p[0]).sum().item()
    measured = (result.num_accepted >= 1).float().mean().item()
    assert abs(measured - expected) < 0.02


def fixed_uniforms(batch, k):
    return torch.full((batch, k), 0.5), torch.full((batch, k + 1), 0.5)


def one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), vocab).float()


def test_greedy_exact_prefix_then_target_token():
    # target argmax per position: 3, 1, 4, 2 ; draft proposes 3, 1, 5 -> accept 2, recover 4
    target = one_hot([[3, 1, 4, 2]], 8)
    drafts = torch.tensor([[3, 1, 5]])
    res = rejection_sample(drafts, one_hot([[3, 1, 5]], 8), target, torch.tensor([3]), *fixed_uniforms(1, 3))
    assert res.num_accepted.tolist() == [2]
    assert res.output_token_ids.tolist() == [[3, 1, 4, -1]]


def test_all_accepted_gives_bonus_token():
    target = one_hot([[3, 1, 4, 2]], 8)
    drafts = torch.tensor([[3, 1, 4]])
    res = rejection_sample(drafts, None, target, torch.tensor([3]), *fixed_uniforms(1, 3))
    assert res.num_accepted.tolist() == [3]
    assert res.output_token_ids.tolist() == [[3, 1, 4, 2]]


def test_first_draft_rejected():
    target = one_hot([[3, 1, 4, 2]], 8)
    res = rejection_sample(torch.tensor([[0, 1, 4]]), None, target, torch.tensor([3]), *fixed_uniforms(1, 3))
    assert res.num_accepted.tolist() == [0]
    assert res.output_token_ids.tolist() == [[3, -1, -1, -1]]


def test_rows_with_fewer_drafts_and_k_zero():
    target = one_hot([[3, 1, 4], [5, 6, 7]], 8)
    drafts = torch.tensor([[3, 1], [-1, -1]])
    res = rejection_sample(drafts, None, target, torch.tensor([1, 0]), *fixed_uniforms(2, 2))
    # row 0 had one draft (3, accepted) -> bonus from position 1; row 1 had none -> plain sample at position 0
    assert res.output_token_ids.tolist() == [[3, 1, -1], [5, -1, -1]]
    assert res.num_accepted.tolist() == [1, 0]


def test_shape_errors_are_clear():
    with pytest.raises(AssertionError, match=r"\[B, K\+1, V\]"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), None, torch.zeros(1, 2, 5), torch.tensor([2]),
                         *fixed_uniforms(1, 2))


def test_greedy_accept_is_the_one_hot_limit_of_rejection_sample():
    from engine.spec.rejection import greedy_accept

    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        target = torch.randint(0, 4, (k + 1,), generator=gen).tolist()
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        tokens, accepted = greedy_accept(drafts, target)
        res = rejection_sample(torch.tensor([drafts], dtype=torch.long).view(1, k), one_hot([drafts], 4).view(1, k, 4),
                               one_hot([target], 4), torch.tensor([k]), *fixed_uniforms(1, k))
        assert tokens == res.tokens(0) and accepted == int(res.num_accepted[0])


def test_gumbel_output_is_the_targets_choice_whatever_the_drafts():
    """Drafter invariance at the sampler: the emitted tokens are argmax(log p + G) at each position reached, for
    drafts from the draft model, random drafts, or none."""
    k = 3
    target_p, draft_p, drafts, result = run_gumbel(k, SamplingParams(temperature=1.0))
    seeds, positions = counters(SAMPLES, k, 0)
    choice = (target_p.log()[None] + gumbel(seeds, positions, VOCAB)).argmax(dim=-1)  # [N, K+1]
    random_drafts = torch.randint(0, VOCAB, (SAMPLES, k), generator=torch.Generator().manual_seed(3))
    noise = gumbel(seeds, positions, VOCAB)
    for ids in (drafts, random_drafts):
        res = gumbel_accept(ids, target_p.log()[None].expand(SAMPLES, -1, -1), torch.full((SAMPLES,), k), noise)
        for pos in range(k + 1):
            reached = res.num_accepted >= pos
            assert torch.equal(res.output_token_ids[reached, pos], choice[reached, pos])
    plain = gumbel_accept(torch.empty(SAMPLES, 0, dtype=torch.long), target_p.log()[None, :1].expand(SAMPLES, -1, -1),
                          torch.zeros(SAMPLES, dtype=torch.long), noise[:, :1])
    assert torch.equal(plain.output_token_ids[:, 0], choice[:, 0]), "K = 0 emits the same first token"


def test_gumbel_acceptance_lies_between_the_coupling_bound_and_rejection_samplings():
    """P(accept at position 0) >= (1 - TV) / (1 + TV) (Daliri et al. 2024, Thm. 2) and <= 1 - TV (the best any
    coupling can do, which the rejection sampler attains)."""
    target_p, draft_p, _, result = run_gumbel(1, SamplingParams(temperature=1.0))
    distance = tv(target_p[0], draft_p[0])
    measured = (result.num_accepted >= 1).float().mean().item()
    assert (1 - distance) / (1 + distance) - 0.02 < measured < 1 - distance + 0.02
    _, _, _, standard = run_sampler(1, SamplingParams(temperature=1.0))
    assert measured < (standard.num_accepted >= 1).float().mean().item(), "rejection sampling accepts more"
