"""Model workers: the stateful halves of a speculative round, as plain classes (unit-testable) and Ray actors.

A round sends only token deltas (deployments/transport/messages.py: the calls and results, and their wire form). A
worker keeps the committed tokens it knows and its KV cache; `Runner.sync` rolls the cache back to the common prefix, so
rejected drafts disappear without bookkeeping. The target samples on its own device (engine/spec/accept.verify_rows) and
replies tokens; the draft replies tokens and, for unseeded sampled rows, compact proposals (engine/spec/proposal.py).
What both workers share (the channel on the model thread, the busy clock, known tokens, counters, ping, stats, release)
is deployments/workers/base.py's ModelWorker.

The target's worker, TargetWorkerCore, lives in deployments/workers/target.py (tensor parallelism there too).
"""

from __future__ import annotations

import logging
import threading
import time

from deployments.transport.channel import ChannelRelay
from deployments.transport.messages import DraftCall, DraftResult, Method, RowFailure, proposal_to_wire
from deployments.transport.wire import Route
from deployments.workers.base import ModelWorker, cpu_startup_turn, startup_errors, warm_up
from deployments.workers.grammars import failed_grammars, prepare_grammars
from engine.calibration.measure import measure_draft_costs
from engine.calibration.store import cached_costs, costs_key
from engine.factory import EngineConfig, build_proposer
from engine.models.cpu import bf16_products
from engine.models.loading import load_tokenizer, resolve
from engine.models.runner import Runner
from engine.proposers.base import DraftRequest

log = logging.getLogger(__name__)


