"""What every draft proposer shares: the request it drafts for, the proposal it returns, and the Protocol.

A new proposer (EAGLE heads, say) implements `Proposer` in its own module here and is built by engine/factory.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request.grammar import GrammarSpec
from engine.request.logits_processing import RowProcessing
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState
from engine.request.settings import SequenceSettings
from engine.spec.proposal import CompactProposal, RowScheme
from engine.spec.tree import DraftTree


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    tokens: Sequence[int]  # the committed tokens: prompt + output so far (the first draft's position is len(tokens))
    k: int  # how many tokens to propose (>= 1)
    settings: SequenceSettings  # sampling parameters, seed, grammar, prompt length (engine/request/settings.py)
    # the request's logits processors (engine/request/logits_processing.py), applied at each draft step with the tokens
    # drafted so far: the draft's distribution is processed as the target's is at that position
    processing: RowProcessing | None = None
    tree: int = 0  # drafts as a tree of at most this many nodes, at most k deep (engine/spec/tree.py); 0: a chain

    @classmethod
    def of(cls, seq: SequenceState, k: int, tree: int = 0) -> DraftRequest:
        """A live sequence's request for `k` drafts (the in-process engine's and the router's own proposer's)."""
        return cls(seq.request_id, seq.tokens, k, seq.settings, seq.processing(), tree)

    @property
    def sampling(self) -> SamplingParams:
        return self.settings.params

    @property
    def seed(self) -> int:  # the request's seed (its own or drawn at admission): engine/spec/randomness.py
        return self.settings.seed

    @property
    def coupled(self) -> bool:  # the request brought its seed: Gumbel-coupled drafts (engine/spec/proposal.py)
        return self.settings.coupled

    @property
    def grammar(self) -> GrammarSpec | None:  # structured outputs: the draft masks its proposals (engine/request/grammar.py)
        return self.settings.params.grammar

    @property
    def output_start(self) -> int:  # where the output begins in `tokens` (the grammar covers the output only)
        return self.settings.prompt_len

    def scheme(self, step: int) -> RowScheme:
        return self.settings.scheme(len(self.tokens) + step)

    @property
    def ships_proposal(self) -> bool:
        """Unseeded sampled rows send the proposal their drafts were drawn from; the others only tokens."""
        return not self.sampling.greedy and not self.coupled


@dataclass(frozen=True)
class Proposal:
    token_ids: torch.Tensor  # [B, K] int64, -1 past num_tokens[b]
    num_tokens: torch.Tensor  # [B] int64, may be below the asked k (n-gram found nothing, say)
    # rows whose request `ships_proposal`: the compact proposals their drafts were drawn from, else None
    proposals: list[CompactProposal | None] | None = None  # None: no row has one (n-gram, greedy, seeded)
    # rows that asked for a tree (DraftRequest.tree) and got one: their drafts (token_ids holds none for them)
    trees: list[DraftTree | None] | None = None

    def drafts(self, row: int) -> list[int] | DraftTree:
        """Row `row`'s drafts: its tree, or its chain of tokens."""
        if self.trees is not None and self.trees[row] is not None:
            return self.trees[row]
        return self.token_ids[row, : int(self.num_tokens[row])].tolist()

    def proposal(self, row: int) -> CompactProposal | None:
        if self.proposals is None or self.proposals[row] is None:
            return None
        return self.proposals[row].head(int(self.num_tokens[row]))


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest], stop: Callable[[], bool] | None = None) -> Proposal: ...

    def release(self, seq_id: str) -> None: ...


def draft_rows(proposer: Proposer | None, seqs: Sequence[SequenceState], ks: Sequence[int],
               trees: Sequence[int] | None = None,  # per row a tree's node budget (0: a chain)
               ) -> tuple[list[list[int] | DraftTree], list[CompactProposal | None]]:  # drafts, compact proposals
    """Drafts from a proposer at hand (the in-process engine's, or n-gram lookup in the router) for the rows with
    k > 0 (a tree where `trees` asks and the proposer makes one), and the compact proposals they were drawn from
    (unseeded sampled model drafts; None for the others: one-hot n-gram drafts, trees, greedy and seeded rows)."""
    drafts: list[list[int] | DraftTree] = [[] for _ in seqs]
    proposals: list[CompactProposal | None] = [None for _ in seqs]
    asked = [b for b, k in enumerate(ks) if k > 0]
    if not asked or proposer is None:
        return drafts, proposals
    proposal = proposer.propose([DraftRequest.of(seqs[b], ks[b], trees[b] if trees else 0) for b in asked])
    for i, b in enumerate(asked):
        drafts[b] = proposal.drafts(i)
        proposals[b] = None if isinstance(drafts[b], DraftTree) else proposal.proposal(i)
    return drafts, proposals


class IncompatibleDraftError(ValueError):
    """The draft model cannot speculate for this target (different tokenizer)."""


def check_tokenizers_compatible(target_tokenizer, draft_tokenizer) -> None:
    """Refuse drafts whose token ids mean something else; vocabularies may differ only in padding rows."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    shared = min(len(target_vocab), len(draft_vocab))
    target_by_id = {i: t for t, i in target_vocab.items() if i < shared}
    draft_by_id = {i: t for t, i in draft_vocab.items() if i < shared}
    mismatched = [i for i, tok in target_by_id.items() if draft_by_id.get(i) != tok]
    if mismatched or target_tokenizer.eos_token_id != draft_tokenizer.eos_token_id:
        example = mismatched[0] if mismatched else target_tokenizer.eos_token_id
        raise IncompatibleDraftError(
            "draft and target tokenizers differ (e.g. token id "
            f"{example}: target {target_by_id.get(example)!r} vs draft {draft_by_id.get(example)!r}); "
            "speculative decoding needs a draft that shares the target's tokenizer"
        )
