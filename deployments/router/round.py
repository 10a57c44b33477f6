"""One speculative round for the live requests leased to one Target replica, top to bottom.

1. Plan: each row's K (engine/spec/plan.plan_ks, the in-process engine's planner too: with a cost profile, else
   the fixed `max_batch_for_speculation` threshold); rows drafting for the first time take their Draft lease
   (deployments/router/recovery.py).
2. Draft: drafts at hand need no call (made ahead during the last round's verify: deployments/router/draft_ahead.py, or
   n-gram lookup); the others come from the rows' Draft workers. A drafter inside the target (`draft: self`,
   `medusa:DIR`) needs no call either: the router sends each row's K with its verify call, the target verifies the
   drafts it made for the row in the last call and drafts its next round before answering (engine/spec/verify.py).
3. Verify: with one Draft worker and no overlap, one chained call (the Draft worker drafts and hands its tokens to
   the Target worker, which verifies and answers: transport.client.AsyncChannels.chain); else one draft call per
   Draft lease, then one verify call (with `overlap`, while the next round's drafts are made ahead).
4. Accept: the target worker has sampled on its device (engine/spec/accept.verify_rows, the in-process engine's accept
   step too: greedy rows compare tokens, seeded rows by Gumbel coupling, the others by the rejection sampler) and
   answered tokens; each row commits them here (engine/spec/accept.commit) and the outputs are delivered. The router
   never holds a probability tensor: the compact proposals of drafts made ahead or by several Draft leases pass
   through it unread, inside the VerifyCalls.
A dead Target replica ends the round for its rows (they re-lease and re-prefill); a dead Draft replica's rows verify
without drafts. A row a worker failed (a RowFailure in its reply: its grammar would not compile there, say) ends its
own request with that error (RequestFailed), and commits nothing; the round's other rows go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from deployments.errors import ChainBroken, DraftGone, ReplicaGone, RequestFailed
from deployments.metrics import NullMetrics, observe
from deployments.router.draft_ahead import AheadDrafts
from deployments.router.live import DraftLease, LiveRequest
from deployments.router.recovery import Recovery
from deployments.router.round_costs import RoundCosts
from deployments.transport.messages import (
    CostObservation,
    DraftCall,
    DraftResult,
    RowFailure,
    VerifyCall,
    VerifyResult,
    WireProposal,
    head,
)
from engine.proposers.base import draft_rows
from engine.request.sequence import RequestOutput
from engine.spec.accept import commit
from engine.spec.plan import plan_rows, plan_trees
from engine.spec.policy import AcceptanceTracker
from engine.spec.tree import DraftTree

logger = logging.getLogger("ray.serve")


@dataclass
class Drafts:
    """A round's drafts by row, as they come in: made ahead or looked up, then each draft call's result."""

    tokens: list[list[int]]  # per row, its draft (empty: the row verifies without drafts)
    # row -> the compact proposal of its model drafts (unseeded sampled rows), forwarded unread to the target
    proposals: dict[int, WireProposal] = field(default_factory=dict)
    by_lease: dict[str, list[int]] = field(default_factory=dict)  # rows still to draft, by Draft lease key
    compute_seconds: float = 0.0  # the draft workers' own compute
    costs: list[CostObservation] = field(default_factory=list)  # the draft calls' measured costs
    failed: dict[int, RowFailure] = field(default_factory=dict)  # rows whose draft worker failed them (a grammar)
    trees: dict[int, DraftTree] = field(default_factory=dict)  # rows whose drafts are a tree (`tokens`: its tokens)

    def take(self, rows: list[LiveRequest], members: list[int], calls: list[DraftCall], result: DraftResult) -> None:
        """A draft call's result for rows `members` (call i drafted for row members[i])."""
        lease = rows[members[0]]
        self.costs.append(CostObservation(lease.draft, lease.target, "draft", calls, max(c.k for c in calls),
                                          result.seconds))
        self.compute_seconds += result.seconds
        for i, b in enumerate(members):
            self.tokens[b] = result.drafts[i]
            if i in result.proposals:
                self.proposals[b] = result.proposals[i]
            if i in result.parents:
                self.trees[b] = DraftTree(tuple(result.drafts[i]), tuple(result.parents[i]))
        for i, failure in result.failed.items():
            self.failed[members[i]] = failure


