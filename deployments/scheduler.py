"""The router's round loop: batches live requests into speculative rounds over their leased Draft/Target workers.

One asyncio task per router replica. Each round groups the live sequences by the replicas they are pinned to and,
per group, makes one batched draft call and one batched verify call (the requests' rounds are batched inside the
workers); the rejection sampler (engine/, pure) runs here. Requests join between rounds and leave when finished
or cancelled, closing their leases, which frees their caches at once. A replica that dies mid-request is
replaced by a new lease and the sequence is re-sent from token 0 (re-prefill); committed tokens never change, so
the output does not either.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine.policy import load_adjusted_k
from engine.proposers import DraftRequest, NgramProposer
from engine.rejection import greedy_accept, rejection_sample
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, SequenceState
from engine.stats import EngineTimings, SpecStats

from .metrics import NullMetrics, observe
from .workers import DraftCall, SeqDelta, VerifyCall

logger = logging.getLogger("ray.serve")

MAX_REPLICA_FAILURES = 3  # per request, before it is answered with an error


class ReplicaGone(RuntimeError):
    """The leased replica (or one of its workers) died; lease another one."""


class Overloaded(RuntimeError):
    """Admission refused: too many live sequences, or the model deployments' queues are full."""


class DraftLease(Protocol):
    key: str

    async def propose(self, calls: list[DraftCall]) -> dict: ...

    async def close(self) -> None: ...


class TargetLease(Protocol):
    key: str

    async def verify(self, calls: list[VerifyCall]) -> dict: ...

    async def close(self) -> None: ...


class LeaseBroker(Protocol):
    async def draft(self, seq_id: str) -> DraftLease: ...

    async def target(self, seq_id: str) -> TargetLease: ...


@dataclass
class _Live:
    seq: SequenceState
    queue: asyncio.Queue
    target: TargetLease
    draft: DraftLease | None = None
    draft_sent: int = 0  # committed tokens the draft worker has
    target_sent: int = 0
    failures: int = 0

    def delta(self, sent: int) -> SeqDelta:
        p = self.seq.params
        return SeqDelta(self.seq.request_id, sent, self.seq.tokens[sent:], p.temperature, p.top_k, p.top_p, p.seed)


@dataclass
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int
    draft_mode: str  # "model" | "ngram" | "none"
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch_for_speculation: int = 4
    max_live_sequences: int = 64


