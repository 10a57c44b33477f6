"""The router's round loop: batches live requests into speculative rounds over their leased Draft/Target workers.

One asyncio task per router replica. Each round groups the live sequences by the Target replica they are pinned to
and, per group, makes one chained call (the Draft worker drafts for the batch and hands its tokens to the Target
worker, which verifies and answers: deployments/channel_client.py), or one batched draft call per Draft replica and
one batched verify call where a group's rows draft on several Draft replicas, draft ahead, or use n-gram lookup; the
rejection sampler (engine/, pure) runs here. A request leases its Target replica when it starts (waiting while
its KV cache is full: deployments/admission.py) and its Draft replica on the first round its plan gives it drafts:
one that never drafts (under load the plan keeps K at 0) never holds a Draft lease. Requests join between rounds
and leave when finished or cancelled, closing their leases, which frees their caches at once. A replica that dies
mid-request is replaced by a new lease and the sequence is re-sent from token 0 (re-prefill); committed tokens never
change, so the output does not either.

Each request's K comes from engine/policy.py: with `adaptive`, from its observed acceptance and the measured cost
of a round at the group's batch size (the replicas measure their costs at start, or a calibration file gives
them: deployments/round_costs.py); otherwise the fixed `max_batch_for_speculation` threshold.

With `overlap`, the draft worker drafts round r+1 while the target verifies round r (deployments/ahead.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.policy import AcceptanceTracker, CostProfile, load_adjusted_k
from engine.round_plan import RowOutlook, plan_round
from engine.proposers import DraftRequest, NgramProposer
from engine.rejection import greedy_accept, rejection_sample
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, SequenceState
from engine.stats import EngineTimings, SpecStats

from .admission import SpaceWait
from .ahead import AheadDrafts
from .errors import ChainBroken, DraftGone, Overloaded, ReplicaGone
from .metrics import NullMetrics, observe
from .round_costs import RoundCosts
from .live import DraftLease, LeaseBroker, LiveRequest
from .messages import CostObservation, DraftCall, DraftResult, VerifyCall, VerifyResult

logger = logging.getLogger("ray.serve")

MAX_REPLICA_FAILURES = 3  # per request, before it is answered with an error
DRAFT_LEASE_RETRY_S = 5.0  # after a failed Draft lease, the request decodes plainly this long before trying again
GAUGE_REFRESH_S = 1.0  # while idle, the load gauges are set again this often


class AdmissionSlot:
    """A place under the router's admission limit, taken at the HTTP door before the body is parsed or tokenized,
    so that a refusal costs no parsing; the request's `generate` consumes it. Released (idempotently) when the
    request ends before reaching the scheduler (a 4xx, a dropped connection)."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self._scheduler = scheduler
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._scheduler._reserved -= 1


@dataclass
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int
    draft_mode: str  # "model" | "ngram" | "none"
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch_for_speculation: int = 4  # without `adaptive`
    max_live_sequences: int = 64
    adaptive: bool = False  # K per request from acceptance and measured costs (engine/policy.py)
    profile: CostProfile | None = None  # costs from a calibration file; None: the leased replicas' own
    overlap: bool = False  # draft round r+1 during round r's verify
    max_queue_wait_s: float = 30.0  # how long a request waits for a free KV-cache slot (admission.py), then 503
    prefill_chunk: int = 256  # prompt tokens sent per round: a long prompt stalls running streams one chunk a round