@dataclass
class RoundResult:
    """What one group's round did."""

    drafts: list[list[int]]  # per row, the drafts it verified
    outputs: list[RequestOutput | RequestFailed]  # per row, what it emitted, or why its request failed (a worker's
    # RowFailure: that request ends with the error, the round's other rows go on)
    accepted: list[int]  # per row, drafts accepted
    chained: bool  # drafted and verified in one chained call
    draft_seconds: float  # from the round's start to the drafts in hand
    verify_seconds: float  # from there to the verify's answer
    draft_compute: float  # the draft workers' own compute
    verify_compute: float  # the target worker's own compute
    delivery_seconds: float = 0.0  # from the answer to the outputs delivered (and drafts made ahead settled)
    ahead: bool = False  # every row was answered from a step decoded ahead (deployments/workers/decode_ahead.py)
    target_draft_compute: float = 0.0  # of verify_compute, a drafter inside the target's (the next round's drafts)


def ended(out: RequestOutput | RequestFailed) -> bool:
    """A row's request ends with this round's output (finished, or failed)."""
    return isinstance(out, RequestFailed) or out.finished


def verify_observations(draft: DraftLease | None, target, calls: list[VerifyCall], drafts: list[list[int]],
                        ks: list[int], verified: VerifyResult, in_target: bool) -> list[CostObservation]:
    """What a verify call tells the costs: its pass, unless a step decoded ahead answered it (that ran in another
    round's batch); and, from a target that drafts for itself, the part of the call it spent drafting the next
    round, a draft observation apart from the verify's."""
    seen = [] if verified.ahead_rows else [
        CostObservation(draft, target, "verify", calls, max(len(d) for d in drafts),
                        verified.seconds - verified.target_draft_seconds)]
    drafting = [b for b, k in enumerate(ks) if k > 0]
    if in_target and drafting and verified.target_draft_seconds > 0:
        seen.append(CostObservation(None, target, "draft", [calls[b] for b in drafting], max(ks),
                                    verified.target_draft_seconds))
    return seen