@dataclass
class SchedulerStats:
    spec: SpecStats = field(default_factory=SpecStats)
    timings: EngineTimings = field(default_factory=EngineTimings)
    orchestration_seconds: float = 0.0  # round wall time minus the workers' own compute, summed
    draft_compute_seconds: float = 0.0  # the draft workers' own compute, summed
    verify_compute_seconds: float = 0.0  # the target workers' own compute (rank 0), summed
    replica_failures: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer, broker: LeaseBroker) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.broker = broker
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max) if config.draft_mode == "ngram" else None
        self.stats = SchedulerStats()
        self.metrics = NullMetrics()  # the Serve router replaces it with deployments.metrics.ServingMetrics
        self._live: dict[str, _Live] = {}
        self._waiting = 0  # admitted, waiting for leases
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def current_k(self) -> int:
        """The K rounds use right now (0 once the batch outgrows speculation)."""
        if self.config.draft_mode == "none":
            return 0
        return load_adjusted_k(self.config.num_speculative_tokens, len(self._live),
                               self.config.max_batch_for_speculation)

    # ---- requests -------------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, k: int | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its per-round outputs; closing the iterator aborts it."""
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        if len(self._live) + self._waiting >= self.config.max_live_sequences:
            raise Overloaded(f"{len(self._live)} live and {self._waiting} starting sequences: at the router's "
                             "admission limit")
        k = self.config.num_speculative_tokens if k is None else k
        seq = SequenceState.create(request_id, prompt_ids, params, k, self.config.max_model_len,
                                   self.config.eos_token_ids, self.tokenizer)
        self._waiting += 1
        try:
            live = await self._open(seq)
        finally:
            self._waiting -= 1
        self._live[request_id] = live
        self._ensure_running()
        self._wakeup.set()
        try:
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            await self._finish(request_id)

    async def _open(self, seq: SequenceState) -> _Live:
        target = await self.broker.target(seq.request_id)
        draft = None
        if self.config.draft_mode == "model" and seq.k > 0:
            try:
                draft = await self.broker.draft(seq.request_id)
            except BaseException:
                await target.close()
                raise
        return _Live(seq=seq, queue=asyncio.Queue(), target=target, draft=draft)

    async def _finish(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        await live.target.close()
        if live.draft is not None:
            await live.draft.close()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---- rounds ---------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self._live:
                observe(self.metrics.load, 0, self._waiting, self.current_k())
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._round()
            except Exception as exc:  # a bug must not leave requests hanging: fail them all, keep serving
                logger.exception("speculative round failed")
                for live in list(self._live.values()):
                    live.queue.put_nowait(RuntimeError(f"internal error in the speculative round: {exc}"))
                    await self._finish(live.seq.request_id)

    async def _round(self) -> None:
        groups: dict[tuple, list[_Live]] = {}
        for live in self._live.values():
            key = (live.draft.key if live.draft else None, live.target.key)
            groups.setdefault(key, []).append(live)
        k = self.current_k()
        observe(self.metrics.load, len(self._live), self._waiting, k)
        await asyncio.gather(*(self._round_group(rows, k) for rows in groups.values()))

    async def _round_group(self, rows: list[_Live], k_now: int) -> None:
        t0 = time.perf_counter()
        ks = [live.seq.draft_len(min(k_now, live.seq.k)) for live in rows]
        drafts, draft_probs, draft_compute = await self._propose(rows, ks)
        t1 = time.perf_counter()
        target = rows[0].target
        calls = [VerifyCall(live.delta(live.target_sent), drafts[b]) for b, live in enumerate(rows)]
        try:
            result = await target.verify(calls)
        except ReplicaGone:
            await self._replace_target(rows)
            return
        for live in rows:
            live.target_sent = live.seq.num_tokens
        t2 = time.perf_counter()
        outputs, accepted = self._accept(rows, drafts, draft_probs, result)
        finished = []
        for live, out in zip(rows, outputs):
            if live.seq.request_id in self._live:  # not aborted while the round was in flight
                live.queue.put_nowait(out)
                if out.finished:
                    finished.append(live.seq.request_id)
        for request_id in finished:  # leave now, not when the consumer next runs: no round for a finished request
            await self._finish(request_id)
        t3 = time.perf_counter()
        self.stats.timings.record(len(rows), t1 - t0, t2 - t1, t3 - t2)
        # the round's critical path minus the workers' own compute: RPC, serialization, event-loop hops
        orchestration = (t2 - t0) - draft_compute - result.get("seconds", 0.0)
        self.stats.orchestration_seconds += orchestration
        observe(self.metrics.round, [len(d) for d in drafts], accepted, t1 - t0, t2 - t1, orchestration)
        self.stats.draft_compute_seconds += draft_compute
        self.stats.verify_compute_seconds += result.get("seconds", 0.0)

    async def _propose(self, rows: list[_Live], ks: list[int]
                       ) -> tuple[list[list[int]], dict[int, np.ndarray], float]:
        drafts: list[list[int]] = [[] for _ in rows]
        if not any(ks):
            return drafts, {}, 0.0
        if self.ngram is not None:
            asked = [b for b, k in enumerate(ks) if k > 0]
            # the generator is unused: lookup is deterministic
            proposal = self.ngram.propose([DraftRequest(rows[b].seq.request_id, rows[b].seq.tokens, ks[b],
                                                        rows[b].seq.params, rows[b].seq.generator) for b in asked])
            for i, b in enumerate(asked):
                drafts[b] = proposal.token_ids[i, : int(proposal.num_tokens[i])].tolist()
            return drafts, {}, 0.0
        by_lease: dict[str, list[int]] = {}
        for b, (live, k) in enumerate(zip(rows, ks)):
            if k > 0 and live.draft is not None:
                by_lease.setdefault(live.draft.key, []).append(b)
        probs: dict[int, np.ndarray] = {}
        compute = 0.0
        for members in by_lease.values():
            lease = rows[members[0]].draft
            calls = [DraftCall(rows[b].delta(rows[b].draft_sent), ks[b]) for b in members]
            try:
                result = await lease.propose(calls)
            except ReplicaGone:
                await self._replace_draft([rows[b] for b in members])
                continue  # these rows verify without drafts this round: output unchanged
            compute += result.get("seconds", 0.0)
            for i, b in enumerate(members):
                rows[b].draft_sent = rows[b].seq.num_tokens
                drafts[b] = result["drafts"][i]
                if i in result["probs"]:
                    probs[b] = result["probs"][i]
        return drafts, probs, compute

    def _accept(self, rows: list[_Live], drafts: list[list[int]], draft_probs: dict[int, np.ndarray],
                result: dict) -> tuple[list[RequestOutput], list[int]]:
        emitted: dict[int, tuple[list[int], int]] = {}
        for b, argmax in result["argmax"].items():
            emitted[b] = greedy_accept(drafts[b], argmax)
        sampled = sorted(result["probs"])
        if sampled:
            k_max = max(len(drafts[b]) for b in sampled)
            vocab = result["probs"][sampled[0]].shape[-1]
            draft_ids = torch.full((len(sampled), k_max), -1, dtype=torch.long)
            target_probs = torch.zeros(len(sampled), k_max + 1, vocab)
            q = torch.zeros(len(sampled), k_max, vocab) if self.ngram is None else None
            for i, b in enumerate(sampled):
                n = len(drafts[b])
                draft_ids[i, :n] = torch.tensor(drafts[b], dtype=torch.long)
                target_probs[i, : n + 1] = torch.from_numpy(result["probs"][b])
                if q is not None and n:
                    q[i, :n] = torch.from_numpy(draft_probs[b][:n])
            res = rejection_sample(draft_ids, q, target_probs, torch.tensor([len(drafts[b]) for b in sampled]),
                                   [rows[b].seq.generator for b in sampled])
            for i, b in enumerate(sampled):
                emitted[b] = (res.tokens(i), int(res.num_accepted[i]))
        outputs, accepted_counts = [], []
        for b, live in enumerate(rows):
            tokens, accepted = emitted[b]
            out = live.seq.commit(tokens, len(drafts[b]), accepted)
            self.stats.spec.record(len(drafts[b]), accepted, len(out.new_token_ids))
            outputs.append(out)
            accepted_counts.append(accepted)
        return outputs, accepted_counts

    async def _replace_target(self, rows: list[_Live]) -> None:
        self.stats.replica_failures += 1
        for live in rows:
            live.failures += 1
            await live.target.close()
            if live.failures > MAX_REPLICA_FAILURES:
                live.queue.put_nowait(ReplicaGone("the target replica failed repeatedly; giving up on this request"))
                self._live.pop(live.seq.request_id, None)
                continue
            try:
                live.target = await self.broker.target(live.seq.request_id)
                live.target_sent = 0  # the new replica re-prefills from token 0
            except Exception as exc:
                live.queue.put_nowait(exc)
                self._live.pop(live.seq.request_id, None)

    async def _replace_draft(self, rows: list[_Live]) -> None:
        self.stats.replica_failures += 1
        for live in rows:
            await live.draft.close()
            try:
                live.draft = await self.broker.draft(live.seq.request_id)
                live.draft_sent = 0
            except Exception:  # no draft replica right now: decode plainly until one is back
                logger.warning("no draft replica available; request continues with plain decoding")
                live.draft = None
