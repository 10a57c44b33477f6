"""Draft-model speculation: a small model of the target's family proposes K tokens a round.

Leviathan et al. 2022 (arXiv 2211.17192); the tokens are picked as engine/spec/proposal.py says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from engine.models.transformers_runner import ModelRunner
from engine.proposers.base import DraftRequest, Proposal
from engine.proposers.ngram import NgramProposer
from engine.request.grammar import GrammarError, GrammarMatcher, SequenceGrammars
from engine.request.logits_processing import process_logits
from engine.request.sampling import BatchSampling, logits_to_probs
from engine.spec.proposal import TOP_N, CompactProposal, choose_draft_tokens
from engine.spec.tree import chain_with_siblings, top_candidates


def fit_vocab(
    probs: torch.Tensor,  # [..., V_draft]
    target_vocab: int,
) -> torch.Tensor:  # [..., V_target]
    """Draft and target of one family may pad their embedding tables to different sizes."""
    draft_vocab = probs.shape[-1]
    if draft_vocab == target_vocab:
        return probs
    if draft_vocab > target_vocab:
        return probs[..., :target_vocab]
    pad = probs.new_zeros(*probs.shape[:-1], target_vocab - draft_vocab)
    return torch.cat([probs, pad], dim=-1)



def round_buffers(requests: Sequence[DraftRequest], n: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's outputs before drafting: token ids [B, K] (-1), counts [B] (each row's k), and the top-n ids
    [B, K, n] int32 and probabilities [B, K, n] of its compact proposals (zeros)."""
    batch, k_max = len(requests), max(r.k for r in requests)
    return (torch.full((batch, k_max), -1, dtype=torch.long), torch.tensor([r.k for r in requests], dtype=torch.long),
            torch.zeros(batch, k_max, n, dtype=torch.int32), torch.zeros(batch, k_max, n))


def round_proposal(requests: Sequence[DraftRequest], token_ids: torch.Tensor, num_tokens: torch.Tensor,
                   top_ids: torch.Tensor, top_probs: torch.Tensor,
                   trees: list | None = None) -> Proposal:  # `round_buffers`' tensors, filled
    """The round's Proposal: the compact proposals of unseeded sampled rows that drafted a chain (a tree's nodes are
    candidates, not draws: it ships none), and the trees rows asked for."""
    proposals = [CompactProposal(top_ids[b], top_probs[b]) if r.ships_proposal and not r.tree else None
                 for b, r in enumerate(requests)]
    return Proposal(token_ids=token_ids, num_tokens=num_tokens,
                    proposals=proposals if any(p is not None for p in proposals) else None,
                    trees=trees if trees and any(t is not None for t in trees) else None)


