"""The one verify step: a round's rows through the target model, then the accept step, where the logits are.

Both round loops verify through `TargetVerifier`: the in-process engine (engine/speculative.py) and the served
target worker (deployments/workers/target.py, on every tensor-parallel rank; only the rank that samples runs the
accept step). Per row it applies the call's delta to the sequence's known tokens (engine/request/delta.py), feeds
what the cache lacks (and the prompt positions a request scores for prompt logprobs, engine/request/prompt_logprobs.py)
followed by the drafts, runs one batched forward, masks each row by its grammar, and samples every row's verdict
with engine/spec/accept.verify_rows (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1, batched). A row whose
grammar fails here is answered as a failure by index; the others go on.

Drafts made inside the target (engine/spec/target_drafts.py: the target's first layers, Medusa heads): a row
whose `target_k` is set verifies up to that many of the drafts the target's drafter made for it at the end of its
last call (`HeldDrafts`; none if they were made after other tokens), and after the accept step the drafter makes
its next round's, from this pass's state (its hidden states, or its KV cache), before the answer goes back: a round
is one call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.request.delta import KnownSequences, SeqDelta
from engine.request.grammar import GrammarError, SequenceGrammars
from engine.request.prompt_logprobs import PromptLogprobs, score_tokens, verify_feed
from engine.spec.accept import RowVerify, Verdict, verify_rows
from engine.spec.proposal import CompactProposal
from engine.spec.target_drafts import DraftFrom, DraftPeers, HeldDrafts, TargetDrafter
from engine.spec.tree import DraftTree


@dataclass(frozen=True)
class VerifyRow:
    """One row of a verify step: what is new of its sequence, and the drafts to score after it."""

    delta: SeqDelta
    drafts: Sequence[int] = ()  # K_b draft tokens (empty: plain decoding)
    proposal: CompactProposal | None = None  # unseeded sampled model drafts: the compact proposal they came from
    # drafts from the target's own drafter: verify up to this many of those it holds for the row, and make as many
    # for its next round (0: none)
    target_k: int = 0
    tree: DraftTree | None = None  # the drafts as a token tree (engine/spec/tree.py): `drafts` are its tokens
    target_tree: int = 0  # with target_k: the target drafter's next drafts as a tree of at most this many nodes

    def __post_init__(self) -> None:
        assert self.tree is None or list(self.drafts) == list(self.tree.tokens), "a tree row's drafts are its tokens"


@dataclass
class VerifyOutcome:
    """A verify step's answer, by row index."""

    verdicts: list[Verdict | None]  # None: the row failed (`failed`)
    failed: dict[int, GrammarError] = field(default_factory=dict)  # rows whose grammar failed here
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # rows that scored prompt tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)  # feed tokens read from the prefix cache
    drafts: dict[int, list[int]] = field(default_factory=dict)  # rows with target_k: the held drafts they verified
    # the target drafter's time making the next round's drafts: inside this step, or (drafting after the reply) the
    # time of the drafting done after the previous steps' replies
    draft_seconds: float = 0.0
    # drafting after the reply: the next round's drafting, for the caller to run once the answer has gone (and before
    # the next step); None: done inside this step, or nothing to draft
    draft_next: Callable[[], None] | None = None


