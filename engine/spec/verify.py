"""The one verify step: a round's rows through the target model, then the accept step, where the logits are.

Both round loops verify through `TargetVerifier`: the in-process engine (engine/speculative.py) and the served
target worker (deployments/workers/target.py, on every tensor-parallel rank; only the rank that samples runs the
accept step). Per row it applies the call's delta to the sequence's known tokens (engine/request/delta.py), feeds
what the cache lacks (and the prompt positions a request scores for prompt logprobs, engine/request/prompt_logprobs.py)
followed by the drafts, runs one batched forward, masks each row by its grammar, and samples every row's verdict
with engine/spec/accept.verify_rows (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1, batched). A row whose
grammar fails here is answered as a failure by index; the others go on.

The seam for drafts made inside the target (self-speculative layers, Medusa or EAGLE heads): a `TargetDrafter`
given to the verifier is called right after the accept step with the rows, their verdicts and the verify pass's
logits, where the target's state for the next round is at hand, and its drafts for the next round come back in the
outcome (`VerifyOutcome.next_drafts`), so such a round is one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.request.delta import KnownSequences, SeqDelta
from engine.request.grammar import GrammarError, SequenceGrammars
from engine.request.prompt_logprobs import PromptLogprobs, score_tokens, verify_feed
from engine.spec.accept import RowVerify, Verdict, verify_rows
from engine.spec.proposal import CompactProposal


@dataclass(frozen=True)
class VerifyRow:
    """One row of a verify step: what is new of its sequence, and the drafts to score after it."""

    delta: SeqDelta
    drafts: Sequence[int] = ()  # K_b draft tokens (empty: plain decoding)
    proposal: CompactProposal | None = None  # unseeded sampled model drafts: the compact proposal they came from


@dataclass
class VerifyOutcome:
    """A verify step's answer, by row index."""

    verdicts: list[Verdict | None]  # None: the row failed (`failed`)
    failed: dict[int, GrammarError] = field(default_factory=dict)  # rows whose grammar failed here
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # rows that scored prompt tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)  # feed tokens read from the prefix cache
    next_drafts: list[list[int]] | None = None  # a TargetDrafter's drafts for each row's next round


class TargetDrafter(Protocol):
    """A draft source that runs inside the target: it drafts each row's next round from the verify pass it follows."""

    def draft(self, rows: Sequence[VerifyRow], verdicts: Sequence[Verdict | None],
              logits: torch.Tensor) -> list[list[int]]:  # logits [B, K+1, V]
        ...


class TargetVerifier:
    """The target's side of every round: its runner, the sequences' known tokens and settings, their grammars."""

    def __init__(self, runner, grammars: SequenceGrammars | None, known: KnownSequences | None = None,
                 samples: bool = True, drafter: TargetDrafter | None = None) -> None:
        self.runner = runner
        self.grammars = grammars  # structured outputs' matchers (None: this side has no grammar compiler)
        self.known = KnownSequences() if known is None else known
        self.samples = samples  # False on tensor-parallel ranks other than 0: they only compute
        self.drafter = drafter

    def verify(self, rows: Sequence[VerifyRow]) -> VerifyOutcome | None:
        """Score every row's drafts in one forward and sample its verdict; None where this side does not sample."""
        runner = self.runner
        seq_ids, feeds, widths, positions = [], [], [], []
        prompt: dict[int, PromptLogprobs | None] = {}
        for b, row in enumerate(rows):
            delta = row.delta
            known = self.known.apply(delta)
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
        logits = runner.forward(seq_ids, feeds, widths)  # [B, K+1, V]; every rank runs it (collectives)
        cached = dict(getattr(runner, "last_prefix_hits", {}))  # row -> tokens read from the prefix cache
        if not self.samples:
            return None
        outcome = VerifyOutcome([None] * len(rows), cached_tokens=cached)
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
                                       self.known.processing(seq_id), allowed))
        if accepting:  # the accept step on the target's device (engine/spec/accept.py): tokens come back
            for b, verdict in zip(kept, verify_rows(logits[kept] if outcome.failed else logits, accepting)):
                outcome.verdicts[b] = verdict
                if self.grammars is not None:  # a grammar keeps the accepted drafts and the token after them
                    seq_id = rows[b].delta.seq_id
                    with contextlib.suppress(GrammarError):  # remembered: the row's next call fails
                        self.grammars.matcher(seq_id, self.known.tokens[seq_id] + verdict.tokens)
        if self.drafter is not None:
            outcome.next_drafts = self.drafter.draft(rows, outcome.verdicts, logits)
        return outcome

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
        if self.grammars is not None:
            self.grammars.release(seq_id)
        self.runner.release(seq_id)
