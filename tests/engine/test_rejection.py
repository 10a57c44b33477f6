"""The rejection sampler: lossless for every sampling setting, exact for greedy, vLLM's accepted/recovered/bonus."""

import math

import pytest
import torch

from engine.rejection import rejection_sample
from engine.sampling import BatchSampling, SamplingParams, logits_to_probs

VOCAB = 6
SAMPLES = 20_000


def tv_bound(n: int, vocab: int = VOCAB) -> float:
    # E[TV] of an n-sample empirical distribution is at most 0.5 * sqrt(2 V / (pi n)); allow 4x that
    return 4 * 0.5 * math.sqrt(2 * vocab / (math.pi * n))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def empirical(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


def run_sampler(k: int, params: SamplingParams, seed: int = 0, draft_is_one_hot: bool = False):
    """Known per-position target/draft logits; drafts sampled from the processed draft distribution."""
    gen = torch.Generator().manual_seed(1234 + k)
    target_logits = torch.randn(1, k + 1, VOCAB, generator=gen) * 1.5
    # correlated with the target (so later positions are reached often) but clearly different
    draft_logits = target_logits[:, :k] + torch.randn(1, k, VOCAB, generator=gen) * 1.2
    rows = BatchSampling.from_params([params])
    target_p = logits_to_probs(target_logits, rows)[0]  # [K+1, V]
    draft_p = logits_to_probs(draft_logits, rows)[0]  # [K, V]
    sample_gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(draft_p[i], SAMPLES, replacement=True, generator=sample_gen)
                          for i in range(k)], dim=1)  # [N, K]
    if draft_is_one_hot:
        draft_probs = None
    else:
        draft_probs = draft_p[None].expand(SAMPLES, k, VOCAB)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(SAMPLES)]
    result = rejection_sample(
        drafts, draft_probs, target_p[None].expand(SAMPLES, k + 1, VOCAB),
        torch.full((SAMPLES,), k), generators,
    )
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
def test_output_distribution_matches_target(k, params):
    target_p, draft_p, _, result = run_sampler(k, params)
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


def one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), vocab).float()


def test_greedy_exact_prefix_then_target_token():
    # target argmax per position: 3, 1, 4, 2 ; draft proposes 3, 1, 5 -> accept 2, recover 4
    target = one_hot([[3, 1, 4, 2]], 8)
    drafts = torch.tensor([[3, 1, 5]])
    gens = [torch.Generator().manual_seed(0)]
    res = rejection_sample(drafts, one_hot([[3, 1, 5]], 8), target, torch.tensor([3]), gens)
    assert res.num_accepted.tolist() == [2]
    assert res.output_token_ids.tolist() == [[3, 1, 4, -1]]


def test_all_accepted_gives_bonus_token():
    target = one_hot([[3, 1, 4, 2]], 8)
    drafts = torch.tensor([[3, 1, 4]])
    res = rejection_sample(drafts, None, target, torch.tensor([3]), [torch.Generator().manual_seed(0)])
    assert res.num_accepted.tolist() == [3]
    assert res.output_token_ids.tolist() == [[3, 1, 4, 2]]


def test_first_draft_rejected():
    target = one_hot([[3, 1, 4, 2]], 8)
    res = rejection_sample(torch.tensor([[0, 1, 4]]), None, target, torch.tensor([3]),
                           [torch.Generator().manual_seed(0)])
    assert res.num_accepted.tolist() == [0]
    assert res.output_token_ids.tolist() == [[3, -1, -1, -1]]


def test_rows_with_fewer_drafts_and_k_zero():
    target = one_hot([[3, 1, 4], [5, 6, 7]], 8)
    drafts = torch.tensor([[3, 1], [-1, -1]])
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    res = rejection_sample(drafts, None, target, torch.tensor([1, 0]), gens)
    # row 0 had one draft (3, accepted) -> bonus from position 1; row 1 had none -> plain sample at position 0
    assert res.output_token_ids.tolist() == [[3, 1, -1], [5, -1, -1]]
    assert res.num_accepted.tolist() == [1, 0]


def test_shape_errors_are_clear():
    with pytest.raises(AssertionError, match=r"\[B, K\+1, V\]"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), None, torch.zeros(1, 2, 5), torch.tensor([2]),
                         [torch.Generator()])


def test_greedy_accept_is_the_one_hot_limit_of_rejection_sample():
    from engine.rejection import greedy_accept

    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        target = torch.randint(0, 4, (k + 1,), generator=gen).tolist()
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        tokens, accepted = greedy_accept(drafts, target)
        res = rejection_sample(torch.tensor([drafts], dtype=torch.long).view(1, k), one_hot([drafts], 4).view(1, k, 4),
                               one_hot([target], 4), torch.tensor([k]), [torch.Generator().manual_seed(0)])
        assert tokens == res.tokens(0) and accepted == int(res.num_accepted[0])