class TargetVerifier:
    """The target's side of every round: its runner, the sequences' known tokens and settings, their grammars."""

    def __init__(self, runner, grammars: SequenceGrammars | None, known: KnownSequences | None = None,
                 samples: bool = True, drafter: TargetDrafter | None = None, peers: DraftPeers | None = None,
                 draft_after_reply: bool = False) -> None:
        self.runner = runner
        self.grammars = grammars  # structured outputs' matchers (None: this side has no grammar compiler)
        self.known = KnownSequences() if known is None else known
        self.samples = samples  # False on tensor-parallel ranks other than 0: they only compute
        self.drafter = drafter  # a draft source inside the target (engine/spec/target_drafts.py), or None
        self.peers = peers  # tensor parallelism, on rank 0: the other ranks, told what its drafter does
        self.draft_after_reply = draft_after_reply  # the outcome carries the drafting (`draft_next`) for later
        self._later_seconds = 0.0  # drafting done after replies since the last step reported it
        self.held = HeldDrafts()
        if drafter is not None and getattr(drafter, "needs_hidden", False):
            runner.keep_hidden()
        # tree rows verified by a side that does not sample (a tensor-parallel rank but the first): their accepted
        # path is read from the committed tokens the row's next call brings (`_settle_tree`)
        self._trees: dict[str, DraftTree] = {}

    def verify(self, rows: Sequence[VerifyRow]) -> VerifyOutcome | None:
        """Score every row's drafts in one forward and sample its verdict; None where this side does not sample."""
        runner = self.runner
        rows = list(rows)
        seq_ids, feeds, widths, positions = [], [], [], []
        prompt: dict[int, PromptLogprobs | None] = {}
        own: dict[int, list[int]] = {}  # rows verifying the target drafter's drafts
        trees = [row.tree for row in rows]
        for b, row in enumerate(rows):
            delta = row.delta
            known = self.known.apply(delta)
            self._settle_tree(delta.seq_id, known)
            if row.target_k and self.drafter is not None:
                held = self.held.take(delta.seq_id, known, row.target_k, row.target_tree)
                tree = held if isinstance(held, DraftTree) else None
                own[b] = list(held.tokens) if tree is not None else held
                row = rows[b] = VerifyRow(delta, own[b], None, row.target_k, tree, row.target_tree)
                trees[b] = tree
            if not runner.has(delta.seq_id):
                runner.add(delta.seq_id)
            seq_ids.append(delta.seq_id)
            positions.append(len(known))  # the absolute position of the row's first scored token
            feed, scored = verify_feed(runner, delta.seq_id, known, self.known.settings(delta.seq_id).prompt_len,
                                       delta.prompt_logprobs, reduce=self.samples)
            if delta.prompt_logprobs is not None:  # the LM head over its prompt positions, fed first
                prompt[b] = scored
            feeds.append(feed + list(row.drafts))
            widths.append(len(row.drafts) + 1)
        if any(t is not None for t in trees):
            if not getattr(runner, "takes_trees", False):
                raise ValueError(f"{type(runner).__name__} does not verify token trees (speculation.tree needs the "
                                 f"static runner)")
            logits = runner.forward(seq_ids, feeds, widths, trees=trees)  # [B, N+1, V]
        else:
            logits = runner.forward(seq_ids, feeds, widths)  # [B, K+1, V]; every rank runs it (collectives)
        cached = dict(getattr(runner, "last_prefix_hits", {}))  # row -> tokens read from the prefix cache
        if not self.samples:
            self._trees.update((row.delta.seq_id, row.tree) for row in rows if row.tree is not None)
            return None
        outcome = VerifyOutcome([None] * len(rows), cached_tokens=cached, drafts=own)
        for b, run in prompt.items():  # a prompt chunk's last logits score the next chunk's first token
            delta = rows[b].delta
            if delta.prompt_next is not None:
                end = PromptLogprobs(positions[b], score_tokens(logits[b, :1], [delta.prompt_next],
                                                                delta.prompt_logprobs))
                run = end if run is None else PromptLogprobs(run.first, run.entries + end.entries)
            if run is not None:
                outcome.prompt_logprobs[b] = run
        accepting, kept = [], []
        for b, (row, position) in enumerate(zip(rows, positions)):
            try:
                allowed = self._grammar_masks(row)
            except GrammarError as exc:  # this row's request fails; the others go on
                outcome.failed[b] = exc
                continue
            seq_id = row.delta.seq_id
            settings = self.known.settings(seq_id)
            kept.append(b)
            accepting.append(RowVerify(settings.params, settings.scheme(position), row.drafts, row.proposal,
                                       self.known.processing(seq_id), allowed, row.tree))
        if accepting:  # the accept step on the target's device (engine/spec/accept.py): tokens come back
            for b, verdict in zip(kept, verify_rows(logits[kept] if outcome.failed else logits, accepting)):
                outcome.verdicts[b] = verdict
                if rows[b].tree is not None:  # the accepted path's keys and values into place, the rest dropped
                    runner.keep_path(rows[b].delta.seq_id, rows[b].tree.width, verdict.path)
                if self.grammars is not None:  # a grammar keeps the accepted drafts and the token after them
                    seq_id = rows[b].delta.seq_id
                    with contextlib.suppress(GrammarError):  # remembered: the row's next call fails
                        self.grammars.matcher(seq_id, self.known.tokens[seq_id] + verdict.tokens)
        outcome.draft_seconds, self._later_seconds = self._later_seconds, 0.0
        # this pass's final hidden states (a new tensor each pass): another caller's step may run before a drafting
        # done after the reply
        hidden = getattr(self.runner, "last_hidden", None)
        if own and self.draft_after_reply:
            outcome.draft_next = lambda: self._draft_later(rows, outcome.verdicts, hidden)
        elif own:
            outcome.draft_seconds += self._draft_next(rows, outcome.verdicts, hidden)
        return outcome

    def _draft_later(self, rows: list[VerifyRow], verdicts: list[Verdict | None], hidden: torch.Tensor | None) -> None:
        self._later_seconds += self._draft_next(rows, verdicts, hidden)

    def _draft_next(self, rows: list[VerifyRow], verdicts: list[Verdict | None],
                    hidden: torch.Tensor | None) -> float:  # hidden [B, W, H]: the verify pass's (keep_hidden)
        """The target drafter's drafts for the next round of every row that wants them, kept until its next call:
        each from the position that predicted the row's last token, its cache rolled back to the committed tokens
        first (the rejected drafts' keys and values go). The seconds it took."""
        starts, accepted = [], []
        for b, row in enumerate(rows):
            verdict = verdicts[b]
            if not row.target_k or verdict is None:
                continue
            seq_id = row.delta.seq_id
            committed = self.known.tokens[seq_id] + verdict.tokens
            k = min(row.target_k, self.runner.max_model_len - len(committed))
            if k > 0:
                self.runner.sync(seq_id, committed)
                # the window offset that predicted the last token: the accepted drafts' count in a chain, the last
                # accepted node in a tree (its root, 0, when none was)
                if verdict.path is None:
                    at = verdict.num_accepted
                else:
                    at = verdict.path[-1] if verdict.path else 0
                starts.append(DraftFrom(seq_id, b, at, len(committed), committed[-1], k,
                                        min(row.target_tree, self.runner.max_model_len - len(committed))))
                accepted.append(list(verdict.tokens))
        if not starts:
            return 0.0
        began = time.perf_counter()
        if self.peers is not None and self.drafter.collective:
            self.peers.drafting(starts, accepted)
        drafted = self.drafter.draft(self.runner, starts, hidden)
        seconds = time.perf_counter() - began
        for start, drafts in zip(starts, drafted):
            self.held.keep(start.seq_id, start.committed, start.last, drafts)
        if self.peers is not None:
            self.peers.made(starts, drafted)
        return seconds

    def draft_with_first_rank(self, starts: Sequence[DraftFrom], accepted: Sequence[list[int]]) -> None:
        """A tensor-parallel rank but the first: run a collective drafter's steps with rank 0's (`DraftPeers`), from
        each row's committed tokens (its known ones and what rank 0's verdict added), the drafts discarded: rank 0
        sends the ones it made (`hold`)."""
        for start, tokens in zip(starts, accepted):
            self.runner.sync(start.seq_id, self.known.tokens[start.seq_id] + tokens)
        self.drafter.draft(self.runner, starts, getattr(self.runner, "last_hidden", None))

    def hold(self, starts: Sequence[DraftFrom], drafts: Sequence[list[int] | DraftTree]) -> None:
        """A tensor-parallel rank but the first: keep the drafts rank 0 made, for the rows' next calls."""
        for start, made in zip(starts, drafts):
            self.held.keep(start.seq_id, start.committed, start.last, made)

    def _settle_tree(self, seq_id: str, known: Sequence[int]) -> None:
        """On a side that does not sample: the tree this row verified last is walked by the tokens committed since
        (each accepted draft is the child holding the next committed token), and its path kept (`keep_path`)."""
        tree = self._trees.pop(seq_id, None)
        if tree is None or not self.runner.has(seq_id):
            return
        root = len(self.runner.cached_tokens(seq_id)) - tree.width
        if root < 0:
            return
        node, path = 0, []
        for token in known[root + 1:]:
            node = tree.child(node, token)
            if node is None:
                break
            path.append(node)
        self.runner.keep_path(seq_id, tree.width, path)

    def _grammar_masks(self, row: VerifyRow) -> torch.Tensor | None:  # [K+1, V] bool, or None: no grammar
        """The row's grammar masks at each verify position (engine/request/grammar.py): its matcher, made from the
        grammar its sequence's first delta carried, synced to the committed tokens, probes the drafts. GrammarError
        when the grammar cannot be compiled here (the router compiled it before admission: a tokenizer mismatch, or no
        tokenizer table) or its matcher broke."""
        delta = row.delta
        spec = None if delta.settings is None else delta.settings.params.grammar
        if spec is not None:
            if self.grammars is None:
                raise GrammarError("this target worker has no grammar compiler")
            self.grammars.track(delta.seq_id, spec, delta.settings.prompt_len)
        if self.grammars is None:
            return None
        return self.grammars.masks(delta.seq_id, self.known.tokens[delta.seq_id], row.drafts)

    def release(self, seq_id: str) -> None:
        """Forget a sequence: its known tokens, its grammar, its caches."""
        self.known.pop(seq_id)
        self.held.forget(seq_id)
        self._trees.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.release(seq_id)
        self.runner.release(seq_id)