class DraftWorkerCore(ModelWorker):
    """Holds the draft model and its KV caches (its random numbers are counter-based: no per-sequence state).

    A draft made *ahead* (overlapped with the target's verify of the previous round) carries an id; `cancel(id)`,
    served on its own thread while the draft computes, stops it after the current draft step, because the
    router already knows the guess it was built on is wrong.
    """

    CANCELLED_KEPT = 256  # cancel ids remembered (one per in-flight ahead draft is enough)

    def __init__(self, config: EngineConfig, torch_threads: int | None = None, calibrate: bool = False,
                 concurrent_workers: int = 1, niceness: int | None = None) -> None:
        super().__init__({Method.PROPOSE: self.propose, Method.PROPOSE_CHAINED: self.propose_chained}, torch_threads,
                         concurrent_workers, niceness)
        self._relay = ChannelRelay()  # to target workers, for chained rounds
        with startup_errors("draft"), cpu_startup_turn(config):
            self.on_model_thread(self._start, config, calibrate)

    def model_runner(self) -> Runner | None:
        proposer = getattr(self, "proposer", None)
        return None if proposer is None else proposer.runner

    def _start(self, config: EngineConfig, calibrate: bool) -> None:
        target = resolve(config.target)
        from transformers import AutoConfig

        target_vocab = AutoConfig.from_pretrained(target.directory).vocab_size
        # a Draft worker exists for a draft model only (DraftSource.remote): its proposer is a DraftModelProposer (`.runner`)
        self.proposer = build_proposer(config, load_tokenizer(target, config.trust_remote_code), target_vocab)
        prepare_grammars(self.proposer.grammars, "draft")
        warm_up(self.proposer.runner, config.num_speculative_tokens, "draft")
        self._cancelled: set[int] = set()
        self._cancel_lock = threading.Lock()
        self.cancelled_drafts = 0
        # draft step and prefill seconds by batch size, for the router's K plan (engine/spec/plan.py)
        runner = self.proposer.runner
        self.costs = None if not calibrate else cached_costs(
            config.cost_cache, costs_key("draft", resolve(config.draft).directory, config.draft_dtype, runner,
                                         prefill_chunk=config.prefill_chunk),
            lambda: measure_draft_costs(runner))
        if self.costs is not None:  # which operator computes bf16 products here (part of the cache's key)
            self.costs = {**self.costs, "bf16_products": bf16_products.stats()}

    def cancel(self, ahead_id: int) -> None:
        with self._cancel_lock:
            if len(self._cancelled) >= self.CANCELLED_KEPT:
                self._cancelled.clear()
            self._cancelled.add(ahead_id)

    def _is_cancelled(self, ahead_id: int) -> bool:
        with self._cancel_lock:
            return ahead_id in self._cancelled

    def propose(self, calls: list[tuple], ahead_id: int | None = None) -> tuple:
        """Draft for `calls` (DraftCall.wire() each); a DraftResult's wire()."""
        return self._model.call(self._timed_propose, calls, ahead_id)

    def _timed_propose(self, calls: list[tuple], ahead_id: int | None) -> tuple:
        with self.busy:
            return self._propose([DraftCall.from_wire(call) for call in calls], ahead_id).wire()

    def _propose(self, calls: list[DraftCall], ahead_id: int | None) -> DraftResult:
        start = time.perf_counter()
        requests = []
        for call in calls:
            seq_id = call.seq.seq_id
            tokens = self._known.apply(call.seq)  # the first draft's absolute position is len(tokens)
            requests.append(DraftRequest(seq_id, tokens, call.k, self._known.settings(seq_id),
                                         self._known.processing(seq_id), call.tree))
        if all(call.k == 0 for call in calls):  # a prompt chunk, read only (prompt_chunks.PromptChunks._draft_reads)
            self.proposer.read(requests)
            self._counted(len(calls))
            return DraftResult([[] for _ in calls], {}, time.perf_counter() - start, failed=self._failures(calls))
        stop = None if ahead_id is None else (lambda: self._is_cancelled(ahead_id))
        proposal = self.proposer.propose(requests, stop=stop)
        if stop is not None and stop():
            with self._cancel_lock:
                self._cancelled.discard(ahead_id)
            self.cancelled_drafts += 1
            return DraftResult([], {}, time.perf_counter() - start, cancelled=True)
        self._counted(len(calls))
        failed = self._failures(calls)
        ids, counts = proposal.token_ids.tolist(), proposal.num_tokens.tolist()
        proposals = {b: proposal_to_wire(compact) for b in range(len(calls))
                     if b not in failed and (compact := proposal.proposal(b)) is not None}
        drafts = [[] if b in failed else row[:n] for b, (row, n) in enumerate(zip(ids, counts))]
        parents = {}
        for b, tree in enumerate(proposal.trees or ()):
            if tree is not None and b not in failed:  # a tree travels as its tokens and their parents
                drafts[b], parents[b] = tree.wire()
        return DraftResult(drafts=drafts, proposals=proposals, seconds=time.perf_counter() - start, failed=failed,
                           parents=parents)

    def _failures(self, calls: list[DraftCall]) -> dict[int, RowFailure]:
        """The calls whose grammar failed in the proposer (it drafts the other rows on:
        engine/proposers/draft_model.py); their drafts are dropped and their requests fail (no silent unconstrained
        drafting)."""
        return failed_grammars(self.proposer.grammars, [call.seq.seq_id for call in calls], "draft")

    def propose_chained(self, calls: list[tuple], verify_calls: list[tuple], members: list[int],
                        route: Route) -> None:
        """A chained round's first step (transport.client.AsyncChannels.chain): draft, then hand the drafts (and the
        compact proposals of unseeded sampled rows) to the target worker at `route`, whose verify
        (`TargetWorkerCore.verify_chained`) samples and answers the router. Row members[i] of `verify_calls` gets
        call i's drafts. Calls are in their wire form (DraftCall.wire(), VerifyCall.wire()); the verify calls pass
        on as they came."""
        draft = self._timed_propose(calls, None)  # a channel handler: on the model thread already
        self._relay.send(route, Method.VERIFY_CHAINED, verify_calls, members, draft)

    def _forget(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def stats(self) -> dict:
        grammars = getattr(self.proposer, "grammars", None)
        passes, made = getattr(self.proposer, "lookup_steps", (0, 0))
        return {**super().stats(), "cancelled_drafts": self.cancelled_drafts, "costs": self.costs,
                "grammar": None if grammars is None else grammars.compiler.stats.as_dict(),
                "staged": {"passes": passes, "drafts": made} if getattr(self.proposer, "lookup", None) else None}
