"""The speculative rejection sampler: one pure function over a batch.

Leviathan et al. 2022 (arXiv 2211.17192), Algorithm 1, and Chen et al. 2023 (arXiv 2302.01318), Algorithm 2:
draft token x_i drawn from the draft distribution q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
where p_i is the target distribution; at the first rejection a *recovered* token is drawn from
norm(max(0, p_i - q_i)); when all drafts are accepted a *bonus* token is drawn from p_{K+1}. The emitted tokens
are distributed exactly as the target's. Words follow vLLM: accepted, recovered, bonus.

A draft without probabilities (n-gram lookup) is a one-hot q: accept with probability p_i(x_i), recover from
p_i with x_i removed. Greedy requests arrive here as one-hot p and q, which makes the rule exact argmax matching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from


@dataclass(frozen=True)
class RejectionResult:
    output_token_ids: torch.Tensor  # [B, K+1] int64, accepted tokens then one recovered/bonus token, -1 padded
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row (0..num_draft_tokens[b])

    @property
    def num_emitted(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1

    def tokens(self, row: int) -> list[int]:
        return self.output_token_ids[row, : int(self.num_accepted[row]) + 1].tolist()


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64; entries past num_draft_tokens[b] are ignored
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None for one-hot (n-gram) drafts
    target_probs: torch.Tensor,  # [B, K+1, V] float32, position i scores draft i; K+1 is the bonus position
    num_draft_tokens: torch.Tensor,  # [B] int64, how many drafts row b really has (0..K)
    generators: list[torch.Generator],  # B generators, one per request
) -> RejectionResult:
    batch, k_max = draft_token_ids.shape
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (batch, k_max + 1), (
        f"target_probs must be [B, K+1, V] = [{batch}, {k_max + 1}, V], got {tuple(target_probs.shape)}"
    )
    vocab = target_probs.shape[-1]
    assert draft_probs is None or draft_probs.shape == (batch, k_max, vocab), "draft_probs must be [B, K, V]"
    assert num_draft_tokens.shape == (batch,) and len(generators) == batch
    device = generators[0].device if generators else target_probs.device
    target_probs = target_probs.to(device)
    draft_probs = None if draft_probs is None else draft_probs.to(device)
    draft_ids = draft_token_ids.to(device)
    num_draft = num_draft_tokens.to(device)

    positions = torch.arange(k_max, device=device)
    valid = positions[None, :] < num_draft[:, None]  # [B, K]
    safe_ids = draft_ids.clamp(min=0)
    p_at_draft = target_probs[:, :k_max].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        q_at_draft = torch.ones_like(p_at_draft)
    else:
        q_at_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)
    uniforms = torch.stack([torch.rand(k_max, generator=g, device=device) for g in generators]) if k_max else (
        torch.empty(batch, 0, device=device)
    )
    # accept iff u < p/q, written as u * q < p to avoid dividing by q (q > 0 for any token the draft produced)
    accepted = (uniforms * q_at_draft < p_at_draft) & valid
    # number of leading accepted positions per row
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1).long()  # [B]

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
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final_dist[rows])
        final_dist = final_dist.clone()
        final_dist[rows] = residual
    # [B] recovered token where rejected, bonus token where all drafts accepted; a one-hot (greedy) row is its argmax
    one_hot = final_dist.amax(dim=-1) >= 1.0
    last = sample_from(final_dist, generators, one_hot)

    out = torch.full((batch, k_max + 1), -1, dtype=torch.long, device=device)
    keep = positions[None, :] < num_accepted[:, None]
    out[:, :k_max] = torch.where(keep, draft_ids, torch.full_like(draft_ids, -1))
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted)


def greedy_accept(
    draft_token_ids: list[int],  # [K] the row's drafts
    target_argmax: list[int],  # [K+1] the target's argmax at each draft position and the bonus position
) -> tuple[list[int], int]:
    """`rejection_sample` for one greedy row without building one-hot [K+1, V] tensors.

    With one-hot p and q the ratio test accepts exactly the drafts equal to the target's argmax, and the recovered
    (or bonus) token is the target's argmax at the first mismatch; tests/engine/test_rejection.py checks the two
    agree. Returns (emitted tokens, number of accepted drafts).
    """
    assert len(target_argmax) == len(draft_token_ids) + 1
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_argmax[accepted]:
        accepted += 1
    return list(draft_token_ids[:accepted]) + [target_argmax[accepted]], accepted
