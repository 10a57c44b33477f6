"""How a draft model picks its tokens, and the compact proposal it ships for unseeded sampled rows.

Per row and draft step, by the row's scheme (the same scheme the target's accept step applies, engine/spec/accept.py):
- greedy (temperature 0): the argmax of the draft's logits; nothing but the token travels.
- seeded (Gumbel coupling, engine/spec/rejection.gumbel_accept): argmax(log q + G(seed, position)) with the noise the
  target will use at that position; nothing but the token travels.
- unseeded sampled: the draft samples from q~, its processed distribution q kept exactly on its top `TOP_N`
  tokens, with the rest of q's mass spread evenly over all the other tokens (a uniform tail), by inverse CDF from
  the counter uniform (seed, position, DRAFT) and, in the tail, a second counter hash (DRAFT_TAIL). The rejection
  sampler is exact for any proposal the draft really sampled from (Leviathan et al. 2022, Appendix A.1), so q~ is
  what the target tests against. It travels as ([K, N] int32 token ids, [K, N] float32 probabilities); the tail's
  mass is 1 minus their sum, so nothing more is needed: 1 KiB per draft token at N = 128, where the full
  distribution of a 128k vocabulary is 512 KiB. Where q is peaked (a trained model) q~ is q up to a sliver; where
  it is flat (a random-weight model) the uniform tail keeps q~ close to q, where a renormalised top-N alone lost
  most of the acceptance (bench/RESULTS.md). vLLM and SGLang ship full distributions between co-located
  processes; across pods the compact form is what fits a round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.spec.randomness import DRAFT, DRAFT_TAIL, gumbel, hash32, inverse_cdf, seeds_tensor, uniforms

TOP_N = 128  # tokens kept in an unseeded sampled row's proposal (fewer when the vocabulary is smaller)


@dataclass(frozen=True)
class RowScheme:
    """What a sampler needs to know of a row besides its distribution."""

    greedy: bool
    coupled: bool  # the request brought its own seed: Gumbel coupling (drafter-invariant output)
    seed: int  # the request's seed, or the one drawn for it at admission
    position: int  # the absolute position of the row's first token in this call


@dataclass(frozen=True)
class CompactProposal:
    """The truncated proposal q~ one row's drafts were sampled from."""

    token_ids: torch.Tensor  # [K, N] int32
    probs: torch.Tensor  # [K, N] float32, q at those tokens; 1 - a row's sum is spread evenly over the others

    def __post_init__(self) -> None:
        assert self.token_ids.shape == self.probs.shape and self.token_ids.dim() == 2, "ids and probs: [K, N]"

    def head(self, k: int) -> "CompactProposal":
        return CompactProposal(self.token_ids[:k], self.probs[:k])

    def tail(self, start: int) -> "CompactProposal":
        return CompactProposal(self.token_ids[start:], self.probs[start:])


def dense(
    proposals: Sequence[CompactProposal | None],  # B rows, each [>= K_b, N] (None: the row has no drafts)
    k_max: int,
    vocab: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, K, V] float32 on `device`, zero past each row's proposal
    """The compact proposals q~ expanded back to [B, K, V] on the sampler's device (never on the wire): the top-N
    probabilities where they are, the tail's mass evenly over every other token."""
    out = torch.zeros(len(proposals), k_max, vocab, device=device)
    for b, prop in enumerate(proposals):
        if prop is None or k_max == 0:
            continue
        n = min(k_max, prop.token_ids.shape[0])
        probs = prop.probs[:n].to(device).float()
        rest = vocab - probs.shape[-1]
        if rest > 0:
            out[b, :n] = ((1.0 - probs.sum(dim=-1)).clamp(min=0.0) / rest)[:, None]
        out[b, :n].scatter_(-1, prop.token_ids[:n].to(device).long(), probs)
    return out


def choose_draft_tokens(
    probs: torch.Tensor,  # [A, V] float32: one draft step's processed distributions (engine/request/sampling.py)
    schemes: Sequence[RowScheme],  # A rows, each at the position of this step's token
    top_n: int = TOP_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [A] int64, top ids [A, N] int32, top probs [A, N]
    """One draft step's tokens by each row's scheme, and the compact proposals (meaningful for unseeded sampled
    rows only; zero elsewhere). Runs on probs' device."""
    rows, vocab = probs.shape
    assert len(schemes) == rows
    n = min(top_n, vocab)
    device = probs.device
    tokens = probs.argmax(dim=-1)
    top_ids = torch.zeros(rows, n, dtype=torch.int32, device=device)
    top_probs = torch.zeros(rows, n, device=device)
    coupled = [a for a, s in enumerate(schemes) if not s.greedy and s.coupled]
    if coupled:
        at, seeds, positions = _rows_on(coupled, schemes, device)
        noisy = probs[at].log() + gumbel(seeds, positions, vocab)[:, 0]
        tokens[at] = noisy.argmax(dim=-1)
    sampled = [a for a, s in enumerate(schemes) if not s.greedy and not s.coupled]
    if sampled:
        at, seeds, positions = _rows_on(sampled, schemes, device)
        values, ids = probs[at].topk(n, dim=-1)  # [S, N], descending: q itself there
        tokens[at] = _sample_proposal(values, ids, vocab, seeds, positions)
        top_ids[at] = ids.int()
        top_probs[at] = values
    return tokens, top_ids, top_probs


def _rows_on(rows: list[int], schemes: Sequence[RowScheme], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # rows [R], seeds [R], positions [R, 1]
    """Rows of one scheme, their seeds and positions as device tensors, copied from host memory behind the stream's
    work (a blocking copy would wait for the step that made the probabilities)."""
    host = (torch.tensor(rows), seeds_tensor([schemes[a].seed for a in rows]),
            torch.tensor([[schemes[a].position] for a in rows]))
    return tuple(t.to(device, non_blocking=True) for t in host)


def _sample_proposal(
    values: torch.Tensor,  # [S, N] q at the top-N tokens
    ids: torch.Tensor,  # [S, N] int64 those tokens
    vocab: int,
    seeds: torch.Tensor,  # [S] int64
    positions: torch.Tensor,  # [S, 1] int64
) -> torch.Tensor:  # [S] int64
    """One draw from q~ per row: inverse CDF over the top-N and the tail's mass; a tail draw is then a uniform
    token among the V - N others (the DRAFT_TAIL hash modulo their count: a bias below V / 2^32, 3e-5 at 128k)."""
    rest = vocab - values.shape[-1]
    tail = (1.0 - values.sum(dim=-1)).clamp(min=0.0) if rest > 0 else torch.zeros_like(values[:, 0])
    pick = inverse_cdf(torch.cat([values, tail[:, None]], dim=-1), uniforms(seeds, positions, DRAFT)[:, 0])
    in_tail = pick == values.shape[-1]
    tokens = ids.gather(-1, pick.clamp(max=values.shape[-1] - 1)[:, None]).squeeze(-1)
    if bool(in_tail.any()):
        rows = in_tail.nonzero().squeeze(-1)
        nth = hash32(seeds[rows], positions[rows, 0], DRAFT_TAIL) % rest  # [T]: the nth token outside the top-N
        outside = torch.ones(len(rows), vocab, dtype=torch.long, device=values.device)
        outside.scatter_(-1, ids[rows], 0)
        tokens[rows] = torch.searchsorted(outside.cumsum(dim=-1), (nth + 1)[:, None]).squeeze(-1)
    return tokens
