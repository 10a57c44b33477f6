"""Accept and commit: what one round emits for each row, from the target's verify logits, and its commit.

`verify_rows` is the accept step, run where the target's logits are (the target worker's device, rank 0 under
tensor parallelism: deployments/workers/draft.py; the in-process engine, engine/speculative.py): it takes a row's
drafts, the compact proposal its drafts were sampled from (unseeded sampled rows), its seed and the absolute position of
its first scored token, and answers the tokens to emit, the number of drafts accepted and, where asked, logprobs. So
only tokens travel back to whoever commits them (the router commits with `commit`, never holding a probability tensor).
Leviathan et al. 2022 (arXiv 2211.17192), Algorithm 1: a row keeps its drafts up to the first rejection and adds one
recovered token there, or one bonus token when every draft was accepted. By row:

- Greedy (temperature 0): argmax matching (`rejection.greedy_accept`), no noise, no probabilities.
- Seeded sampled (the request brought a seed): Gumbel coupling (`rejection.gumbel_accept`): each position's token
  is argmax(log p + G(seed, position)), whatever was drafted, so the text is the same for any K, draft, batch or
  replica, and the same as plain decoding with that seed.
- Unseeded sampled (a seed drawn at admission): the standard rejection sampler (`rejection.rejection_sample`) with
  counter uniforms (seed, position, ACCEPT / RESIDUAL) against the draft's compact proposal (engine/spec/proposal.py),
  or a one-hot draft (n-gram lookup) when there is none. Its acceptance is the higher of the two.

Logits processors (penalties, logit_bias, min_tokens, a grammar: engine/request/logits_processing.py) run first, on
every scored position with its own history (the committed tokens plus the drafts before it), for every scheme: the
greedy argmax, the Gumbel choice and the ratio test all see the processed distribution plain decoding would use.

Structured outputs: a row's grammar mask (`RowVerify.allowed`, engine/request/grammar.py) sets the tokens it does not
allow to -inf at each position (`apply_grammar_masks`), before the logits processors (it commutes with them: -inf
stays -inf) and everything above; greedy rows' raw logprobs are grammar-masked, as vLLM's are.

Logprobs (a request's `logprobs = n`): each emitted token's log-probability and the top n, from the distribution
the sampler drew from (temperature, top-k, top-p applied); greedy rows, whose processed distribution is one-hot,
report the model's own log-softmax instead (what vLLM returns by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.request.logits_processing import RowProcessing, process_logits
from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from engine.request.sequence import RequestOutput, SequenceState
from engine.spec.policy import AcceptanceTracker
from engine.spec.proposal import CompactProposal, RowScheme, dense
from engine.spec.randomness import ACCEPT, RESIDUAL, gumbel, inverse_cdf, seeds_tensor, uniforms
from engine.spec.rejection import RejectionResult, greedy_accept, gumbel_accept, rejection_sample
from engine.spec.stats import SpecStats
from engine.spec.tree import DraftTree, walk


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability and the `logprobs` most likely tokens at its position."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Verdict:
    """One row's outcome: vLLM's accepted tokens, then one recovered or bonus token."""

    tokens: list[int]  # the accepted drafts, then the recovered or bonus token
    num_accepted: int  # drafts accepted (0..K_b)
    logprobs: list[TokenLogprob] | None = None  # per emitted token, only when the request asked
    path: tuple[int, ...] | None = None  # a tree row's accepted draft nodes (engine/spec/tree.py); None: a chain
    depth: int | None = None  # a tree row's longest path: the drafts its round counts as (acceptance, statistics)


@dataclass(frozen=True)
class RowVerify:
    """What the accept step needs of one row besides its logits."""

    params: SamplingParams
    scheme: RowScheme  # seed, coupled, and the absolute position of the row's first scored token
    drafts: Sequence[int]  # K_b draft tokens (empty: plain decoding)
    proposal: CompactProposal | None = None  # unseeded sampled model drafts; None: one-hot (n-gram) or not needed
    processing: RowProcessing | None = None  # the row's logits processors and committed tokens; None: none
    # [>= 1, V] bool: the tokens the row's grammar allows at each scored position, row j after drafts[:j]
    # (engine/request/grammar.GrammarMatcher.masks); None: no grammar
    allowed: torch.Tensor | None = None
    # the drafts as a tree (engine/spec/tree.py): `drafts` are its tokens in node order; None: a chain. Tree rows
    # carry no logits processors and no grammar (their history differs per node: the planner keeps them chains)
    tree: DraftTree | None = None

    def __post_init__(self) -> None:
        if self.tree is not None:
            assert list(self.drafts) == list(self.tree.tokens), "a tree row's drafts are its tree's tokens"
            assert self.allowed is None and (self.processing is None or not self.processing.processors), \
                "tree rows carry no grammar and no logits processors"


def verify_rows(
    logits: torch.Tensor,  # [B, T, V] the target's verify logits; row b's first len(drafts) + 1 positions are real
    rows: Sequence[RowVerify],  # B rows
) -> list[Verdict]:
    """Each row's verdict, computed on logits' device; only token ids (and asked logprobs) leave it."""
    assert logits.dim() == 3 and logits.shape[0] == len(rows), "logits must be [B, T, V]"
    assert all(logits.shape[1] >= len(r.drafts) + 1 for r in rows), "a row has more drafts than scored positions"
    trees = [b for b, r in enumerate(rows) if r.tree is not None]
    if trees:  # tree rows: the target's choice at every node, then the walk (engine/spec/tree.py)
        chains = [b for b, r in enumerate(rows) if r.tree is None]
        out: list[Verdict | None] = [None] * len(rows)
        for b, verdict in zip(trees, tree_verdicts(logits[trees], [rows[b] for b in trees])):
            out[b] = verdict
        if chains:
            for b, verdict in zip(chains, verify_rows(logits[chains], [rows[b] for b in chains])):
                out[b] = verdict
        return out
    logits = apply_grammar_masks(logits, rows)
    raw = logits  # greedy rows' logprobs are the model's own (vLLM's default raw logprobs), grammar-masked as vLLM's
    logits = process_logits(logits, [r.processing for r in rows], [r.drafts for r in rows])  # per position
    results: dict[int, RejectionResult | tuple[list[int], int]] = {}
    processed: dict[int, torch.Tensor] = {}  # sampled row -> [T, V] its processed distribution (for logprobs)
    greedy = [b for b, r in enumerate(rows) if r.params.greedy]
    if greedy:
        ids = logits[greedy].argmax(dim=-1).tolist()
        for i, b in enumerate(greedy):
            results[b] = greedy_accept(list(rows[b].drafts), ids[i][: len(rows[b].drafts) + 1])
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = logits_to_probs(logits[sampled], BatchSampling.from_params([rows[b].params for b in sampled]))
        for i, b in enumerate(sampled):
            processed[b] = probs[i]
        for coupled in (True, False):
            group = [i for i, b in enumerate(sampled) if rows[b].scheme.coupled is coupled]
            if group:
                result = _sample_group(probs[group], [rows[sampled[i]] for i in group], coupled)
                for j, i in enumerate(group):
                    results[sampled[i]] = (result.tokens(j), int(result.num_accepted[j]))
    verdicts = []
    for b, row in enumerate(rows):
        tokens, accepted = results[b]
        logprobs = None
        if row.params.logprobs is not None:
            dist = processed[b].log() if b in processed else raw[b].float().log_softmax(dim=-1)
            logprobs = token_logprobs(dist[: len(tokens)], tokens, row.params.logprobs)
        verdicts.append(Verdict(tokens, accepted, logprobs))
    return verdicts


def tree_verdicts(
    logits: torch.Tensor,  # [B, T, V] the target's verify logits; row b's first tree.width positions are its nodes
    rows: Sequence[RowVerify],  # B tree rows
) -> list[Verdict]:
    """Tree rows' verdicts: the token the target emits at every node, drawn as plain decoding draws at that node's
    absolute position (greedy: argmax; seeded: the Gumbel-coupled sample; unseeded: the inverse-CDF draw from the
    RESIDUAL uniform, which is plain decoding's bonus draw), then the walk down the children holding those tokens
    (engine/spec/tree.py says why this keeps the target's distribution and plain decoding's text)."""
    device, vocab = logits.device, logits.shape[-1]
    verdicts = []
    for b, row in enumerate(rows):
        tree = row.tree
        width = tree.width
        positions = (row.scheme.position + torch.tensor(tree.depths, device=device))[None, :]  # [1, N + 1]
        dist = None
        if row.params.greedy:
            choices = logits[b, :width].argmax(dim=-1)
        else:
            probs = logits_to_probs(logits[b : b + 1, :width], BatchSampling.from_params([row.params]))  # [1, N+1, V]
            dist = probs[0].log()
            seeds = seeds_tensor([row.scheme.seed], device)
            if row.scheme.coupled:
                choices = (dist + gumbel(seeds, positions, vocab)[0]).argmax(dim=-1)
            else:
                choices = inverse_cdf(probs[0], uniforms(seeds, positions, RESIDUAL)[0])
        done = walk(tree, choices.tolist())
        logprobs = None
        if row.params.logprobs is not None:
            at = [0, *done.path]  # the node each emitted token was chosen at
            if dist is None:
                dist = logits[b, :width].float().log_softmax(dim=-1)
            logprobs = token_logprobs(dist[at], done.tokens, row.params.logprobs)
        verdicts.append(Verdict(done.tokens, done.num_accepted, logprobs, tuple(done.path), tree.depth))
    return verdicts


def apply_grammar_masks(
    logits: torch.Tensor,  # [B, T, V]
    rows: Sequence[RowVerify],  # B rows
) -> torch.Tensor:  # [B, T, V]: `logits` itself when no row has a grammar, else a copy
    """Structured outputs' hook: the tokens a row's grammar does not allow get -inf at each position, before any
    other processing (engine/request/grammar.py), so every scheme below samples from the constrained target distribution
    and a draft outside the grammar is rejected."""
    if all(r.allowed is None for r in rows):
        return logits
    logits = logits.clone()
    for b, row in enumerate(rows):
        if row.allowed is not None:
            width = min(row.allowed.shape[0], logits.shape[1])
            logits[b, :width].masked_fill_(~row.allowed[:width].to(logits.device), float("-inf"))
    return logits


def _sample_group(
    probs: torch.Tensor,  # [S, T, V] processed target distributions of rows sharing a scheme
    rows: Sequence[RowVerify],  # S rows
    coupled: bool,
) -> RejectionResult:
    device = probs.device
    k_max = max(len(r.drafts) for r in rows)
    draft_ids = torch.full((len(rows), k_max), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        draft_ids[i, : len(r.drafts)] = torch.tensor(list(r.drafts), dtype=torch.long)
    num_draft = torch.tensor([len(r.drafts) for r in rows], dtype=torch.long)
    seeds = seeds_tensor([r.scheme.seed for r in rows], device)
    # [S, K+1]: the absolute position of each scored token
    positions = torch.tensor([r.scheme.position for r in rows], device=device)[:, None] + torch.arange(
        k_max + 1, device=device)
    target = probs[:, : k_max + 1]
    if coupled:
        return gumbel_accept(draft_ids, target.log(), num_draft, gumbel(seeds, positions, probs.shape[-1]))
    draft_probs = None
    if any(r.proposal is not None for r in rows):
        assert all(r.proposal is not None or not r.drafts for r in rows), "model drafts need their proposal"
        draft_probs = dense([r.proposal for r in rows], k_max, probs.shape[-1], device)
    return rejection_sample(draft_ids, draft_probs, target, num_draft,
                            uniforms(seeds, positions[:, :k_max], ACCEPT), uniforms(seeds, positions, RESIDUAL))


LOGPROB_FLOOR = -9999.0  # vLLM's floor for log 0 in its responses


def token_logprobs(
    logprobs: torch.Tensor,  # [n, V] log-probabilities at the emitted positions
    tokens: Sequence[int],  # n emitted tokens
    top: int,
) -> list[TokenLogprob]:
    """The emitted tokens' log-probabilities and the top `top` of each position, as plain Python numbers. A token of
    probability 0 (outside a grammar or top-k) reports LOGPROB_FLOOR, as vLLM's API does: JSON has no -inf."""
    logprobs = logprobs.clamp(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(-1, torch.tensor(list(tokens), device=logprobs.device)[:, None]).squeeze(-1).tolist()
    if top <= 0:
        return [TokenLogprob(lp, ()) for lp in chosen]
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def commit(seq: SequenceState, num_draft: int, verdict: Verdict, stats: SpecStats,
           trackers: Sequence[AcceptanceTracker] = ()) -> RequestOutput:
    """Append a row's verdict to its sequence (cut at EOS, max_tokens, the window and stop strings) and record the
    round: in the sequence's own statistics, the round's `stats`, and each acceptance tracker (the request's own
    and the population's, engine/spec/policy.py)."""
    tree = verdict.depth is not None
    if tree:  # a tree round counts as a chain as deep as the tree
        num_draft = verdict.depth
    for tracker in trackers:
        tracker.record(num_draft, verdict.num_accepted)
    out = seq.commit(verdict.tokens, num_draft, verdict.num_accepted, verdict.logprobs)
    stats.record(num_draft, verdict.num_accepted, len(out.new_token_ids))
    stats.tree_rounds += tree
    return out