class DraftModelProposer:
    """Proposes k tokens per sequence by running the draft model autoregressively, batched over sequences."""

    def __init__(self, runner: ModelRunner, target_vocab_size: int, top_n: int = TOP_N,
                 grammars: SequenceGrammars | None = None, lookup: NgramProposer | None = None) -> None:
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.top_n = top_n
        # staged speculative decoding's second stage (Spector and Re 2023, arXiv 2308.04623, section 3.2): the draft
        # model's own steps speculated by n-gram lookup over the context, checked in one draft pass (`_staged`)
        self.lookup = lookup
        self.lookup_steps = [0, 0]  # [draft passes, draft tokens they made] with the second stage
        # structured outputs: the draft's own matcher per sequence, so its drafts stay in the grammar and are
        # accepted; None: drafts unmasked (the target's mask alone keeps the output right)
        self.grammars = grammars

    def propose(self, requests: Sequence[DraftRequest], stop: Callable[[], bool] | None = None) -> Proposal:
        """Draft up to k tokens per request; `stop()`, checked between steps, ends drafting early (the caller
        no longer wants the result; `num_tokens` then counts the steps done)."""
        feeds = self._feeds(requests)
        matchers = self._matchers(requests)
        if self._feeds_on_device(requests, matchers):
            return self._on_device(requests, feeds, stop)
        if self.lookup is not None and all(r.processing is None and not r.tree for r in requests) \
                and all(m is None for m in matchers):
            return self._staged(requests, feeds, stop)
        n = min(self.top_n, self.target_vocab_size)
        token_ids, num_tokens, top_ids, top_probs = round_buffers(requests, n)
        steps: dict[int, list] = {b: [] for b, r in enumerate(requests) if r.tree}  # tree rows' candidates per step
        k_max, active = token_ids.shape[1], list(range(len(requests)))
        for step in range(k_max):
            logits = self.runner.forward([requests[i].seq_id for i in active], [feeds[i] for i in active],
                                         [1] * len(active))  # [A, 1, V_draft]
            # the draft's logits beyond the target vocabulary can never be proposed
            step_logits = mask_draft_logits(logits[:, :, : self.target_vocab_size], [matchers[i] for i in active])
            if any(requests[i].processing is not None for i in active):  # step j sees the j tokens drafted so far
                step_logits = process_logits(step_logits, [requests[i].processing for i in active],
                                             [token_ids[i, :step].tolist() for i in active], [step] * len(active))
            sampling = BatchSampling.from_params([requests[i].sampling for i in active])
            # sampled on the draft's device with counter-based random numbers; only tokens and top-N leave it
            step_probs = fit_vocab(logits_to_probs(step_logits, sampling), self.target_vocab_size)[:, 0]
            tokens, ids, values = choose_draft_tokens(step_probs, [requests[i].scheme(step) for i in active], n)
            trees = [pos for pos, i in enumerate(active) if requests[i].tree]
            if trees:  # a tree's chain is the draft's best candidates, its alternatives hang beside it
                ranked = top_candidates(step_logits[trees, 0].float().softmax(dim=-1))
                for pos, candidates in zip(trees, ranked):
                    steps[active[pos]].append(candidates)
                    tokens[pos] = candidates[0][0]
            tokens = tokens.cpu()
            rows = torch.tensor(active)
            token_ids[rows, step] = tokens
            top_ids[rows, step] = ids.cpu()
            top_probs[rows, step] = values.cpu()
            active_next = []
            for pos, i in enumerate(active):
                feeds[i] = [int(tokens[pos])]
                if matchers[i] is not None:
                    try:
                        matchers[i].advance(feeds[i])  # the next draft step's state (rolled back by the next sync)
                    except GrammarError as exc:  # remembered: the caller finds it with grammars.check
                        self.grammars.fail(requests[i].seq_id, exc)
                        matchers[i] = None
                if requests[i].k > step + 1:
                    active_next.append(i)
            active = active_next
            if not active:
                break
            if stop is not None and stop():
                num_tokens = num_tokens.clamp(max=step + 1)
                break
        trees = [chain_with_siblings(steps[b][: int(num_tokens[b])], r.tree) if r.tree else None
                 for b, r in enumerate(requests)]
        return round_proposal(requests, token_ids, num_tokens, top_ids, top_probs, trees)

    def _staged(self, requests: Sequence[DraftRequest], feeds: list[list[int]],
                stop: Callable[[], bool] | None) -> Proposal:
        """Drafts whose steps are themselves speculated (staged speculative decoding's second stage): each pass feeds
        a row's pending token and the n-gram lookup's guess of the draft's next tokens (over the row's context and
        its drafts so far), and keeps the draft's own picks up to the first that differs from the guess, that one
        included: one pass makes one or more drafts. Every pick is the draft's choice at its position by the row's
        scheme (engine/spec/proposal.py: argmax, coupled, or drawn with the position's counter uniforms), so the
        drafts and compact proposals are those of one step at a time; only the number of passes changes."""
        n = min(self.top_n, self.target_vocab_size)
        token_ids, num_tokens, top_ids, top_probs = round_buffers(requests, n)
        drafted: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            guesses = []
            for i in active:
                left = requests[i].k - len(drafted[i]) - 1  # the pass's own pick comes on top of the guess
                found = self.lookup.lookup(list(requests[i].tokens) + drafted[i], left) if left > 0 else []
                guesses.append(found[:max(left, 0)])
            logits = self.runner.forward([requests[i].seq_id for i in active],
                                         [feeds[i] + g for i, g in zip(active, guesses)],
                                         [len(g) + 1 for g in guesses])  # [A, W, V_draft]
            sampling = BatchSampling.from_params([requests[i].sampling for i in active])
            probs = fit_vocab(logits_to_probs(logits[:, :, : self.target_vocab_size], sampling),
                              self.target_vocab_size)  # [A, W, V]
            self.lookup_steps[0] += 1
            for j in range(probs.shape[1]):  # position j: the pick after the guess's first j tokens
                rows = [a for a, g in enumerate(guesses) if j <= len(g)]  # rows whose guess held before j
                if not rows:
                    break
                schemes = [requests[active[a]].scheme(len(drafted[active[a]])) for a in rows]
                picks, ids, values = choose_draft_tokens(probs[rows, j], schemes, n)
                for a, pick, row_ids, row_values in zip(rows, picks.tolist(), ids.cpu(), values.cpu()):
                    i = active[a]
                    step = len(drafted[i])
                    token_ids[i, step], top_ids[i, step], top_probs[i, step] = pick, row_ids, row_values
                    drafted[i].append(pick)
                    self.lookup_steps[1] += 1
                    if j < len(guesses[a]) and guesses[a][j] != pick:
                        guesses[a] = guesses[a][:j]  # the guess failed here: this pick ends the row's pass
            for i in active:  # the cache rolls back past what the pass fed beyond the kept picks
                feeds[i] = self.runner.sync(requests[i].seq_id, list(requests[i].tokens) + drafted[i])
            active = [i for i in active if len(drafted[i]) < requests[i].k]
            if active and stop is not None and stop():
                num_tokens = torch.tensor([len(d) for d in drafted], dtype=torch.long)
                break
        return round_proposal(requests, token_ids, num_tokens, top_ids, top_probs)

    def _feeds_on_device(self, requests: Sequence[DraftRequest], matchers: list) -> bool:
        """Whether this round's steps can feed each other on the device (`_on_device`): no row processed or under a
        grammar (those need each token on the host), every row drafting the same k, on a runner whose steps take
        device tokens."""
        return (getattr(self.runner, "takes_device_tokens", False) and len({r.k for r in requests}) == 1
                and all(r.processing is None and not r.tree for r in requests) and all(m is None for m in matchers))

    def _on_device(self, requests: Sequence[DraftRequest], feeds: list[list[int]],
                   stop: Callable[[], bool] | None) -> Proposal:
        """Drafts whose steps feed each other on the device: each step's tokens are the next step's input
        (StaticRunner.forward_fed), and the host reads the round's tokens and proposals once, at the end. The host's
        work for step j+1 (its inputs, the graph's launch) then overlaps step j on the device instead of waiting for
        its tokens: on a GPU each draft step otherwise paid a sync and the host's work in full (bench/RESULTS.md,
        the first H100 runs of the graph runner). The picks are `propose`'s step loop's: greedy rows' argmax, the
        others by their scheme (engine/spec/proposal.py) from the same logits."""
        seq_ids, k, batch = [r.seq_id for r in requests], requests[0].k, len(requests)
        greedy = all(r.sampling.greedy for r in requests)
        sampling = None if greedy else BatchSampling.from_params([r.sampling for r in requests])
        n = min(self.top_n, self.target_vocab_size)
        logits = self.runner.forward(seq_ids, feeds, [1] * batch)  # [A, 1, V]
        picked, top_ids, top_probs = [], [], []
        for step in range(k):
            step_logits = logits[:, :, : self.target_vocab_size]
            if greedy:  # the argmax that logits_to_probs' one-hot rows and choose_draft_tokens would give
                picked.append(step_logits[:, 0].argmax(dim=-1))  # [A]: stays on the device
            else:
                probs = logits_to_probs(step_logits, sampling)[:, 0]
                tokens, ids, values = choose_draft_tokens(probs, [r.scheme(step) for r in requests], n)
                picked.append(tokens)
                top_ids.append(ids)
                top_probs.append(values)
            if step + 1 == k or (stop is not None and stop()):
                break
            logits = self.runner.forward_fed(seq_ids, picked[-1])
        drafted = torch.stack(picked, dim=1).cpu()  # [A, steps]: the round's one read of the device
        for b, seq_id in enumerate(seq_ids):
            self.runner.settle(seq_id, drafted[b, :-1].tolist())  # the steps fed all but the last pick
        steps = drafted.shape[1]
        token_ids = torch.full((batch, k), -1, dtype=torch.long)
        token_ids[:, :steps] = drafted
        proposals = None
        if any(r.ships_proposal for r in requests):
            ids = torch.zeros(batch, k, n, dtype=torch.int32)
            probs = torch.zeros(batch, k, n)
            ids[:, :steps], probs[:, :steps] = torch.stack(top_ids, dim=1).cpu(), torch.stack(top_probs, dim=1).cpu()
            proposals = [CompactProposal(ids[b], probs[b]) if r.ships_proposal else None
                         for b, r in enumerate(requests)]
        return Proposal(token_ids=token_ids, num_tokens=torch.full((batch,), steps, dtype=torch.long),
                        proposals=proposals)

    def _matchers(self, requests: Sequence[DraftRequest]) -> list[GrammarMatcher | None]:
        """Each request's grammar matcher synced to its tokens (None: no grammar, or no grammars here, or a grammar
        that failed: remembered by `grammars`, whose `check` the caller asks; engine/request/grammar.SequenceGrammars)."""
        if self.grammars is None:
            return [None] * len(requests)
        self._track(requests)
        matchers = []
        for r in requests:
            try:
                matchers.append(self.grammars.matcher(r.seq_id, r.tokens))
            except GrammarError:
                matchers.append(None)
        return matchers

    def _track(self, requests: Sequence[DraftRequest]) -> None:
        """Keep a matcher for each request that brings its grammar (a sequence's first call: it is sent once); one
        that cannot be compiled is remembered as failed (`grammars.check`), the other rows draft on."""
        if self.grammars is not None:
            for r in requests:
                if r.grammar is not None:
                    with contextlib.suppress(GrammarError):
                        self.grammars.track(r.seq_id, r.grammar, r.output_start)

    def read(self, requests: Sequence[DraftRequest]) -> None:
        """Bring each request's cache up to its tokens without drafting (a long prompt read one chunk per call,
        between the rounds of running streams); the logits are not needed."""
        feeds = self._feeds(requests)
        self._track(requests)
        self.runner.forward([r.seq_id for r in requests], feeds, [1] * len(requests))

    def _feeds(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's tokens its cache lacks (a slot given to new sequences; the cache rolled back to the
        common prefix)."""
        for r in requests:
            if not self.runner.has(r.seq_id):
                self.runner.add(r.seq_id)
        return [self.runner.sync(r.seq_id, r.tokens) for r in requests]

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        if self.grammars is not None:
            self.grammars.release(seq_id)


def mask_draft_logits(
    logits: torch.Tensor,  # [A, 1, V] one draft step's logits
    matchers: Sequence[GrammarMatcher | None],  # A rows
) -> torch.Tensor:  # [A, 1, V]: `logits` itself when no row is masked, else a copy
    """The draft's own grammar masks (-inf where its grammar refuses, as the target does: engine/spec/accept.py). A row
    off its grammar, or whose allowed tokens all lie past the draft's vocabulary, is left unmasked: the target's
    mask rejects what the grammar refuses."""
    masks = [None if m is None else m.allowed() for m in matchers]
    if all(mask is None for mask in masks):
        return logits
    logits = logits.clone()
    for a, mask in enumerate(masks):
        if mask is not None:
            mask = mask[: logits.shape[-1]].to(logits.device)
            if bool(mask.any()):
                logits[a, 0].masked_fill_(~mask, float("-inf"))
    return logits
