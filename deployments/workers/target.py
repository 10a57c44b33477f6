"""The target's model worker: verifies each round's rows (with their drafts) and samples on its own device.

Each call names rows by sequence and sends only what is new (deployments/transport/messages.py); `Runner.sync` rolls the
KV cache back to what agrees with the committed tokens, so rejected drafts disappear without bookkeeping. The verify
step (engine/spec/verify.TargetVerifier, the in-process engine's too: forward, grammar masks, accept) runs here, so only
tokens go back to the router. Plain rows the router marks are
decoded one step ahead while the router handles the reply (deployments/workers/decode_ahead.py).

Tensor parallelism: rank 0 is the target's only entry point. It forwards each verify and release to the other
ranks over one ordered channel connection each, then runs its own share, so every rank applies the same calls in
the same order (rows are paired by position in the collectives) however many routers call the replica at once.
A collective that fails (a peer died) marks the rank broken: its calls and health pings fail from then on. With a
drafter inside the target (`self`, Medusa, EAGLE-3), rank 0 alone knows the verdicts: it tells the other ranks where
its drafter starts (they step with it where the drafter's steps hold collectives) and the drafts it made, so every
rank verifies the same drafts at the row's next call (TargetDraftPeers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

from deployments.errors import TensorParallelBroken
from deployments.transport.channel import ChannelSender
from deployments.transport.messages import (DraftResult, Method, VerifyCall, VerifyResult, calls_with_drafts,
                                             chained_reply, draft_starts_from_wire, draft_starts_to_wire,
                                             proposal_from_wire, target_drafts_from_wire, target_drafts_to_wire)
from deployments.transport.wire import ChannelClosed, Endpoint
from deployments.workers.base import ModelWorker, cpu_startup_turn, startup_errors, warm_up
from deployments.workers.decode_ahead import DecodeAhead, merged, next_calls
from deployments.workers.grammars import grammar_failure, prepare_grammars
from engine.calibration.measure import measure_target_costs
from engine.models.cpu import bf16_products
from engine.calibration.store import cached_costs, costs_key
from engine.factory import EngineConfig, build_target, build_target_drafter, check_trees, make_runner
from engine.models.loading import eos_token_ids, load_tokenizer, resolve
from engine.models.runner import Runner, resolve_dtype
from engine.models.shard_loading import load_shard, rank_device
from engine.models.tensor_parallel import CollectiveError, full_num_parameters, num_parameters
from engine.request.grammar import GrammarCompiler, SequenceGrammars
from engine.spec.verify import TargetVerifier, VerifyRow

log = logging.getLogger(__name__)


class TargetWorkerCore(ModelWorker):
    """One tensor-parallel rank of the target: a shard of the weights and of every KV cache."""

    def __init__(self, config: EngineConfig, rank: int = 0, world: int = 1, torch_threads: int | None = None,
                 concurrent_workers: int | None = None, niceness: int | None = None) -> None:
        super().__init__({Method.VERIFY: self.verify, Method.VERIFY_CHAINED: self.verify_chained,
                          Method.VERIFY_AHEAD: self.verify_ahead, Method.TARGET_DRAFTING: self.target_drafting,
                          Method.TARGET_DRAFTS: self.target_drafts}, torch_threads, concurrent_workers or world,
                         niceness)
        self.ahead = DecodeAhead()  # rows decoded ahead of the router's next call (deployments/workers/decode_ahead.py)
        self._peers: list[ChannelSender] = []  # rank 0 only: the other ranks, in rank order
        self.broken: str | None = None  # why this rank's group can no longer compute
        self.rank, self.world = rank, world
        self.config = config
        self.runner: Runner | None = None
        self.costs: dict | None = None
        self.grammars: SequenceGrammars | None = None  # rank 0: structured outputs' matchers (made at load)
        self.verifier: TargetVerifier | None = None  # the verify step over the runner (engine/spec/verify.py)
        self.drafter = None  # a draft source inside the target (engine/spec/target_drafts.py), or None
        self._pending_draft = None  # drafting after the reply, not yet run (`_flush_drafting`)
        if world == 1:
            with startup_errors("target"), cpu_startup_turn(config):
                self.on_model_thread(self.load)

    def model_runner(self) -> Runner | None:
        return self.runner

    # ---- tensor-parallel set-up (world > 1) -------------------------------------------------------------------
    @staticmethod
    def rendezvous_address() -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()), port

    def init_distributed(self, address: str, port: int, timeout_s: float | None = None) -> None:
        """Join the replica's process group (`join_process_group`), then load this rank's shard."""
        join_process_group(self.config.device, self.rank, self.world, address, port, timeout_s,
                           lambda: self.on_model_thread(rank_device, self.config.device))
        with startup_errors("target"):
            self.on_model_thread(self.load)

    def load(self) -> None:
        """The whole target (world 1), or this rank's shard read straight from the safetensors files
        (engine/models/shard_loading.py): no rank ever holds the full weights."""
        if self.world == 1:
            self.runner, tokenizer = build_target(self.config)
            self.full_parameters = num_parameters(self.runner.model)
            self._start_grammars(tokenizer)
            # a draft source inside the target (draft: self | medusa:DIR): drafts from each verify pass
            self.drafter = build_target_drafter(self.config, self.runner, tokenizer)
            check_trees(self.config, self.runner)
            warm_up(self.runner, self.config.widest_verify, "target", self.drafter)
            self.verifier = TargetVerifier(self.runner, self.grammars, self._known, drafter=self.drafter,
                                           draft_after_reply=self.config.draft_after_reply)
            return
        # a shard runs on the static runner (its heads' fused weights and KV cache, collectives inside the step:
        # engine/models/static/tp.py) where the family is covered and runner is auto/static; on transformers' otherwise.
        # Every rank builds the same runner at the same time (the static one agrees on its slot count).
        dtype = resolve_dtype(self.config.target_dtype, self.config.device)
        model = load_shard(resolve(self.config.target), dtype, self.config.device, self.rank, self.world,
                           trust_remote_code=self.config.trust_remote_code)
        self.full_parameters = full_num_parameters(model, self.world)
        self.runner = make_runner(model, self.config, vocab_size=model.config.vocab_size)
        tokenizer = load_tokenizer(resolve(self.config.target), self.config.trust_remote_code)
        # a drafter inside the target: every rank builds it (and `self` chooses its L) at the same time
        self.drafter = build_target_drafter(self.config, self.runner, tokenizer)
        # every rank captures its CUDA graphs now, the same shapes in the same order (their collectives pair up)
        check_trees(self.config, self.runner)
        warm_up(self.runner, self.config.widest_verify, "target", self.drafter)
        if self.rank == 0:
            self._start_grammars(tokenizer)
        # every rank applies the calls and runs the forward; rank 0 alone samples and answers, and tells the others
        # what its drafter does (TargetDraftPeers)
        self.verifier = TargetVerifier(self.runner, self.grammars, self._known, samples=self.rank == 0,
                                       drafter=self.drafter, peers=TargetDraftPeers(self._peers) if self.rank == 0
                                       and self.drafter is not None else None,
                                       draft_after_reply=self.config.draft_after_reply)

    def _start_grammars(self, tokenizer) -> None:
        """Rank 0's structured-output matchers, their tokenizer table built now (prepare_grammars)."""
        eos = eos_token_ids(resolve(self.config.target).directory, tokenizer)
        self.grammars = SequenceGrammars(GrammarCompiler(tokenizer, self.runner.vocab_size, eos))
        prepare_grammars(self.grammars, "target")

    def connect_peers(self, endpoints: list[Endpoint]) -> None:
        """Rank 0: connect to ranks 1.. (in order), which from then on take their calls from rank 0 alone."""
        assert self.rank == 0 and len(endpoints) == self.world - 1
        self._peers[:] = [ChannelSender(e) for e in endpoints]  # in place: the verifier's TargetDraftPeers holds it

    def calibrate(self, max_k: int, widest: int | None = None) -> dict:
        """Verify costs by batch size and draft count (every rank must run it at once: collectives; at start-up,
        before any router calls)."""
        # with several ranks only rank 0 takes the node's turn: the others must not block its collectives
        with startup_errors("target"), cpu_startup_turn(self.config) if self.rank == 0 else contextlib.nullcontext():
            measure = lambda: self.on_model_thread(  # noqa: E731
                lambda: measure_target_costs(self.runner, max_k, drafter=self.drafter, widest=widest,
                                             tree_nodes=self.config.tree_nodes if self.config.tree != "off" else 0))
            if self.world > 1:  # every rank must run the measurement's collectives: none may read a cache alone
                self.costs = measure()
            else:
                key = self.on_model_thread(lambda: costs_key(  # torch's thread count as the model thread sees it
                    "target", resolve(self.config.target).directory, self.config.target_dtype, self.runner,
                    max_k=max_k, widest=widest, tree=self.config.tree, tree_nodes=self.config.tree_nodes,
                    prefill_chunk=self.config.prefill_chunk,
                    drafter=None if self.drafter is None else f"{self.config.draft} ({self.drafter.name})"))
                self.costs = cached_costs(self.config.cost_cache, key, measure)
        # which operator computes bf16 products here (not part of the cached measurement: part of its key)
        self.costs = {**self.costs, "bf16_products": bf16_products.stats()}
        return self.costs

    def _in_group(self, method: Method, args: tuple, run):
        """Run a call on this rank's model thread; rank 0 first forwards it to the other ranks (the one ordering
        source), in the same turn."""
        return self.on_model_thread(self._forward_and_run, method, args, run)

    def _forward_and_run(self, method: Method, args: tuple, run):
        self._flush_drafting()
        if self.broken is not None:
            raise TensorParallelBroken(self.broken)
        try:
            for peer in self._peers:
                peer.send(method, *args)
            return run(*args)
        except (CollectiveError, ChannelClosed) as exc:
            raise TensorParallelBroken(self._break(exc)) from exc

    def _break(self, exc: Exception) -> str:
        """Mark this rank's group broken by `exc` (a failed collective or peer channel); why."""
        self.broken = f"tensor-parallel rank {self.rank} of {self.world}: {exc}"
        return self.broken

    # ---- the round ------------------------------------------------------------------------------------------
    def verify(self, calls: list[tuple]) -> tuple | None:
        """Verify `calls` (VerifyCall.wire() each; the other ranks get them in that form too); a VerifyResult's
        wire() (None on the other ranks)."""
        return self._in_group(Method.VERIFY, (calls,), self._timed_verify)

    def verify_chained(self, calls: list[tuple], members: list[int], draft: tuple) -> tuple:
        """A chained round's last step, from the draft worker (`DraftWorkerCore.propose_chained`): verify `calls`
        with call i of the draft (a DraftResult's wire()) for row members[i], its compact proposal included; the
        reply (to the router) carries the draft's tokens too, without the proposals."""
        result = DraftResult.from_wire(draft)
        return chained_reply(self.verify(calls_with_drafts(calls, members, result)), result)

    def _timed_verify(self, calls: list[tuple]) -> tuple | None:
        with self.busy:
            result = self._verify([VerifyCall.from_wire(call) for call in calls])
        return None if result is None else result.wire()

    def _verify(self, calls: list[VerifyCall]) -> VerifyResult | None:
        """Rows decoded ahead exactly as asked are answered from there (every rank takes the same ones), the others
        computed; rank 0 then queues the next round's step for a round of plain rows (deployments/workers/decode_ahead.py)."""
        served = self.ahead.take(calls)
        for b in served:
            self._known.apply(calls[b].seq)  # the tokens the step ahead assumed
        rest = [b for b in range(len(calls)) if b not in served]
        computed = self._compute([calls[b] for b in rest]) if rest else None
        result = computed if not served else merged(len(calls), served, rest, computed, self.rank)
        if result is not None and (upcoming := next_calls(calls, result)) is not None:
            self.later(self._decode_ahead, upcoming)
        return result

    def _decode_ahead(self, calls: list[VerifyCall]) -> None:
        """Rank 0, after replying: the next round's step for the rows still where it assumed, on every rank."""
        current = self.ahead.current(calls, self._known.tokens)
        if current:
            with contextlib.suppress(TensorParallelBroken):  # the group's next call fails with it
                self.verify_ahead([call.wire() for call in current])

    def verify_ahead(self, calls: list[tuple]) -> None:
        """A step decoded ahead (rank 0 runs it and forwards it to the other ranks, in order with the verifies)."""
        self._in_group(Method.VERIFY_AHEAD, (calls,), self._timed_ahead)

    def target_drafting(self, starts: list[tuple], accepted: list[list[int]]) -> None:
        """A rank but the first: run a collective drafter's steps with rank 0's (TargetDraftPeers)."""
        self._in_group(Method.TARGET_DRAFTING, (starts, accepted), lambda starts, accepted: (
            self.verifier.draft_with_first_rank(draft_starts_from_wire(starts), accepted)))

    def target_drafts(self, starts: list[tuple], drafts: list[tuple]) -> None:
        """A rank but the first: keep the drafts rank 0's drafter made, for the rows' next calls."""
        self._in_group(Method.TARGET_DRAFTS, (starts, drafts), lambda starts, drafts: (
            self.verifier.hold(draft_starts_from_wire(starts), target_drafts_from_wire(drafts))))

    def _flush_drafting(self) -> None:
        """Drafting after the reply (`draft_after_reply`): the last verify's next drafts
        (engine/spec/verify.VerifyOutcome.draft_next), run once the answer has gone, or first thing in whatever call
        reaches the model thread before that (another router's): no other pass ever runs between a verify and its
        drafting, and the other ranks get its messages before any call forwarded after. A failed collective or peer
        channel breaks the group as inside a call."""
        draft, self._pending_draft = self._pending_draft, None
        if draft is None or self.broken is not None:
            return
        try:
            with self.busy:
                draft()
        except (CollectiveError, ChannelClosed) as exc:
            self._break(exc)

    def _timed_ahead(self, calls: list[tuple]) -> None:
        with self.busy:
            start = time.perf_counter()
            parsed = [VerifyCall.from_wire(call) for call in calls]
            self.ahead.keep(parsed, self._compute(parsed), time.perf_counter() - start)

    def _compute(self, calls: list[VerifyCall]) -> VerifyResult | None:
        """The calls through the one verify step (engine/spec/verify.py); rank 0's answer, None on the others."""
        start = time.perf_counter()
        outcome = self.verifier.verify([VerifyRow(call.seq, call.draft, proposal_from_wire(call.proposal),
                                                  call.target_k, call.tree(), call.target_tree) for call in calls])
        self._counted(len(calls))
        if outcome is None:
            return None
        if outcome.draft_next is not None:  # drafting after the reply (`_flush_drafting`)
            self._pending_draft = outcome.draft_next
            self.later(self._flush_drafting)
        failed = {b: grammar_failure("target", calls[b].seq.seq_id, exc) for b, exc in outcome.failed.items()}
        return VerifyResult(outcome.verdicts, time.perf_counter() - start, failed=failed,
                            prompt_logprobs=outcome.prompt_logprobs, cached_tokens=outcome.cached_tokens,
                            target_drafts=outcome.drafts, target_draft_seconds=outcome.draft_seconds)

    def release(self, seq_ids: list[str]) -> None:
        """Rank 0 passes the release on to the other ranks, in order with the verifies."""
        self._in_group(Method.RELEASE, (seq_ids,), self._release)

    def _forget(self, seq_id: str) -> None:
        self.ahead.forget(seq_id)
        if self.verifier is not None:
            self.verifier.release(seq_id)

    def stats(self) -> dict:
        return {"rank": self.rank, **super().stats(), "parameters": num_parameters(self.runner.model),
                "full_parameters": self.full_parameters, "decode_ahead": self.ahead.stats.as_dict(),
                "drafter": None if self.drafter is None else {"name": self.drafter.name,
                                                              **self.verifier.held.stats()},
                "grammar": None if self.grammars is None else self.grammars.compiler.stats.as_dict()}

    def ping(self) -> float:
        """As ModelWorker.ping; a rank whose group broke fails its health check at once."""
        if self.broken is not None:
            raise TensorParallelBroken(self.broken)
        return super().ping()


