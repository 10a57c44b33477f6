"""Accept and commit: what one round emits for each row, from its drafts and the target's verify, and its commit.

The one path after the verify, for the in-process engine (engine/speculative.py) and the served round
(deployments/group_round.py) alike, so a benchmark of the one measures the other's maths. Leviathan et al. 2022
(arXiv 2211.17192), Algorithm 1, and Chen et al. 2023 (arXiv 2302.01318), Algorithm 2: a row keeps its drafts up to
the first rejection and adds one recovered token there, or one bonus token when every draft was accepted.

- Greedy rows (temperature 0) need no probabilities: with one-hot target and draft distributions the ratio test
  accepts exactly the drafts equal to the target's argmax, and the recovered or bonus token is the target's argmax
  (`rejection.greedy_accept`). The target sends only its argmax tokens for them.
- Sampled rows run the rejection sampler (`rejection.rejection_sample`) over their processed distributions, batched
  over the sampled rows only; n-gram drafts have no distribution and count as one-hot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .policy import AcceptanceTracker
from .rejection import greedy_accept, rejection_sample
from .sampling import BatchSampling, SamplingParams, logits_to_probs
from .sequence import RequestOutput, SequenceState
from .stats import SpecStats


@dataclass(frozen=True)
class TargetScores:
    """What a verify pass tells the accept step, by row: greedy rows only their argmax, sampled rows distributions."""

    argmax: dict[int, list[int]]  # greedy row -> [K_b + 1] the target's argmax at each draft position and the bonus
    probs: dict[int, torch.Tensor]  # sampled row -> [K_b + 1, V] float32 on the CPU, processed (engine/sampling.py)


@dataclass(frozen=True)
class Verdict:
    """One row's outcome: vLLM's accepted tokens, then one recovered or bonus token."""

    tokens: list[int]  # the accepted drafts, then the recovered or bonus token
    num_accepted: int  # drafts accepted (0..K_b)


def score(
    logits: torch.Tensor,  # [B, T, V] the target's logits; row b's first widths[b] positions are real
    params: Sequence[SamplingParams],  # B rows
    widths: Sequence[int],  # B: K_b + 1 scored positions per row
) -> TargetScores:
    """The verify pass's logits as the accept step needs them: argmax for greedy rows, processed distributions (the
    same temperature / top-k / top-p as the draft's) for sampled rows."""
    assert logits.dim() == 3 and logits.shape[0] == len(params) == len(widths), "logits must be [B, T, V]"
    greedy_rows = [b for b, p in enumerate(params) if p.greedy]
    sampled_rows = [b for b, p in enumerate(params) if not p.greedy]
    argmax: dict[int, list[int]] = {}
    probs: dict[int, torch.Tensor] = {}
    if greedy_rows:
        ids = logits[greedy_rows].argmax(dim=-1)
        for i, b in enumerate(greedy_rows):
            argmax[b] = ids[i, : widths[b]].tolist()
    if sampled_rows:
        processed = logits_to_probs(logits[sampled_rows], BatchSampling.from_params([params[b] for b in sampled_rows]))
        for i, b in enumerate(sampled_rows):
            probs[b] = processed[i, : widths[b]].cpu()
    return TargetScores(argmax, probs)


def accept(
    drafts: Sequence[Sequence[int]],  # B rows: row b's K_b draft tokens (empty: it verified without drafts)
    scores: TargetScores,  # every row in exactly one of scores.argmax (greedy) and scores.probs (sampled)
    draft_probs: Mapping[int, torch.Tensor] | None,  # sampled row -> [>= K_b, V]; None: one-hot (n-gram) drafts
    generators: Sequence[torch.Generator],  # B: each request's verifier stream (used by sampled rows only)
) -> list[Verdict]:
    """Each row's verdict: greedy rows by argmax matching, sampled rows by one batched `rejection_sample` call."""
    batch = len(drafts)
    assert len(generators) == batch and len(scores.argmax) + len(scores.probs) == batch, "one score per row"
    verdicts: dict[int, Verdict] = {}
    for b, argmax in scores.argmax.items():
        tokens, accepted = greedy_accept(list(drafts[b]), argmax)
        verdicts[b] = Verdict(tokens, accepted)
    sampled = sorted(scores.probs)
    if sampled:
        k_max = max(len(drafts[b]) for b in sampled)
        vocab = scores.probs[sampled[0]].shape[-1]
        draft_ids = torch.full((len(sampled), k_max), -1, dtype=torch.long)
        target_probs = torch.zeros(len(sampled), k_max + 1, vocab)  # zero past a row's K_b + 1 (never read)
        row_draft_probs = None if draft_probs is None else torch.zeros(len(sampled), k_max, vocab)
        for i, b in enumerate(sampled):
            n = len(drafts[b])
            assert scores.probs[b].shape == (n + 1, vocab), f"row {b}: target probs must be [K_b + 1, V]"
            draft_ids[i, :n] = torch.tensor(list(drafts[b]), dtype=torch.long)
            target_probs[i, : n + 1] = scores.probs[b]
            if row_draft_probs is not None and n:
                assert b in draft_probs, f"sampled row {b} has model drafts but no draft probabilities"
                row_draft_probs[i, :n] = draft_probs[b][:n]
        result = rejection_sample(draft_ids, row_draft_probs, target_probs,
                                  torch.tensor([len(drafts[b]) for b in sampled], dtype=torch.long),
                                  [generators[b] for b in sampled])
        for i, b in enumerate(sampled):
            verdicts[b] = Verdict(result.tokens(i), int(result.num_accepted[i]))
    return [verdicts[b] for b in range(batch)]


def commit(seq: SequenceState, num_draft: int, verdict: Verdict, stats: SpecStats,
           trackers: Sequence[AcceptanceTracker] = ()) -> RequestOutput:
    """Append a row's verdict to its sequence (cut at EOS, max_tokens, the window and stop strings) and record the
    round: in the sequence's own statistics, the round's `stats`, and each acceptance tracker (the request's own
    and the population's, engine/policy.py)."""
    for tracker in trackers:
        tracker.record(num_draft, verdict.num_accepted)
    out = seq.commit(verdict.tokens, num_draft, verdict.num_accepted)
    stats.record(num_draft, verdict.num_accepted, len(out.new_token_ids))
    return out
