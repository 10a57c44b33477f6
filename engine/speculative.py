"""The speculative decoding loop over many sequences: draft, verify, rejection-sample, stop, stream.

One `step()` is one round for every live sequence (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1,
batched): the proposer drafts up to k tokens per sequence, the target scores all of them in one batched forward,
and `rejection_sample` keeps the agreeing prefix plus one recovered or bonus token. Sequences join and leave
between rounds. k = 0 (or speculation off for a sequence) is plain target decoding through the same path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .loading import tokenizer_eos_ids
from .model_runner import ModelRunner
from .policy import load_adjusted_k
from .proposers import DraftRequest, Proposer
from .rejection import rejection_sample
from .sampling import BatchSampling, SamplingParams, logits_to_probs
from .sequence import (RequestOutput, SequenceState, draft_generator)
from .stats import EngineTimings, SpecStats

class SpeculativeEngine:
    """Holds the live sequences of one target (+ optional proposer) and runs rounds over all of them."""

    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 4,
        eos_token_ids: Sequence[int] = (),
        max_batch_for_speculation: int | None = None,
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch_for_speculation = max_batch_for_speculation  # see engine/policy.py
        self.eos_token_ids = frozenset(eos_token_ids) | tokenizer_eos_ids(tokenizer)  # see engine.loading
        self.timings = EngineTimings()
        self.stats = SpecStats()
        self._seqs: dict[str, SequenceState] = {}
        self._draft_generators: dict[str, torch.Generator] = {}

    # ---- admission ------------------------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._seqs)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, k: int | None = None
    ) -> None:
        """Admit a request. `k` overrides the engine's K for it (0 = plain decoding)."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already live")
        k = self.num_speculative_tokens if k is None else k
        seq = SequenceState.create(request_id, prompt_ids, params, k if self.proposer is not None else 0,
                                   self.target.max_model_len, self.eos_token_ids, self.tokenizer)
        self.target.add(request_id)
        self._seqs[request_id] = seq
        self._draft_generators[request_id] = draft_generator(params)

    def abort(self, request_id: str) -> None:
        """Drop a request now (client gone); its caches are freed at once."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._release(seq)

    def _release(self, seq: SequenceState) -> None:
        self._draft_generators.pop(seq.request_id, None)
        self.target.release(seq.request_id)
        if self.proposer is not None:
            self.proposer.release(seq.request_id)

    # ---- one round ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        seqs = list(self._seqs.values())
        if not seqs:
            return []
        # a round emits at most k+1 tokens, so drafting past remaining-1 is wasted work
        k_now = load_adjusted_k(self.num_speculative_tokens, len(seqs), self.max_batch_for_speculation)
        ks = [s.draft_len(min(s.k, k_now)) for s in seqs]
        t0 = time.perf_counter()
        draft_ids, draft_probs, num_draft = self._draft(seqs, ks)
        t1 = time.perf_counter()
        k_max = draft_ids.shape[1]
        feeds = [
            self.target.sync(s.request_id, s.tokens) + draft_ids[b, : int(num_draft[b])].tolist()
            for b, s in enumerate(seqs)
        ]
        logits = self.target.forward([s.request_id for s in seqs], feeds, [int(n) + 1 for n in num_draft])
        target_probs = logits_to_probs(logits, BatchSampling.from_params([s.params for s in seqs]))
        if target_probs.shape[1] < k_max + 1:  # every row drafted fewer than the padded width
            pad = target_probs.new_zeros(len(seqs), k_max + 1 - target_probs.shape[1], target_probs.shape[2])
            target_probs = torch.cat([target_probs, pad], dim=1)
        t2 = time.perf_counter()
        result = rejection_sample(draft_ids, draft_probs, target_probs, num_draft, [s.generator for s in seqs])
        outputs = [self._commit(s, result.tokens(b), int(num_draft[b]), int(result.num_accepted[b]))
                   for b, s in enumerate(seqs)]
        t3 = time.perf_counter()
        self.timings.record(len(seqs), t1 - t0, t2 - t1, t3 - t2)
        return outputs

    def _draft(
        self, seqs: list[SequenceState], ks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # [B, K], [B, K, V] | None, [B]
        batch, k_max = len(seqs), max(ks)
        num_draft = torch.zeros(batch, dtype=torch.long)
        draft_ids = torch.full((batch, k_max), -1, dtype=torch.long)
        if k_max == 0 or self.proposer is None:
            return draft_ids, None, num_draft
        rows = [b for b in range(batch) if ks[b] > 0]
        proposal = self.proposer.propose([
            DraftRequest(seqs[b].request_id, seqs[b].tokens, ks[b], seqs[b].params,
                         self._draft_generators[seqs[b].request_id])
            for b in rows
        ])
        index = torch.tensor(rows)
        width = proposal.token_ids.shape[1]
        draft_ids[index, :width] = proposal.token_ids
        num_draft[index] = proposal.num_tokens
        draft_probs = None
        if proposal.probs is not None:
            draft_probs = torch.zeros(batch, k_max, proposal.probs.shape[-1])
            draft_probs[index, :width] = proposal.probs
        return draft_ids, draft_probs, num_draft

    def _commit(self, seq: SequenceState, tokens: list[int], num_draft: int, num_accepted: int) -> RequestOutput:
        out = seq.commit(tokens, num_draft, num_accepted)
        self.stats.record(num_draft, num_accepted, len(out.new_token_ids))
        if out.finished:
            self._seqs.pop(seq.request_id, None)
            self._release(seq)
        return out

    # ---- convenience ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        k: int | None = None,
        on_round: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion together (batched rounds); returns one Completion per prompt, in order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        done: dict[str, Completion] = {rid: Completion(prompt_ids=list(p)) for rid, p in zip(ids, prompts)}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p, k=k)
        while any(not c.finished for c in done.values()):
            outputs = [o for o in self.step() if o.request_id in done]
            for out in outputs:
                done[out.request_id].absorb(out)
            if on_round is not None:
                on_round(outputs)
        return [done[rid] for rid in ids]


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stats: SpecStats | None = None

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        if out.finished:
            self.finished, self.finish_reason, self.stats = True, out.finish_reason, out.stats