class GroupRound:
    """Runs rounds for groups of live requests that share a Target replica (the scheduler's round loop runs one per
    group at once)."""

    def __init__(self, config, stats, costs: RoundCosts, population: AcceptanceTracker, recovery: Recovery,
                 deliver: Callable[[list[LiveRequest], list[RequestOutput | RequestFailed]], Awaitable[None]]
                 ) -> None:
        self.config = config  # scheduler.SchedulerConfig
        self.stats = stats  # scheduler.SchedulerStats
        self.costs = costs
        self.population = population  # acceptance over all requests (a new request's prior)
        self.tree_population = AcceptanceTracker()  # the same over tree rounds (engine/spec/plan.plan_trees)
        self.recovery = recovery
        self._deliver = deliver  # hands the rows' outputs to their requests (and ends finished ones)
        self.metrics = NullMetrics()
        # a local proposer (n-gram lookup) runs here, in the router; a draft model's runs in the Draft workers
        self.local = config.draft.local
        self.in_target = config.draft.in_target  # the target drafts for itself: K travels in the verify call
        self.ahead = AheadDrafts(stats, recovery.replace_live_drafts)
        self._unchainable: set[tuple[str, str]] = set()  # (Draft, Target) replica keys whose chained round failed

    # ---- 1. plan ------------------------------------------------------------------------------------------------
    def plan(self, rows: list[LiveRequest], joining: int, live_now: int) -> list[int]:
        """Each row's draft length this round: with a cost profile, planned for the group as a whole
        (engine/spec/plan.py), else the fixed `max_batch_for_speculation` threshold over `live_now` sequences.

        The batch the costs are taken at counts the `joining` requests (admitted, taking their leases): they join
        the next round, and a draft started now (its prefill first) would pay only at the batch size they make.
        """
        sample = self.config.decode_ahead and self.costs.plain_sample(self.group_draft(rows), rows[0].target) > 0
        # a draft model reads the tokens its worker lacks first (all of them before the first Draft lease); in a
        # plain sample (round_costs.py) only the rows that pinned their K draft
        caps = [live.seq.k if self._may_draft(live) and (live.options.fixed or not sample) else 0 for live in rows]
        return plan_rows(self._profile(rows), rows, caps, self.config.draft.remote, len(rows) + joining, live_now,
                         self.config.max_batch_for_speculation, drafts_lag=self.in_target)

    def _profile(self, rows: list[LiveRequest]):
        """The round's costs (RoundCosts.policy_profile), plain rounds priced as decoded ahead for rows so marked."""
        return self.costs.policy_profile(self.group_draft(rows), rows[0].target,
                                         ahead=all(live.marked_ahead for live in rows))

    def _may_draft(self, live: LiveRequest) -> bool:
        if not self.config.draft.remote or live.draft is not None:
            return True
        return time.monotonic() >= live.draft_retry_at  # a Draft lease can be taken when the plan wants drafts

    def group_draft(self, rows: list[LiveRequest]) -> DraftLease | None:
        """The Draft lease a group's costs are planned with: one of its rows', else the last one this router took
        (Draft replicas of one deployment measure alike); None before any."""
        return next((live.draft for live in rows if live.draft is not None), self.recovery.last_draft)

    # ---- the round ----------------------------------------------------------------------------------------------
    async def run(self, rows: list[LiveRequest], ks: list[int]) -> RoundResult | None:
        """One round for `rows` (all leased to one Target replica) with `ks` drafts each; None when the Target
        replica failed (the rows re-lease and re-prefill: deployments/router/recovery.py)."""
        if self.config.draft.remote and any(ks):  # rows drafting for the first time take their Draft lease
            start = time.perf_counter()  # (set-up work, once per request: counted apart from the orchestration)
            await self.recovery.lease_drafts([live for live, k in zip(rows, ks)
                                              if k > 0 and live.ready is None and live.draft is None])
            self.stats.draft_lease_seconds += time.perf_counter() - start
        t0 = time.perf_counter()
        trees = self.plan_trees(rows, ks)
        drafts = self._drafts_at_hand(rows, ks, trees)
        target = rows[0].target
        verified: VerifyResult | None = None
        aheads = []
        by_lease = list(drafts.by_lease.values())
        members = by_lease[0] if len(by_lease) == 1 and not self.config.overlap else None
        if members is not None and self._chainable(rows[members[0]]):
            calls = [VerifyCall(live.delta(live.target_sent), []) for live in rows]  # drafts are filled in there
            try:  # one draft worker: it hands its drafts straight to the target worker
                verified = await self._chained(rows, ks, members, calls, drafts, trees)
            except ReplicaGone:
                await self.recovery.replace_target(rows)
                return None
            t1 = t0 + drafts.compute_seconds  # the router sees no boundary between drafting and verifying
        else:
            await self._draft_calls(rows, ks, drafts, trees)
            t1 = time.perf_counter()
        chained = verified is not None
        if verified is None:
            sample_ends = self.costs.plain_sample(self.group_draft(rows), target) == 1
            calls = [VerifyCall(live.delta(live.target_sent), drafts.tokens[b], drafts.proposals.get(b),
                                self._decodes_ahead(live, ks[b], sample_ends), ks[b] if self.in_target else 0,
                                list(drafts.trees[b].parents) if b in drafts.trees else None,
                                trees[b] if self.in_target else 0)
                     for b, live in enumerate(rows)]
            aheads = self.ahead.start(rows, drafts.tokens) if self.config.overlap else []
            try:
                verified = await target.verify(calls)
            except ReplicaGone:
                await self.ahead.settle(aheads, rows, drafts.tokens, None, None)
                await self.recovery.replace_target(rows)
                return None
            except BaseException:
                await self.ahead.settle(aheads, rows, drafts.tokens, None, None)
                raise
        else:
            self.stats.chained_rounds += 1
        for live, call, k in zip(rows, calls, ks):  # (a chained round's calls mark no row for decoding ahead)
            live.target_sent, live.marked_ahead, live.drafted_last = live.seq.num_tokens, call.ahead, k > 0
        for b, held in verified.target_drafts.items():  # the target's own drafts this round verified
            drafts.tokens[b] = held
        t2 = time.perf_counter()
        for seen in drafts.costs + verify_observations(self.group_draft(rows), target, calls, drafts.tokens, ks,
                                                       verified, self.in_target):
            self.costs.observe(seen)
        outputs, accepted = self._accept(rows, drafts, verified)
        await self._deliver(rows, outputs)
        await self.ahead.settle(aheads, rows, drafts.tokens, accepted, [ended(out) for out in outputs])
        result = RoundResult(drafts.tokens, outputs, accepted, chained, t1 - t0, t2 - t1, drafts.compute_seconds,
                             verified.seconds, time.perf_counter() - t2, verified.ahead_rows == len(rows),
                             verified.target_draft_seconds)
        self._record(rows, result)
        return result

    def plan_trees(self, rows: list[LiveRequest], ks: list[int]) -> list[int]:
        """Each row's tree budget this round (engine/spec/plan.plan_trees; 0: a chain). Trees come from n-gram lookup
        here, from drafters inside the target and from Draft workers (chains where they draft ahead: `overlap`)."""
        if self.config.tree.mode == "off" or self.config.overlap:
            return [0] * len(rows)
        return plan_trees(self._profile(rows), rows, ks, len(rows), self.config.tree, self.tree_population)

    # ---- 2. draft -----------------------------------------------------------------------------------------------
    def _drafts_at_hand(self, rows: list[LiveRequest], ks: list[int], trees: list[int]) -> Drafts:
        """The round's drafts that need no draft call (made ahead, or n-gram lookup), and the rows that draft by
        Draft lease."""
        drafts = Drafts([[] for _ in rows])
        ready = [live.ready for live in rows]
        for live in rows:
            live.ready = None  # a draft made ahead serves the round right after it, or nobody
        if not any(ks):
            return drafts
        if self.local is not None:  # one-hot drafts (n-gram lookup): no proposals
            for b, made in enumerate(draft_rows(self.local, [live.seq for live in rows], ks, trees)[0]):
                if isinstance(made, DraftTree):
                    drafts.trees[b] = made
                    made = list(made.tokens)
                drafts.tokens[b] = made
            return drafts
        for b, (live, k) in enumerate(zip(rows, ks)):
            if k > 0 and ready[b] is not None:
                self.stats.ahead_used += 1
                drafts.tokens[b] = ready[b][0][:k]
                if ready[b][1] is not None:
                    drafts.proposals[b] = head(ready[b][1], 0, k)
            elif k > 0 and live.draft is not None:
                drafts.by_lease.setdefault(live.draft.key, []).append(b)
        return drafts

    async def _draft_calls(self, rows: list[LiveRequest], ks: list[int], drafts: Drafts, trees: list[int]) -> None:
        """Each Draft lease's rows drafted by a call of their own."""
        for members in drafts.by_lease.values():
            calls = [DraftCall(rows[b].draft_delta([]), ks[b], trees[b]) for b in members]
            try:
                result = await rows[members[0]].draft.propose(calls)
            except ReplicaGone:
                await self.recovery.replace_draft([rows[b] for b in members])
                continue  # these rows verify without drafts this round: output unchanged
            drafts.take(rows, members, calls, result)

    # ---- 3. verify (chained) ------------------------------------------------------------------------------------
    async def _chained(self, rows: list[LiveRequest], ks: list[int], members: list[int],
                       verify_calls: list[VerifyCall], drafts: Drafts, trees: list[int]) -> VerifyResult | None:
        """Draft `members` and verify every row in one chained call (the draft worker hands its drafts straight to
        the target worker, which answers). None when the draft worker failed, and the round must verify without
        its drafts. Raises ReplicaGone when the target worker failed."""
        lease = rows[members[0]].draft
        calls = [DraftCall(rows[b].draft_delta([]), ks[b], trees[b]) for b in members]
        try:
            result = await lease.chain(calls, rows[0].target, verify_calls, members)
        except DraftGone:
            await self.recovery.replace_draft([rows[b] for b in members])
            return None
        except ChainBroken as exc:  # the draft is fine but cannot reach the target: a verify of its own tells more
            logger.warning("chained round failed (%s); this Draft/Target pair's rounds make two calls from now on",
                           exc)
            self._unchainable.add((lease.key, rows[0].target.key))
            return None
        drafts.take(rows, members, calls, result.draft)
        return result

    def _decodes_ahead(self, live: LiveRequest, k: int, sample_ends: bool = False) -> bool:
        """Whether the target may decode the row's next token ahead (deployments/workers/decode_ahead.py): the row drafts
        nothing this round, has no grammar or prompt tokens to score, and goes on after this round.

        A row drafts nothing when its request never drafts, or when the plan left the round plain (speculation does
        not pay at this load). The next round, at about the same batch, is planned alike, so the guess that it is
        plain again holds but where the load changes, or where the next round is the row's first chance to probe its
        drafts again (engine/spec/policy.AcceptanceTracker.probe_due_next): that round is not guessed (a probe not
        taken then waits for a lighter load), nor is the round after the last of a plain sample (`sample_ends`:
        round_costs.py). A wrong guess costs the target worker one step (dropped; the row's cache rolls back); a right
        one hides the router's hop behind the device's step, on a GPU what a round without drafts costs beyond plain
        decoding (bench/RESULTS.md, the first H100 runs of the graph runner)."""
        plain_next = live.seq.k == 0 or (not live.tracker.probe_due_next and not sample_ends)
        return (self.config.decode_ahead and k == 0 and plain_next and live.seq.params.grammar is None
                and not live.seq.wants_prompt_logprobs() and live.seq.remaining() > 1)

    def _chainable(self, live: LiveRequest) -> bool:
        return (live.draft.key, live.target.key) not in self._unchainable

    # ---- 4. accept ----------------------------------------------------------------------------------------------
    def _accept(self, rows: list[LiveRequest], drafts: Drafts, verified: VerifyResult
                ) -> tuple[list[RequestOutput | RequestFailed], list[int]]:
        """Each row's commit of the verdict the target worker sampled (engine/spec/accept.py), after the prompt logprobs
        it scored (a request's first output carries them); for a row a worker failed (its draft's or its target's
        grammar), the error its request ends with: nothing of it is committed."""
        failed = {**drafts.failed, **verified.failed}
        for b, run in verified.prompt_logprobs.items():
            if b not in failed:
                rows[b].seq.add_prompt_logprobs(run)
        self.stats.note_cached(rows, verified.cached_tokens)
        outputs: list[RequestOutput | RequestFailed] = []
        accepted = []
        for b, live in enumerate(rows):
            verdict = verified.verdicts[b]
            if b in failed or verdict is None:
                outputs.append(RequestFailed.of(failed[b]))
                accepted.append(0)
                continue
            outputs.append(commit(live.seq, len(drafts.tokens[b]), verdict, self.stats.spec,
                                  live.trackers(verdict, self.population, self.tree_population)))
            accepted.append(verdict.num_accepted)
        return outputs, accepted

    def _record(self, rows: list[LiveRequest], result: RoundResult) -> None:
        """The round's timings into the scheduler's statistics, the costs' overhead correction and the metrics."""
        self.stats.timings.record(len(rows), result.draft_seconds, result.verify_seconds, result.delivery_seconds)
        beyond_compute = (result.draft_seconds + result.verify_seconds - result.draft_compute
                          - result.verify_compute)
        # the round's critical path minus the workers' own compute: RPC, serialization, event-loop hops (never below
        # 0 here: a step decoded ahead computed while the router worked, deployments/workers/decode_ahead.py)
        orchestration = max(0.0, beyond_compute)
        self.stats.orchestration_seconds += orchestration
        # the plan's overhead counts the delivery too, and the credit a step decoded ahead gives: what the round
        # really cost beyond its compute, the figure drafting is weighed against (engine/spec/policy.CostCorrection)
        self.costs.observe_overhead(self.group_draft(rows), rows[0].target, beyond_compute + result.delivery_seconds,
                                    drafted=any(len(d) for d in result.drafts), ahead=result.ahead)
        observe(self.metrics.round, [len(d) for d in result.drafts], result.accepted, result.draft_seconds,
                result.verify_seconds, orchestration)
        self.stats.draft_compute_seconds += result.draft_compute
        self.stats.verify_compute_seconds += result.verify_compute
        self.stats.target_draft_compute_seconds += result.target_draft_compute
