"""The router's round loop: batches live requests into speculative rounds over their leased Draft/Target workers.

One asyncio task per router replica. Each round groups the live sequences by the Target replica they are pinned to and
runs one round per group at once (deployments/router/round.py: plan, draft, verify, accept, top to bottom); a long
prompt is sent one `prefill_chunk` per round instead (deployments/router/prompt_chunks.py). A request is admitted under
the router's limit (deployments/router/admission.py), leases its Target replica when it starts (waiting while its KV
cache is full) and its Draft replica on the first round its plan gives it drafts: one that never drafts (under load the
plan keeps K at 0) never holds a Draft lease. Requests join between rounds and leave when finished or cancelled, closing
their leases, which frees their caches at once. A replica that dies mid-request is replaced by a new lease and the
sequence is re-sent from token 0 (re-prefill: deployments/router/recovery.py); committed tokens never change, so the
output does not either.

Each request's K comes from engine/spec/plan.py: with `adaptive`, from its observed acceptance and the measured cost
of a round at the group's batch size (the replicas measure their costs at start, or a calibration file gives
them: deployments/router/round_costs.py); otherwise the fixed `max_batch_for_speculation` threshold.

With `overlap`, the draft worker drafts round r+1 while the target verifies round r (deployments/router/draft_ahead.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deployments.config import SpecServeConfig
from deployments.errors import RequestFailed
from deployments.metrics import observe
from deployments.router.admission import Admission, AdmissionSlot
from deployments.router.live import LeaseBroker, LiveRequest
from deployments.router.pause import RoundGate
from deployments.router.prompt_chunks import PromptChunks
from deployments.router.recovery import Recovery
from deployments.router.round import GroupRound, ended
from deployments.router.round_costs import RoundCosts
from engine.factory import DraftSource
from engine.request.sampling import SamplingParams
from engine.request.sequence import RequestOutput, SequenceState
from engine.spec.options import SpeculationOptions
from engine.spec.plan import TreeSettings
from engine.spec.policy import AcceptanceTracker, CostProfile
from engine.spec.stats import EngineTimings, SpecStats

logger = logging.getLogger("ray.serve")

GAUGE_REFRESH_S = 1.0  # while idle, the load gauges are set again this often


@dataclass
class SchedulerConfig:
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int
    draft: DraftSource  # where drafts come from (engine/factory.py): the router's own proposer, Draft workers, none
    max_batch_for_speculation: int = 4  # without `adaptive`
    max_live_sequences: int = 64
    adaptive: bool = False  # K per request from acceptance and measured costs (engine/spec/plan.py)
    profile: CostProfile | None = None  # costs from a calibration file; None: the leased replicas' own
    overlap: bool = False  # draft round r+1 during round r's verify
    decode_ahead: bool = False  # mark rows that will not draft next round for the target to decode ahead
    max_queue_wait_s: float = 30.0  # how long a request waits for a free KV-cache slot (admission.py), then 503
    prefill_chunk: int = 256  # prompt tokens sent per round: a long prompt stalls running streams one chunk a round
    tree: TreeSettings = TreeSettings()  # token trees (engine/spec/plan.plan_trees)

    @classmethod
    def of(cls, config: SpecServeConfig, eos_token_ids: frozenset[int]) -> "SchedulerConfig":
        """The round loop's settings from the application's one config."""
        spec, draft = config.speculation, config.draft_source()
        return cls(
            max_model_len=config.model.max_model_len, eos_token_ids=eos_token_ids,
            num_speculative_tokens=spec.num_speculative_tokens if draft.drafts else 0, draft=draft,
            max_batch_for_speculation=spec.max_batch_for_speculation,
            max_live_sequences=config.limits.max_live_sequences_per_router, adaptive=spec.adaptive,
            profile=CostProfile.from_json(spec.calibration) if spec.calibration else None,
            overlap=spec.overlap and draft.remote, decode_ahead=spec.decode_ahead,
            max_queue_wait_s=config.limits.max_queue_wait_s, prefill_chunk=config.runner.prefill_chunk,
            tree=TreeSettings(spec.tree, spec.tree_nodes))


@dataclass
class SchedulerStats:
    spec: SpecStats = field(default_factory=SpecStats)
    timings: EngineTimings = field(default_factory=EngineTimings)
    orchestration_seconds: float = 0.0  # round wall time minus the workers' own compute, summed
    draft_lease_seconds: float = 0.0  # rounds' waits for requests' first Draft leases (not in orchestration)
    draft_compute_seconds: float = 0.0  # the draft workers' own compute, summed
    verify_compute_seconds: float = 0.0  # the target workers' own compute (rank 0), summed
    target_draft_compute_seconds: float = 0.0  # of that, a drafter's inside the target (self, Medusa, EAGLE-3)
    prefill_chunks: int = 0  # prompt chunks sent ahead of a long prompt's first round
    draft_prefill_chunks: int = 0  # of those, the ones its Draft worker read too
    replica_failures: int = 0
    ahead_drafts: int = 0  # rows drafted ahead (overlap)
    ahead_used: int = 0  # of those, rows whose guess was right and whose next round used the draft
    ahead_cancelled: int = 0  # ahead draft calls stopped early because no row could use them
    chained_rounds: int = 0  # round groups whose draft worker handed its drafts straight to the target worker
    prompt_tokens: int = 0  # of admitted requests
    cached_prompt_tokens: int = 0  # of those, the ones the target workers read from their prefix caches

    def note_cached(self, rows: list[LiveRequest], cached: dict[int, int]) -> None:
        """A verify call's prefix-cache hits (VerifyResult.cached_tokens) to its rows' requests and the totals."""
        for b, count in cached.items():
            before = rows[b].seq.num_cached_tokens
            rows[b].seq.add_cached_tokens(count)
            self.cached_prompt_tokens += rows[b].seq.num_cached_tokens - before


class Scheduler:
    def __init__(self, config: SchedulerConfig, tokenizer, broker: LeaseBroker) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.broker = broker
        self.stats = SchedulerStats()
        self._live: dict[str, LiveRequest] = {}
        # requests in the round now in flight, and those of them that ended (their client gone) before it came back:
        # their leases close when the round is back, so no call of it reaches a worker that has freed the sequence
        self._in_round: set[str] = set()
        self._ended_in_round: list[LiveRequest] = []
        self.admission = Admission(config.max_live_sequences, config.max_queue_wait_s)
        self.space = self.admission.space  # requests waiting for a free KV-cache slot
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.gate = RoundGate()  # pausing (`pause`): no round starts
        self._ids = itertools.count()
        self.costs = RoundCosts(config.adaptive, config.draft.remote, config.profile)
        # acceptance over all requests: a new request's prior, so it starts where its predecessors ended
        self.population = AcceptanceTracker()
        self.recovery = Recovery(broker, self._live, self.space, self.stats, lambda: self._wakeup.set())
        self.round = GroupRound(config, self.stats, self.costs, self.population, self.recovery, self._deliver)
        self.prompt_chunks = PromptChunks(config, self.stats, self.recovery, self._deliver)
        self.last_mean_k = 0.0  # mean K over the last round's rows (the `spec_decode_k` gauge)

    @property
    def metrics(self):
        """The Serve router replaces it with deployments.metrics.ServingMetrics."""
        return self.round.metrics

    @metrics.setter
    def metrics(self, metrics) -> None:
        self.round.metrics = metrics

    @property
    def num_live(self) -> int:
        return len(self._live)

    def current_k(self) -> float:
        """Mean K of the last round's rows (0 while rounds decode plainly)."""
        return self.last_mean_k if self._live else 0.0

    def cost_profiles(self) -> dict[str, dict | None]:
        """The costs K is chosen by, for /stats (round_costs.RoundCosts.shown)."""
        return self.costs.shown()

    # ---- requests -------------------------------------------------------------------------------------------
    def admit(self) -> AdmissionSlot:
        """Take a place under the admission limit now (raises Overloaded when there is none)."""
        return self.admission.slot(len(self._live))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       speculation: SpeculationOptions = SpeculationOptions(), request_id: str | None = None,
                       slot: AdmissionSlot | None = None) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its per-round outputs; closing the iterator aborts it.

        `speculation` is the request's own (engine/spec/options.py): its K, `adaptive=False` to pin it to exactly K
        drafts per round (no acceptance or load adaptation), `overlap=False` to turn drafting ahead off for it (on a
        server that overlaps). A held `slot` (from `admit`) is the request's admission; without one it is admitted
        here.
        """
        request_id = request_id or f"req-{next(self._ids)}-{time.monotonic_ns()}"
        if slot is not None and slot.held:
            slot.release()  # becomes a waiting sequence below, with no await in between
        else:
            self.admission.check(len(self._live))
        k = speculation.k_or(self.config.num_speculative_tokens)
        # the request's seed is fixed here, at admission (its own, or drawn: SequenceState.seed); every worker that
        # ever serves it, after a failover too, draws its random numbers from it (engine/spec/randomness.py)
        seq = SequenceState.create(request_id, prompt_ids, params, k, self.config.max_model_len,
                                   self.config.eos_token_ids, self.tokenizer)
        self.stats.prompt_tokens += len(seq.prompt_ids)
        self.admission.waiting += 1
        try:
            live = await self._open(seq, speculation)
        finally:
            self.admission.waiting -= 1
        live.overlap = self.config.overlap and speculation.overlap is not False
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

    async def _open(self, seq: SequenceState, speculation: SpeculationOptions) -> LiveRequest:
        """A request's Target lease; its Draft lease comes with its first drafting round (recovery.lease_drafts)."""
        target = await self.space.lease(lambda: self.broker.target(seq.request_id))
        return LiveRequest(seq=seq, queue=asyncio.Queue(), target=target, options=speculation,
                           tracker=AcceptanceTracker(prior=self.population.acceptance))

    async def _deliver(self, rows: list[LiveRequest], outputs: list[RequestOutput | RequestFailed]) -> None:
        """A round's outputs to their requests; finished ones leave now, not when their consumer next runs (no
        round for a finished request), and so do failed ones (their consumer raises the RequestFailed)."""
        finished = []
        for live, out in zip(rows, outputs):
            if live.seq.request_id in self._live:  # not aborted while the round was in flight
                live.queue.put_nowait(out)
                if ended(out):
                    finished.append(live.seq.request_id)
        # at once, not one after another: each tells its Target worker through the channel (a round trip)
        await asyncio.gather(*(self._finish(request_id, after_round=True) for request_id in finished))

    async def _finish(self, request_id: str, after_round: bool = False) -> None:
        """End a request: close its leases, which frees its sequences on the workers. `after_round`: it ended with
        a round that came back, so none of its round's calls is on the way, and its Target and Draft workers are told
        at once through their channels too (README, "Limits": a lease's release through Serve was seen to go
        missing). A draft drafted ahead may still be on the way to the Draft worker; should it re-create the sequence,
        the replica's sweep frees it (lease_ledger.py)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        if request_id in self._in_round and not after_round:
            # its round's calls are on the way: freeing the sequence now would fail that round's call for every row
            # in it (the worker no longer knows the sequence its delta continues); the round closes it when it is back
            self._ended_in_round.append(live)
            return
        await self._close(live, after_round)

    async def _close(self, live: LiveRequest, after_round: bool) -> None:
        """Close an ended request's leases, which frees its sequences on the workers (`_finish`)."""
        if after_round:  # the Draft worker too: a CI run saw a Draft replica count leases whose ends it never saw
            held = [lease for lease in (None if live.reletting else live.target, live.draft) if lease is not None]
            await asyncio.gather(*(lease.release() for lease in held))
        if not live.reletting:  # a dead replica's lease was closed already
            await live.target.close()
            self.space.freed()
        if live.draft is not None:
            await live.draft.close()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()  # a fresh one: the last loop's may be bound to a loop that is gone
            self.gate.renew()
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---- pausing --------------------------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop running rounds, keeping every request (new ones are admitted and wait), once the round in flight is
        back (deployments/router/pause.py; a draft drafted ahead with `overlap` may still be on its way back)."""
        await self.gate.pause()

    def resume(self) -> None:
        """Run rounds again after `pause`; the kept requests continue where they stopped."""
        self.gate.resume()
        self._wakeup.set()

    # ---- rounds ---------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            # paused, or nothing can run a round now
            if self.gate.paused or not any(not live.reletting for live in self._live.values()):
                observe(self.metrics.load, len(self._live), self.admission.waiting, 0.0)
                self._wakeup.clear()
                try:  # Ray ages out a gauge that is not set again within ~2 export intervals: refresh while waiting
                    await asyncio.wait_for(self.gate.resumed() if self.gate.paused else self._wakeup.wait(),
                                           GAUGE_REFRESH_S)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                async with self.gate.round() as open_:
                    if open_:
                        await self._round()
            except Exception as exc:  # a bug must not leave requests hanging: fail them all, keep serving
                logger.exception("speculative round failed")
                for live in list(self._live.values()):
                    live.queue.put_nowait(RuntimeError(f"internal error in the speculative round: {exc}"))
                    await self._finish(live.seq.request_id)

    async def _round(self) -> None:
        groups: dict[str, list[LiveRequest]] = {}
        prefilling: dict[str, list[LiveRequest]] = {}
        for live in self._live.values():
            if live.reletting:
                continue
            if live.seq.num_tokens - live.target_sent > self.config.prefill_chunk:
                # a long prompt (or a re-prefill): one chunk this round, no token yet
                prefilling.setdefault(live.target.key, []).append(live)
            else:
                groups.setdefault(live.target.key, []).append(live)
        plans = [(rows, self._ks(rows)) for rows in groups.values()]
        all_ks = [k for _, ks in plans for k in ks]
        self.last_mean_k = sum(all_ks) / len(all_ks) if all_ks else 0.0
        observe(self.metrics.load, len(self._live), self.admission.waiting, self.last_mean_k)
        self._in_round = {live.seq.request_id for rows in [*groups.values(), *prefilling.values()] for live in rows}
        try:
            await asyncio.gather(*(self.round.run(rows, ks) for rows, ks in plans),
                                 *(self.prompt_chunks.send(lives) for lives in prefilling.values()))
        finally:
            self._in_round = set()
            ended, self._ended_in_round = self._ended_in_round, []
            await asyncio.gather(*(self._close(live, after_round=True) for live in ended))

    def _ks(self, rows: list[LiveRequest]) -> list[int]:
        """Each row's draft length this round (GroupRound.plan), counting the requests about to join."""
        joining = self.admission.joining()
        return self.round.plan(rows, joining, len(self._live) + joining)