@dataclass
class SchedulerStats:
    spec: SpecStats = field(default_factory=SpecStats)
    timings: EngineTimings = field(default_factory=EngineTimings)
    orchestration_seconds: float = 0.0  # round wall time minus the workers' own compute, summed
    draft_lease_seconds: float = 0.0  # rounds' waits for requests' first Draft leases (not in orchestration)
    draft_compute_seconds: float = 0.0  # the draft workers' own compute, summed
    verify_compute_seconds: float = 0.0  # the target workers' own compute (rank 0), summed
    prefill_chunks: int = 0  # prompt chunks sent ahead of a long prompt's first round
    replica_failures: int = 0
    ahead_drafts: int = 0  # rows drafted ahead (overlap)
    ahead_used: int = 0  # of those, rows whose guess was right and whose next round used the draft
    ahead_cancelled: int = 0  # ahead draft calls stopped early because no row could use them
    chained_rounds: int = 0  # round groups whose draft worker handed its drafts straight to the target worker


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer, broker: LeaseBroker) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.broker = broker
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max) if config.draft_mode == "ngram" else None
        self.stats = SchedulerStats()
        self.metrics = NullMetrics()  # the Serve router replaces it with deployments.metrics.ServingMetrics
        self._live: dict[str, LiveRequest] = {}
        self._waiting = 0  # admitted, waiting for leases (some of them for a free KV-cache slot: `space`)
        self.space = SpaceWait(config.max_queue_wait_s)
        self._reserved = 0  # admission slots taken at the door, not yet in `generate`
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self.ahead = AheadDrafts(self.stats, self._replace_live_drafts)
        self._relets: set[asyncio.Task] = set()
        self.costs = RoundCosts(config.adaptive, config.draft_mode, config.profile)
        # acceptance over all requests: a new request's prior, so it starts where its predecessors ended
        self.population = AcceptanceTracker()
        self.last_mean_k = 0.0  # mean K over the last round's rows (the `spec_decode_k` gauge)
        self._last_draft: DraftLease | None = None  # the latest Draft lease taken (its replica's measured costs)
        self._unchainable: set[tuple[str, str]] = set()  # (Draft, Target) replica keys whose chained round failed

    @property
    def num_live(self) -> int:
        return len(self._live)

    def current_k(self) -> float:
        """Mean K of the last round's rows (0 while rounds decode plainly)."""
        return self.last_mean_k if self._live else 0.0

    # ---- requests -------------------------------------------------------------------------------------------
    def _check_admission(self) -> None:
        if len(self._live) + self._waiting + self._reserved >= self.config.max_live_sequences:
            raise Overloaded(f"{len(self._live)} live and {self._waiting + self._reserved} starting sequences: at "
                             "the router's admission limit")

    def admit(self) -> AdmissionSlot:
        """Take a place under the admission limit now (raises Overloaded when there is none)."""
        self._check_admission()
        self._reserved += 1
        return AdmissionSlot(self)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, k: int | None = None,
                       request_id: str | None = None, adaptive: bool | None = None, overlap: bool | None = None,
                       slot: AdmissionSlot | None = None) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its per-round outputs; closing the iterator aborts it.

        `adaptive=False` pins the request to exactly `k` drafts per round (no acceptance or load adaptation);
        `overlap=False` turns drafting ahead off for it (on a server that overlaps). A held `slot` (from `admit`)
        is the request's admission; without one it is admitted here.
        """
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        if slot is not None and slot.held:
            slot.release()  # becomes a waiting sequence below, with no await in between
        else:
            self._check_admission()
        k = self.config.num_speculative_tokens if k is None else k
        seq = SequenceState.create(request_id, prompt_ids, params, k, self.config.max_model_len,
                                   self.config.eos_token_ids, self.tokenizer)
        self._waiting += 1
        try:
            live = await self._open(seq)
        finally:
            self._waiting -= 1
        live.fixed_k = adaptive is False
        live.overlap = self.config.overlap and overlap is not False
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

    async def _open(self, seq: SequenceState) -> LiveRequest:
        """A request's Target lease; its Draft lease comes with its first drafting round (`_lease_drafts`)."""
        target = await self.space.lease(lambda: self.broker.target(seq.request_id))
        return LiveRequest(seq=seq, queue=asyncio.Queue(), target=target,
                           tracker=AcceptanceTracker(prior=self.population.acceptance))

    async def _finish(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        if not live.reletting:  # a dead replica's lease was closed already
            await live.target.close()
            self.space.freed()
        if live.draft is not None:
            await live.draft.close()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()  # a fresh one: the last loop's may be bound to a loop that is gone
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---- rounds ---------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not any(not live.reletting for live in self._live.values()):  # nothing can run a round now
                observe(self.metrics.load, len(self._live), self._waiting, 0.0)
                self._wakeup.clear()
                try:  # Ray ages out a gauge that is not set again within ~2 export intervals: refresh while idle
                    await asyncio.wait_for(self._wakeup.wait(), GAUGE_REFRESH_S)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                await self._round()
            except Exception as exc:  # a bug must not leave requests hanging: fail them all, keep serving
                logger.exception("speculative round failed")
                for live in list(self._live.values()):
                    live.queue.put_nowait(RuntimeError(f"internal error in the speculative round: {exc}"))
                    await self._finish(live.seq.request_id)

    async def _round(self) -> None:
        groups: dict[str, list[LiveRequest]] = {}
        prefilling = []
        for live in self._live.values():
            if live.reletting:
                continue
            if live.seq.num_tokens - live.target_sent > self.config.prefill_chunk:
                prefilling.append(live)  # a long prompt (or a re-prefill): one chunk this round, no token yet
            else:
                groups.setdefault(live.target.key, []).append(live)
        plans = [(rows, self._ks(rows)) for rows in groups.values()]
        all_ks = [k for _, ks in plans for k in ks]
        self.last_mean_k = sum(all_ks) / len(all_ks) if all_ks else 0.0
        observe(self.metrics.load, len(self._live), self._waiting, self.last_mean_k)
        await asyncio.gather(*(self._round_group(rows, ks) for rows, ks in plans),
                             *(self._prefill_chunk(live) for live in prefilling))

    async def _prefill_chunk(self, live: LiveRequest) -> None:
        """Send the next `prefill_chunk` tokens of a long prompt to its target worker (chunked prefill, as vLLM's
        and SGLang's schedulers do): the worker takes turns between this call and the running rows' round, so those
        wait for at most one chunk per round instead of the whole prompt. The chunk's logits are not needed."""
        end = live.target_sent + self.config.prefill_chunk
        try:
            await live.target.verify([VerifyCall(live.delta(live.target_sent, end), [])])
        except ReplicaGone:
            await self._replace_target([live])
            return
        live.target_sent = end
        self.stats.prefill_chunks += 1

    def _ks(self, rows: list[LiveRequest]) -> list[int]:
        """Each row's draft length this round: with a cost profile, planned for the group as a whole
        (engine/round_plan.py), else the fixed `max_batch_for_speculation` threshold.

        The batch the costs are taken at counts the requests already admitted and waiting for their leases: they join
        the next round, and a draft started now (its prefill first) would pay only at the batch size they make. Those
        waiting for a free KV-cache slot are not counted: they join when a request ends.
        """
        joining = self._waiting - self.space.waiting
        profile = self.costs.policy_profile(self._group_draft(rows), rows[0].target)
        caps = [live.seq.k if self._may_draft(live) else 0 for live in rows]
        model = self.config.draft_mode == "model"
        if profile is not None:
            outlooks = [RowOutlook(acceptance=live.tracker.acceptance, cap=cap,
                                   # tokens the draft worker has not read yet (all, before the first Draft lease;
                                   # n-gram lookup reads nothing)
                                   behind=live.seq.num_tokens - live.draft_sent if model else 0,
                                   remaining=live.seq.remaining(), fixed=live.fixed_k,
                                   wants_probe=live.tracker.wants_probe)
                        for live, cap in zip(rows, caps)]
            ks = plan_round(profile, outlooks, len(rows) + joining)
        else:
            live_now = len(self._live) + joining
            ks = [cap if live.fixed_k else load_adjusted_k(cap, live_now, self.config.max_batch_for_speculation)
                  for live, cap in zip(rows, caps)]
        return [live.seq.draft_len(k) for live, k in zip(rows, ks)]

    def cost_profiles(self) -> dict[str, dict | None]:
        """The costs K is chosen by, for /stats (round_costs.RoundCosts.shown)."""
        return self.costs.shown()

    def _may_draft(self, live: LiveRequest) -> bool:
        if self.config.draft_mode != "model" or live.draft is not None:
            return True
        return time.monotonic() >= live.draft_retry_at  # a Draft lease can be taken when the plan wants drafts

    def _group_draft(self, rows: list[LiveRequest]) -> DraftLease | None:
        """The Draft lease a group's costs are planned with: one of its rows', else the last one this router took
        (Draft replicas of one deployment measure alike); None before any."""
        return next((live.draft for live in rows if live.draft is not None), self._last_draft)

    async def _round_group(self, rows: list[LiveRequest], ks: list[int]) -> None:
        if self.ngram is None and any(ks):  # rows drafting for the first time take their Draft lease (set-up work,
            start = time.perf_counter()  # once per request: counted apart from the round's orchestration)
            await self._lease_drafts([live for live, k in zip(rows, ks)
                                      if k > 0 and live.ready is None and live.draft is None])
            self.stats.draft_lease_seconds += time.perf_counter() - start
        t0 = time.perf_counter()
        drafts, draft_probs, by_lease = self._plan_drafts(rows, ks)
        target = rows[0].target
        result, aheads = None, []
        costs: list[CostObservation] = []  # the round's cost observations, made once its result is in hand
        members = next(iter(by_lease.values())) if len(by_lease) == 1 and not self.config.overlap else None
        if members is not None and self._chainable(rows[members[0]]):
            calls = [VerifyCall(live.delta(live.target_sent), []) for live in rows]  # drafts are filled in there
            try:  # one draft worker: it hands its drafts straight to the target worker
                result, draft_compute = await self._chained(rows, ks, members, calls, drafts, draft_probs, costs)
            except ReplicaGone:
                await self._replace_target(rows)
                return
            t1 = t0 + draft_compute  # the router sees no boundary between drafting and verifying: the compute
        else:
            draft_compute = await self._draft_calls(rows, ks, by_lease, drafts, draft_probs, costs)
            t1 = time.perf_counter()
        if result is None:
            calls = [VerifyCall(live.delta(live.target_sent), drafts[b]) for b, live in enumerate(rows)]
            aheads = self.ahead.start(rows, drafts) if self.config.overlap else []
            try:
                result = await target.verify(calls)
            except ReplicaGone:
                await self.ahead.settle(aheads, rows, drafts, None, None)
                await self._replace_target(rows)
                return
            except BaseException:
                await self.ahead.settle(aheads, rows, drafts, None, None)
                raise
        else:
            self.stats.chained_rounds += 1
        for live in rows:
            live.target_sent = live.seq.num_tokens
        t2 = time.perf_counter()
        costs.append(CostObservation(self._group_draft(rows), target, "verify", calls, max(len(d) for d in drafts),
                                     result.seconds))
        for observation in costs:
            self.costs.observe(observation)
        outputs, accepted = self._accept(rows, drafts, draft_probs, result)
        finished = []
        for live, out in zip(rows, outputs):
            if live.seq.request_id in self._live:  # not aborted while the round was in flight
                live.queue.put_nowait(out)
                if out.finished:
                    finished.append(live.seq.request_id)
        for request_id in finished:  # leave now, not when the consumer next runs: no round for a finished request
            await self._finish(request_id)
        await self.ahead.settle(aheads, rows, drafts, accepted, [out.finished for out in outputs])
        t3 = time.perf_counter()
        self.stats.timings.record(len(rows), t1 - t0, t2 - t1, t3 - t2)
        # the round's critical path minus the workers' own compute: RPC, serialization, event-loop hops
        orchestration = (t2 - t0) - draft_compute - result.seconds
        self.stats.orchestration_seconds += orchestration
        self.costs.observe_overhead(self._group_draft(rows), target, orchestration)
        observe(self.metrics.round, [len(d) for d in drafts], accepted, t1 - t0, t2 - t1, orchestration)
        self.stats.draft_compute_seconds += draft_compute
        self.stats.verify_compute_seconds += result.seconds

    def _plan_drafts(self, rows: list[LiveRequest], ks: list[int]
                     ) -> tuple[list[list[int]], dict[int, np.ndarray], dict[str, list[int]]]:
        """The round's drafts that need no draft call (made ahead, or n-gram lookup), with their probabilities, and
        the rows that draft by Draft lease."""
        drafts: list[list[int]] = [[] for _ in rows]
        probs: dict[int, np.ndarray] = {}
        by_lease: dict[str, list[int]] = {}
        ready = [live.ready for live in rows]
        for live in rows:
            live.ready = None  # a draft made ahead serves the round right after it, or nobody
        if not any(ks):
            return drafts, probs, by_lease
        if self.ngram is not None:
            asked = [b for b, k in enumerate(ks) if k > 0]
            # the generator is unused: lookup is deterministic
            proposal = self.ngram.propose([DraftRequest(rows[b].seq.request_id, rows[b].seq.tokens, ks[b],
                                                        rows[b].seq.params, rows[b].seq.generator) for b in asked])
            for i, b in enumerate(asked):
                drafts[b] = proposal.token_ids[i, : int(proposal.num_tokens[i])].tolist()
            return drafts, probs, by_lease
        for b, (live, k) in enumerate(zip(rows, ks)):
            if k > 0 and ready[b] is not None:
                self.stats.ahead_used += 1
                drafts[b] = ready[b][0][:k]
                if ready[b][1] is not None:
                    probs[b] = ready[b][1][:k]
            elif k > 0 and live.draft is not None:
                by_lease.setdefault(live.draft.key, []).append(b)
        return drafts, probs, by_lease

    async def _draft_calls(self, rows: list[LiveRequest], ks: list[int], by_lease: dict[str, list[int]],
                           drafts: list[list[int]], probs: dict[int, np.ndarray], costs: list[CostObservation]) -> float:
        """Each Draft lease's rows drafted by a call of their own (filled into `drafts`, `probs`); returns the draft
        workers' compute seconds."""
        compute = 0.0
        for members in by_lease.values():
            calls = [DraftCall(rows[b].draft_delta([]), ks[b]) for b in members]
            try:
                result = await rows[members[0]].draft.propose(calls)
            except ReplicaGone:
                await self._replace_draft([rows[b] for b in members])
                continue  # these rows verify without drafts this round: output unchanged
            compute += self._take_drafts(rows, ks, members, calls, result, drafts, probs, costs)
        return compute

    async def _chained(self, rows: list[LiveRequest], ks: list[int], members: list[int], verify_calls: list[VerifyCall],
                       drafts: list[list[int]], probs: dict[int, np.ndarray], costs: list[CostObservation]
                       ) -> tuple[VerifyResult | None, float]:
        """Draft `members` and verify every row in one chained call (the draft worker hands its drafts straight to
        the target worker, which answers: channel_client.AsyncChannels.chain). Returns the verify result and the
        draft's compute seconds; (None, 0.0) when the draft worker failed, and the round must verify without its
        drafts. Raises ReplicaGone when the target worker failed."""
        lease = rows[members[0]].draft
        calls = [DraftCall(rows[b].draft_delta([]), ks[b]) for b in members]
        try:
            result = await lease.chain(calls, rows[0].target, verify_calls, members)
        except DraftGone:
            await self._replace_draft([rows[b] for b in members])
            return None, 0.0
        except ChainBroken as exc:  # the draft is fine but cannot reach the target: a verify of its own tells more
            logger.warning("chained round failed (%s); this Draft/Target pair's rounds make two calls from now on",
                           exc)
            self._unchainable.add((lease.key, rows[0].target.key))
            return None, 0.0
        return result, self._take_drafts(rows, ks, members, calls, result.draft, drafts, probs, costs)

    def _chainable(self, live: LiveRequest) -> bool:
        return (live.draft.key, live.target.key) not in self._unchainable

    def _take_drafts(self, rows: list[LiveRequest], ks: list[int], members: list[int], calls: list[DraftCall],
                     result: DraftResult, drafts: list[list[int]], probs: dict[int, np.ndarray], costs: list[CostObservation]
                     ) -> float:
        """Fill a draft call's result into the round's `drafts` and `probs` (its cost observation into `costs`);
        returns its compute seconds."""
        seconds = result.seconds
        costs.append(CostObservation(rows[members[0]].draft, rows[members[0]].target, "draft", calls,
                                     max(ks[b] for b in members), seconds))
        for i, b in enumerate(members):
            drafts[b] = result.drafts[i]
            if i in result.probs:
                probs[b] = result.probs[i]
        return seconds

    def _accept(self, rows: list[LiveRequest], drafts: list[list[int]], draft_probs: dict[int, np.ndarray],
                result: VerifyResult) -> tuple[list[RequestOutput], list[int]]:
        emitted: dict[int, tuple[list[int], int]] = {}
        for b, argmax in result.argmax.items():
            emitted[b] = greedy_accept(drafts[b], argmax)
        sampled = sorted(result.probs)
        if sampled:
            k_max = max(len(drafts[b]) for b in sampled)
            vocab = result.probs[sampled[0]].shape[-1]
            draft_ids = torch.full((len(sampled), k_max), -1, dtype=torch.long)
            target_probs = torch.zeros(len(sampled), k_max + 1, vocab)
            q = torch.zeros(len(sampled), k_max, vocab) if self.ngram is None else None
            for i, b in enumerate(sampled):
                n = len(drafts[b])
                draft_ids[i, :n] = torch.tensor(drafts[b], dtype=torch.long)
                target_probs[i, : n + 1] = torch.from_numpy(result.probs[b])
                if q is not None and n:
                    q[i, :n] = torch.from_numpy(draft_probs[b][:n])
            res = rejection_sample(draft_ids, q, target_probs, torch.tensor([len(drafts[b]) for b in sampled]),
                                   [rows[b].seq.generator for b in sampled])
            for i, b in enumerate(sampled):
                emitted[b] = (res.tokens(i), int(res.num_accepted[i]))
        outputs, accepted_counts = [], []
        for b, live in enumerate(rows):
            tokens, accepted = emitted[b]
            live.tracker.record(len(drafts[b]), accepted)
            self.population.record(len(drafts[b]), accepted)
            out = live.seq.commit(tokens, len(drafts[b]), accepted)
            self.stats.spec.record(len(drafts[b]), accepted, len(out.new_token_ids))
            outputs.append(out)
            accepted_counts.append(accepted)
        return outputs, accepted_counts

    async def _replace_target(self, rows: list[LiveRequest]) -> None:
        """Lease another Target replica for these rows in a task of its own: taking a lease can wait for Serve
        to replace the dead replica, and meanwhile the round loop goes on for every other request."""
        self.stats.replica_failures += 1
        for live in rows:
            live.failures += 1
            live.reletting = True
            await live.target.close()
        task = asyncio.get_running_loop().create_task(self._relet(rows))
        self._relets.add(task)  # keep a reference until it is done
        task.add_done_callback(self._relets.discard)

    async def _relet(self, rows: list[LiveRequest]) -> None:
        for live in rows:
            request_id = live.seq.request_id
            if self._live.get(request_id) is not live:
                continue  # aborted meanwhile
            if live.failures > MAX_REPLICA_FAILURES:
                await self._drop(live, ReplicaGone("the target replica failed repeatedly; giving up on this request"))
                continue
            try:
                target = await self.space.lease(lambda: self.broker.target(request_id), starting=False)
            except Exception as exc:
                await self._drop(live, exc)
                continue
            if self._live.get(request_id) is not live:
                await target.close()  # aborted while the lease was being taken
                continue
            live.target, live.target_sent, live.reletting = target, 0, False  # re-prefill from token 0
        self._wakeup.set()

    async def _drop(self, live: LiveRequest, exc: BaseException) -> None:
        """End a request with an error; its target lease is already closed."""
        self._live.pop(live.seq.request_id, None)
        live.queue.put_nowait(exc)
        if live.draft is not None:
            await live.draft.close()

    async def _replace_live_drafts(self, rows: list[LiveRequest]) -> None:
        """A draft worker died under an ahead draft: new draft leases for those of `rows` still live."""
        await self._replace_draft([live for live in rows if live.seq.request_id in self._live])

    async def _lease_drafts(self, rows: list[LiveRequest]) -> None:
        """Draft leases for rows about to draft for the first time (or again after losing theirs). A row that gets
        none decodes plainly this round and for DRAFT_LEASE_RETRY_S."""
        async def lease(live: LiveRequest) -> None:
            request_id = live.seq.request_id
            try:
                draft = await self.broker.draft(request_id)
            except Exception as exc:  # no Draft replica right now (overloaded, restarting): decode plainly meanwhile
                logger.warning("no draft lease (%s); the request decodes plainly for %.0f s", exc, DRAFT_LEASE_RETRY_S)
                live.draft_retry_at = time.monotonic() + DRAFT_LEASE_RETRY_S
                return
            if self._live.get(request_id) is not live:
                await draft.close()  # the request ended while the lease was being taken
                return
            live.draft, live.draft_sent, live.draft_extra = draft, 0, []
            self._last_draft = draft

        await asyncio.gather(*(lease(live) for live in rows))

    async def _replace_draft(self, rows: list[LiveRequest]) -> None:
        """The rows' Draft worker died: they verify without drafts this round and take a new Draft lease the next
        time their plan gives them drafts (reading their whole context again: the plan weighs that catch-up)."""
        self.stats.replica_failures += 1
        for live in rows:
            await live.draft.close()
            live.draft, live.ready, live.draft_extra, live.draft_sent = None, None, [], 0
