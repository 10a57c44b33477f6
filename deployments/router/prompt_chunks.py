"""Chunked prefill: a long prompt goes to its Target worker one `prefill_chunk` per round, as vLLM's and SGLang's
schedulers do, so the running rows wait for one chunk per prompt per round instead of whole prompts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from deployments.errors import ReplicaGone, RequestFailed
from deployments.router.live import LiveRequest
from deployments.router.recovery import Recovery
from deployments.transport.messages import DraftCall, DraftResult, VerifyCall


class PromptChunks:
    """Sends the next chunk of each long prompt leased to one Target replica (the scheduler's rounds call `send`)."""

    def __init__(self, config, stats, recovery: Recovery,
                 deliver: Callable[[list[LiveRequest], list[RequestFailed]], Awaitable[None]]) -> None:
        self.config = config  # deployments.router.scheduler.SchedulerConfig
        self.stats = stats  # deployments.router.scheduler.SchedulerStats
        self.recovery = recovery
        self._deliver = deliver

    async def send(self, lives: list[LiveRequest]) -> None:
        """The next `prefill_chunk` tokens of each prompt in `lives` (all leased to one Target replica) to its
        worker in one call: the worker takes turns between this call and the running rows' round, and the prompts'
        chunks share forwards there (engine/models/static/prefill_plan.prefill_groups). The chunks' sampled
        tokens are not needed; a request that asked for prompt logprobs gets its chunk's
        (engine/request/prompt_logprobs.py)."""
        ends = [live.target_sent + self.config.prefill_chunk for live in lives]
        calls = [VerifyCall(live.delta(live.target_sent, end), []) for live, end in zip(lives, ends)]
        try:
            result, *drafted = await asyncio.gather(
                lives[0].target.verify(calls), *(self._draft_reads(live, end) for live, end in zip(lives, ends)))
        except ReplicaGone:
            await self.recovery.replace_target(lives)
            return
        self.stats.note_cached(lives, result.cached_tokens)
        ended_now = []
        for b, (live, end) in enumerate(zip(lives, ends)):
            if b in result.prompt_logprobs:
                live.seq.add_prompt_logprobs(result.prompt_logprobs[b])
            live.target_sent = end
            failure = result.failed.get(b) or (drafted[b].failed.get(0) if drafted[b] is not None else None)
            if failure is not None:  # a worker failed this request (its grammar): it ends with the error
                ended_now.append((live, RequestFailed.of(failure)))
        self.stats.prefill_chunks += len(lives)
        if ended_now:
            await self._deliver([live for live, _ in ended_now], [error for _, error in ended_now])

    async def _draft_reads(self, live: LiveRequest, end: int) -> DraftResult | None:
        """With a draft model, the same chunk goes to the row's Draft worker (a draft call for 0 tokens: it only
        reads), so the draft too reads a long prompt one chunk a round instead of all of it in the row's first
        drafting round. The Draft lease is taken here; a row without one (none to be had, or its worker died)
        reads the rest when it next drafts."""
        if not self.config.draft.remote or live.seq.k == 0:
            return None
        if live.draft is None and time.monotonic() >= live.draft_retry_at:
            await self.recovery.lease_drafts([live])
        if live.draft is None or live.draft_sent >= end:
            return None
        try:
            result = await live.draft.propose([DraftCall(live.draft_delta([], end), 0)])
        except ReplicaGone:
            await self.recovery.replace_draft([live])
            return None
        self.stats.draft_prefill_chunks += 1
        return result