class TargetDraftPeers:
    """engine/spec/target_drafts.DraftPeers over rank 0's channels to the other ranks: sent from rank 0's model thread
    inside its verify call, so they arrive in order with the calls it forwards (before the rows' next verify). Where
    the drafter runs: on every rank when its steps hold collectives (`self`'s layers; a head reading the sharded
    embedding or LM head), else on rank 0 alone (Medusa heads of their own, whole on every rank); the drafts rank 0
    made travel either way (a few tokens per row), so every rank verifies exactly rank 0's drafts."""

    def __init__(self, peers: list[ChannelSender]) -> None:
        self.peers = peers  # the worker's list, filled by connect_peers

    def drafting(self, rows, accepted) -> None:
        wire = draft_starts_to_wire(list(rows))
        for peer in self.peers:
            peer.send(Method.TARGET_DRAFTING, wire, [list(tokens) for tokens in accepted])

    def made(self, rows, drafts) -> None:
        wire, made = draft_starts_to_wire(list(rows)), target_drafts_to_wire(list(drafts))
        for peer in self.peers:
            peer.send(Method.TARGET_DRAFTS, wire, made)


def join_process_group(device: str, rank: int, world: int, address: str, port: int, timeout_s: float | None,
                       device_id: Callable[[], object]) -> None:
    """Join a Target replica's torch.distributed group: NCCL on CUDA (this rank's device from `device_id()`, made
    current on the model thread), gloo on CPU.

    A dead peer's process fails gloo collectives at once (its sockets close); `timeout_s` bounds
    a peer that is alive but never joins (stopped, stuck), after which the rank is broken and Serve replaces the
    replica. Default SPECSERVE_COLLECTIVE_TIMEOUT_S, else 30 s on GPU and 60 s on CPU: verifies take
    well under a second, but on CPU the start-up calibration's collectives wait while rank 0 queues for the
    node's start-up turn (`cpu_startup_turn`) behind the draft's load and calibration, tens of seconds here under
    load. NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 lets torch's watchdog abort a collective stuck past the timeout
    and end the process (a dead worker fails the health check at once); TORCH_NCCL_BLOCKING_WAIT stays off (the
    host would wait on every collective: no overlap, no CUDA graphs). The operator's own env settings win.
    """
    import datetime

    import torch.distributed as dist

    cuda = device.startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("SPECSERVE_COLLECTIVE_TIMEOUT_S", 30.0 if cuda else 60.0))
    options = {}
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        options["device_id"] = device_id()
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **options)
