"""The speculative samplers: pure batched functions over one round's rows, fed counter-based random numbers.

Two schemes, both exact (the emitted tokens are distributed as the target's processed distribution):

- `rejection_sample`, the standard rejection sampler (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1; Chen
  et al. 2023, arXiv 2302.01318, Algorithm 2): draft token x_i drawn from the draft distribution q_i is accepted
  with probability min(1, p_i(x_i) / q_i(x_i)), p_i the target's; at the first rejection a *recovered* token is
  drawn from norm(max(0, p_i - q_i)); when all drafts are accepted a *bonus* token is drawn from p_{K+1}. The proof
  (Leviathan et al., Appendix A.1) uses only that x_i was drawn from q_i, so q_i may be any proposal the draft
  really sampled from: the draft model's distribution kept on its top N tokens with a uniform tail over the rest
  (engine/spec/proposal.py) is as exact as the full one. Words follow vLLM: accepted, recovered, bonus. A draft without
  probabilities (n-gram lookup) is a one-hot q: accept with probability p_i(x_i), recover from p_i with x_i removed.
- `gumbel_accept`, for seeded rows (Daliri, Musco, Suresh 2024, arXiv 2408.07978, "Coupling without communication
  and drafter-invariant speculative decoding"): the target's token at a position is argmax(log p + G), G the
  Gumbel noise of (seed, position) (engine/spec/randomness.py); the draft proposed argmax(log q + G) with the same
  noise; a draft is accepted iff it equals the target's choice, and the first mismatch (or the bonus position)
  emits the target's choice. The output is a function of the seed and the target alone: the same for any draft,
  K or batch, and the same as plain decoding. Its acceptance is lower than rejection sampling's (the coupling
  matches with probability >= (1 - TV) / (1 + TV) instead of 1 - TV).

The random numbers come in as tensors (uniforms, noise): the samplers hold no generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.spec.randomness import inverse_cdf


@dataclass(frozen=True)
class RejectionResult:
    output_token_ids: torch.Tensor  # [B, K+1] int64, accepted tokens then one recovered/bonus token, -1 padded
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row (0..num_draft_tokens[b])

    @property
    def num_emitted(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1

    def tokens(self, row: int) -> list[int]:
        return self.output_token_ids[row, : int(self.num_accepted[row]) + 1].tolist()


def _leading(accepted: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64: accepted before the first miss
    return accepted.int().cumprod(dim=-1).sum(dim=-1).long()


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: the accepted drafts, then `last` ([B]) at index num_accepted, -1 after."""
    batch, k_max = draft_ids.shape
    positions = torch.arange(k_max, device=draft_ids.device)
    out = torch.full((batch, k_max + 1), -1, dtype=torch.long, device=draft_ids.device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :k_max] = torch.where(keep, draft_ids, torch.full_like(draft_ids, -1))
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64; entries past num_draft_tokens[b] are ignored
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 (the proposal each draft was drawn from), None: one-hot
    target_probs: torch.Tensor,  # [B, K+1, V] float32, position i scores draft i; K+1 is the bonus position
    num_draft_tokens: torch.Tensor,  # [B] int64, how many drafts row b really has (0..K)
    accept_uniforms: torch.Tensor,  # [B, K] float32 in (0, 1): the accept test of each draft position
    final_uniforms: torch.Tensor,  # [B, K+1] float32 in (0, 1): each position's recovered or bonus draw
) -> RejectionResult:
    """Runs on target_probs' device; the other tensors are moved there."""
    batch, k_max = draft_token_ids.shape
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (batch, k_max + 1), (
        f"target_probs must be [B, K+1, V] = [{batch}, {k_max + 1}, V], got {tuple(target_probs.shape)}"
    )
    vocab = target_probs.shape[-1]
    assert draft_probs is None or draft_probs.shape == (batch, k_max, vocab), "draft_probs must be [B, K, V]"
    assert num_draft_tokens.shape == (batch,) and accept_uniforms.shape == (batch, k_max)
    assert final_uniforms.shape == (batch, k_max + 1)
    device = target_probs.device
    draft_probs = None if draft_probs is None else draft_probs.to(device)
    draft_ids = draft_token_ids.to(device)
    num_draft = num_draft_tokens.to(device)

    valid = torch.arange(k_max, device=device)[None, :] < num_draft[:, None]  # [B, K]
    safe_ids = draft_ids.clamp(min=0)
    p_at_draft = target_probs[:, :k_max].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_at_draft = torch.ones_like(p_at_draft)
    else:
        q_at_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)
    # accept iff u < p/q, written as u * q < p to avoid dividing by q (q > 0 for any token the draft produced)
    accepted = (accept_uniforms.to(device) * q_at_draft < p_at_draft) & valid
    num_accepted = _leading(accepted)  # [B]

    final_dist = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, vocab)).squeeze(1)  # [B, V]
    rejected = num_accepted < num_draft  # row stopped at a rejection, not at the end of its drafts
    if bool(rejected.any()):
        rows = rejected.nonzero().squeeze(-1)
        at = num_accepted[rows]
        if draft_probs is None:
            q_rej = torch.zeros(len(rows), vocab, device=device).scatter_(-1, draft_ids[rows, at][:, None], 1.0)
        else:
            q_rej = draft_probs[rows, at]
        residual = (final_dist[rows] - q_rej).clamp(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # mass == 0 only when p == q (then rejection has probability 0); keep p as the safe choice
        residual = torch.where(mass > 0, residual, final_dist[rows])
        final_dist = final_dist.clone()
        final_dist[rows] = residual
    final_u = final_uniforms.to(device).gather(1, num_accepted[:, None]).squeeze(1)  # the emitting position's
    last = inverse_cdf(final_dist, final_u)  # recovered where rejected, else the bonus token
    return RejectionResult(output_token_ids=_assemble(draft_ids, num_accepted, last), num_accepted=num_accepted)


def gumbel_accept(
    draft_token_ids: torch.Tensor,  # [B, K] int64; entries past num_draft_tokens[b] are ignored
    target_logprobs: torch.Tensor,  # [B, K+1, V] float32, log of the processed target distribution (-inf allowed)
    num_draft_tokens: torch.Tensor,  # [B] int64
    noise: torch.Tensor,  # [B, K+1, V] float32 Gumbel noise of (seed, absolute position) (randomness.gumbel)
) -> RejectionResult:
    """Seeded rows: accept the drafts equal to the target's Gumbel-max choice, then emit its choice."""
    batch, k_max = draft_token_ids.shape
    assert target_logprobs.shape[:2] == (batch, k_max + 1) and noise.shape == target_logprobs.shape, (
        "target_logprobs and noise must be [B, K+1, V]")
    device = target_logprobs.device
    draft_ids = draft_token_ids.to(device)
    num_draft = num_draft_tokens.to(device)
    choice = (target_logprobs + noise.to(device)).argmax(dim=-1)  # [B, K+1]
    valid = torch.arange(k_max, device=device)[None, :] < num_draft[:, None]
    num_accepted = _leading((draft_ids == choice[:, :k_max]) & valid)
    last = choice.gather(1, num_accepted[:, None]).squeeze(1)
    return RejectionResult(output_token_ids=_assemble(draft_ids, num_accepted, last), num_accepted=num_accepted)


def greedy_accept(
    draft_token_ids: list[int],  # [K] the row's drafts
    target_argmax: list[int],  # [K+1] the target's argmax at each draft position and the bonus position
) -> tuple[list[int], int]:
    """`rejection_sample` for one greedy row without building one-hot [K+1, V] tensors.

    With one-hot p and q the ratio test accepts exactly the drafts equal to the target's argmax, and the recovered
    (or bonus) token is the target's argmax at the first mismatch; tests/engine/spec/test_rejection.py checks the two
    agree. Returns (emitted tokens, number of accepted drafts).
    """
    assert len(target_argmax) == len(draft_token_ids) + 1
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_argmax[accepted]:
        accepted += 1
    return list(draft_token_ids[:accepted]) + [target_argmax[accepted]], accepted
