"""The seam for draft sources that run inside the target worker, on the state its verify pass just computed (the
sources themselves live in engine/proposers/: the target's own first layers, early_exit.py; Medusa heads, medusa.py).

Such a source drafts a row's next round right after the accept step of this one (engine/spec/verify.TargetVerifier
calls it with the rows that go on), and the target keeps the drafts (`HeldDrafts`) until the row's next call, which
verifies them: a round is one call, and only tokens travel. A held draft is used only if the row's committed tokens
are exactly those it was made after (the same count, the same last token); otherwise (the router committed fewer, the
row moved to another replica, its K was 0 last round) the row verifies without drafts that round and drafts again
from that pass: a stale guess costs one round without drafts, never a different output.

Drafts are one-hot proposals (the source's argmax, like n-gram lookup's), so the accept step (engine/spec/accept.py)
keeps the target's distribution at any temperature: greedy rows compare tokens, seeded rows follow the target's
coupled sample, the others take the rejection rule with a one-hot draft distribution (accept with the target's
probability of the draft token, else resample the target's distribution without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.spec.tree import DraftTree


@dataclass(frozen=True)
class DraftFrom:
    """Where one row's next drafts start: its sequence after this round's verdict."""

    seq_id: str
    index: int  # the row's index in the verify pass (its hidden states and logits)
    position: int  # the verify window's offset of the position that predicted `last` (the drafts accepted)
    committed: int  # the row's committed tokens after the verdict; `last` is the last of them, not yet cached
    last: int  # the verdict's last token (the recovered or bonus token)
    k: int  # drafts to make (capped to the context window by the verifier)
    tree: int = 0  # a tree of at most this many nodes, at most k deep (engine/spec/tree.py); 0: a chain of k


class TargetDrafter(Protocol):
    """A draft source inside the target: drafts each row's next round from the verify pass it follows."""

    name: str  # for /stats and logs: "self:L", "medusa"
    needs_hidden: bool  # it reads the verify pass's final hidden states (the runner keeps them: keep_hidden)
    # on a tensor-parallel shard: its steps run the shard's collectives (the layers, a vocabulary-parallel embedding
    # or LM head), so every rank must draft with rank 0 (`DraftPeers`); False: rank 0 drafts alone
    collective: bool

    def draft(self, runner, rows: Sequence[DraftFrom],
              hidden: torch.Tensor | None) -> list[list[int] | DraftTree]:  # hidden [B, W, H]: the pass's final states
        """Each row's drafts: at most rows[i].k tokens, or with rows[i].tree a tree of at most that many nodes."""


class DraftPeers(Protocol):
    """Tensor parallelism: the ranks but the first, as rank 0's verifier tells them what its drafter does
    (deployments/workers/target.py sends it over the ranks' ordered channel). Only rank 0 samples, so only it knows
    the verdicts: it sends the rows its drafter drafts from, with the tokens each accepted, before a collective
    drafter's steps (the others run them with it: `TargetVerifier.draft_with_first_rank`), then the drafts it made,
    which every rank keeps (`HeldDrafts`) and takes at the row's next call by the same rule, so every rank scores the
    same drafts."""

    def drafting(self, rows: Sequence[DraftFrom], accepted: Sequence[list[int]]) -> None:
        """Before a collective drafter's steps: where each row's drafts start, and the tokens its verdict added."""

    def made(self, rows: Sequence[DraftFrom], drafts: Sequence[list[int] | DraftTree]) -> None:
        """After: the drafts rank 0 made for each row."""


@dataclass(frozen=True)
class Held:
    committed: int  # the committed tokens the drafts follow
    last: int  # the last of them
    drafts: list[int] | DraftTree


class HeldDrafts:
    """The drafts a target-side source made for each row's next round, kept until that round's call."""

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self.used = 0  # calls whose held drafts were verified
        # calls that wanted drafts and found none made after their committed tokens (a request's first round, a guess
        # the router did not commit, a K that was 0 last round): rounds without drafts
        self.missed = 0

    def keep(self, seq_id: str, committed: int, last: int, drafts: list[int] | DraftTree) -> None:
        self._held[seq_id] = Held(committed, last, drafts)

    def take(self, seq_id: str, known: Sequence[int], k: int, tree: int = 0) -> list[int] | DraftTree:
        """Drafts made after exactly the committed tokens `known` (none if they were made after others): with
        `tree`, a tree of at most that many nodes (a held chain is a tree), else a chain of at most `k` (a held
        tree's first branch)."""
        held = self._held.pop(seq_id, None)
        if held is None or held.committed != len(known) or not known or held.last != known[-1]:
            self.missed += 1
            return []
        self.used += 1
        drafts = held.drafts
        if tree:
            drafts = drafts if isinstance(drafts, DraftTree) else DraftTree.chain(drafts[:k])
            return drafts.pruned(tree) if len(drafts) else []
        return first_branch(drafts)[:k] if isinstance(drafts, DraftTree) else drafts[:k]

    def forget(self, seq_id: str) -> None:
        self._held.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._held)

    def stats(self) -> dict:
        return {"held": len(self._held), "used": self.used, "missed": self.missed}


def greedy_tokens(logits: torch.Tensor) -> list[int]:  # logits [B, V] -> B token ids
    return logits.argmax(dim=-1).tolist()


def first_branch(tree: DraftTree) -> list[int]:
    """A tree's path down its first child at every node (its drafter's best guess: trees list children best first)."""
    tokens, node = [], 0
    while True:
        child = next((i for i, p in enumerate(tree.parents, start=1) if p == node), None)
        if child is None:
            return tokens
        tokens.append(tree.tokens[child - 1])
        node = child
