"""Model workers: the stateful halves of a speculative round, as plain classes (unit-testable) and Ray actors.

A round sends only token deltas (deployments/messages.py: the calls and results, and their wire form). A worker
keeps the committed tokens it knows and its KV cache; `Runner.sync` rolls the cache back to the common prefix, so
rejected drafts disappear without bookkeeping. The target samples on its own device (engine/accept.verify_rows) and
replies tokens; the draft replies tokens and, for unseeded sampled rows, compact proposals (engine/proposal.py).
What both workers share (the channel on the model thread, the busy clock, known tokens, counters, ping, stats,
release) is deployments/worker_base.py's ModelWorker.

Tensor parallelism: rank 0 is the target's only entry point. It forwards each verify and release to the other
ranks over one ordered channel connection each, then runs its own share, so every rank applies the same calls in
the same order (rows are paired by position in the collectives) however many routers call the replica at once.
A collective that fails (a peer died) marks the rank broken: its calls and health pings fail from then on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

from engine.accept import RowVerify, row_scheme, verify_rows
from engine.calibrate import measure_draft_costs, measure_target_costs
from engine.cost_cache import cached_costs, costs_key
from engine.factory import EngineConfig, build_proposer, build_target, make_runner
from engine.grammar import GrammarCompiler, GrammarError, SequenceGrammars
from engine.loading import eos_token_ids, load_tokenizer, resolve
from engine.prompt_logprobs import PromptLogprobs, score_prefill, score_tokens
from engine.proposers import DraftRequest
from engine.runner import Runner, resolve_dtype
from engine.shard_loading import load_shard, rank_device
from engine.tensor_parallel import CollectiveError, full_num_parameters, num_parameters

from .channel import ChannelRelay, ChannelSender
from .channel_wire import ChannelClosed, Endpoint, Route
from .errors import TensorParallelBroken
from .messages import (DraftCall, DraftResult, RowFailure, VerifyCall, VerifyResult, proposal_from_wire,
                       proposal_to_wire)
from .worker_base import ModelWorker, cpu_startup_turn, startup_errors, warm_up
from .worker_grammars import failed_grammars, grammar_failure, prepare_grammars

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
        super().__init__({"propose": self.propose, "propose_chained": self.propose_chained}, torch_threads,
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
        # a Draft worker exists for DraftMethod.MODEL only: its proposer is a DraftModelProposer (`.runner`)
        self.proposer = build_proposer(config, load_tokenizer(target, config.trust_remote_code), target_vocab)
        prepare_grammars(self.proposer.grammars, "draft")
        warm_up(self.proposer.runner, config.num_speculative_tokens, "draft")
        self._cancelled: set[int] = set()
        self._cancel_lock = threading.Lock()
        self.cancelled_drafts = 0
        # draft step and prefill seconds by batch size, for the router's K policy (engine/policy.py)
        runner = self.proposer.runner
        self.costs = None if not calibrate else cached_costs(
            config.cost_cache, costs_key("draft", resolve(config.draft).directory, config.draft_dtype, runner,
                                         prefill_chunk=config.prefill_chunk),
            lambda: measure_draft_costs(runner))

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
            tokens = self._known.apply(call.seq)  # the first draft's absolute position is len(tokens)
            requests.append(DraftRequest(call.seq.seq_id, tokens, call.k, call.seq.sampling(), call.seq.seed,
                                         call.seq.coupled, self._known.processing(call.seq.seq_id),
                                         call.seq.grammar_spec(), call.seq.output_start))
        if all(call.k == 0 for call in calls):  # a prompt chunk, read only (scheduler._draft_reads_chunk)
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
        return DraftResult(drafts=[[] if b in failed else row[:n] for b, (row, n) in enumerate(zip(ids, counts))],
                           proposals=proposals, seconds=time.perf_counter() - start, failed=failed)

    def _failures(self, calls: list[DraftCall]) -> dict[int, RowFailure]:
        """The calls whose grammar failed in the proposer (it drafts the other rows on: engine/proposers.py); their
        drafts are dropped and their requests fail (no silent unconstrained drafting)."""
        return failed_grammars(self.proposer.grammars, [call.seq.seq_id for call in calls], "draft")

    def propose_chained(self, calls: list[tuple], verify_calls: list[tuple], members: list[int],
                        route: Route) -> None:
        """A chained round's first step (channel_client.AsyncChannels.chain): draft, then hand the drafts (and the
        compact proposals of unseeded sampled rows) to the target worker at `route`, whose verify
        (`TargetWorkerCore.verify_chained`) samples and answers the router. Row members[i] of `verify_calls` gets
        call i's drafts. Calls are in their wire form (DraftCall.wire(), VerifyCall.wire()); the verify calls pass
        on as they came."""
        draft = self._timed_propose(calls, None)  # a channel handler: on the model thread already
        self._relay.send(route, "verify_chained", verify_calls, members, draft)

    def _forget(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def stats(self) -> dict:
        grammars = getattr(self.proposer, "grammars", None)
        return {**super().stats(), "cancelled_drafts": self.cancelled_drafts, "costs": self.costs,
                "grammar": None if grammars is None else grammars.compiler.stats.as_dict()}


class TargetWorkerCore(ModelWorker):
    """One tensor-parallel rank of the target: a shard of the weights and of every KV cache."""

    def __init__(self, config: EngineConfig, rank: int = 0, world: int = 1, torch_threads: int | None = None,
                 concurrent_workers: int | None = None, niceness: int | None = None) -> None:
        super().__init__({"verify": self.verify, "verify_chained": self.verify_chained}, torch_threads,
                         concurrent_workers or world, niceness)
        self._peers: list[ChannelSender] = []  # rank 0 only: the other ranks, in rank order
        self.broken: str | None = None  # why this rank's group can no longer compute
        self.rank, self.world = rank, world
        self.config = config
        self.runner: Runner | None = None
        self.costs: dict | None = None
        self.grammars: SequenceGrammars | None = None  # rank 0: structured outputs' matchers (made at load)
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
        """Join the replica's process group, then load this rank's shard.

        A dead peer's process fails gloo collectives at once (its sockets close: 0.04 s measured); `timeout_s` bounds
        a peer that is alive but never joins (stopped, stuck), after which the rank is broken and Serve replaces the
        replica. Default SPECSERVE_COLLECTIVE_TIMEOUT_S, else 30 s on GPU and 60 s on CPU (was 120 s): verifies take
        well under a second, but on CPU the start-up calibration's collectives wait while rank 0 queues for the
        node's start-up turn (`cpu_startup_turn`) behind the draft's load and calibration, 23 s measured here under
        load. NCCL: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 lets torch's watchdog abort a collective stuck past the timeout
        and end the process (a dead worker fails the health check at once); TORCH_NCCL_BLOCKING_WAIT stays off (the
        host would wait on every collective: no overlap, no CUDA graphs). The operator's own env settings win.
        """
        import datetime

        import torch.distributed as dist

        cuda = self.config.device.startswith("cuda")
        backend = "nccl" if cuda else "gloo"
        if timeout_s is None:
            timeout_s = float(os.environ.get("SPECSERVE_COLLECTIVE_TIMEOUT_S", 30.0 if cuda else 60.0))
        options = {}
        if cuda:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            options["device_id"] = self.on_model_thread(rank_device, self.config.device)
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=timeout_s), **options)
        with startup_errors("target"):
            self.on_model_thread(self.load)

    def load(self) -> None:
        """The whole target (world 1), or this rank's shard read straight from the safetensors files
        (engine/shard_loading.py): no rank ever holds the full weights."""
        if self.world == 1:
            self.runner, tokenizer = build_target(self.config)
            self.full_parameters = num_parameters(self.runner.model)
            self._start_grammars(tokenizer)
            warm_up(self.runner, self.config.num_speculative_tokens, "target")
            return
        # a shard runs on the static runner (its heads' fused weights and KV cache, collectives inside the step:
        # engine/static_tp.py) where the family is covered and runner is auto/static; on transformers' otherwise.
        # Every rank builds the same runner at the same time (the static one agrees on its slot count).
        dtype = resolve_dtype(self.config.target_dtype, self.config.device)
        model = load_shard(resolve(self.config.target), dtype, self.config.device, self.rank, self.world,
                           trust_remote_code=self.config.trust_remote_code)
        self.full_parameters = full_num_parameters(model, self.world)
        self.runner = make_runner(model, self.config, vocab_size=model.config.vocab_size)
        if self.rank == 0:
            self._start_grammars(load_tokenizer(resolve(self.config.target), self.config.trust_remote_code))

    def _start_grammars(self, tokenizer) -> None:
        """Rank 0's structured-output matchers, their tokenizer table built now (prepare_grammars)."""
        eos = eos_token_ids(resolve(self.config.target).directory, tokenizer)
        self.grammars = SequenceGrammars(GrammarCompiler(tokenizer, self.runner.vocab_size, eos))
        prepare_grammars(self.grammars, "target")

    def connect_peers(self, endpoints: list[Endpoint]) -> None:
        """Rank 0: connect to ranks 1.. (in order), which from then on take their calls from rank 0 alone."""
        assert self.rank == 0 and len(endpoints) == self.world - 1
        self._peers = [ChannelSender(e) for e in endpoints]

    def calibrate(self, max_k: int) -> dict:
        """Verify costs by batch size and draft count (every rank must run it at once: collectives; at start-up,
        before any router calls)."""
        # with several ranks only rank 0 takes the node's turn: the others must not block its collectives
        with startup_errors("target"), cpu_startup_turn(self.config) if self.rank == 0 else contextlib.nullcontext():
            measure = lambda: self.on_model_thread(measure_target_costs, self.runner, max_k)  # noqa: E731
            if self.world > 1:  # every rank must run the measurement's collectives: none may read a cache alone
                self.costs = measure()
            else:
                key = self.on_model_thread(lambda: costs_key(  # torch's thread count as the model thread sees it
                    "target", resolve(self.config.target).directory, self.config.target_dtype, self.runner,
                    max_k=max_k, prefill_chunk=self.config.prefill_chunk))
                self.costs = cached_costs(self.config.cost_cache, key, measure)
        return self.costs

    def _in_group(self, method: str, args: tuple, run):
        """Run a call on this rank's model thread; rank 0 first forwards it to the other ranks (the one ordering
        source), in the same turn."""
        return self.on_model_thread(self._forward_and_run, method, args, run)

    def _forward_and_run(self, method: str, args: tuple, run):
        if self.broken is not None:
            raise TensorParallelBroken(self.broken)
        try:
            for peer in self._peers:
                peer.send(method, *args)
            return run(*args)
        except (CollectiveError, ChannelClosed) as exc:
            self.broken = f"tensor-parallel rank {self.rank} of {self.world}: {exc}"
            raise TensorParallelBroken(self.broken) from exc

    # ---- the round ------------------------------------------------------------------------------------------
    def verify(self, calls: list[tuple]) -> tuple | None:
        """Verify `calls` (VerifyCall.wire() each; the other ranks get them in that form too); a VerifyResult's
        wire() (None on the other ranks)."""
        return self._in_group("verify", (calls,), self._timed_verify)

    def verify_chained(self, calls: list[tuple], members: list[int], draft: tuple) -> tuple:
        """A chained round's last step, from the draft worker (`DraftWorkerCore.propose_chained`): verify `calls`
        with call i of the draft (a DraftResult's wire()) for row members[i], its compact proposal included; the
        reply (to the router) carries the draft's tokens too, without the proposals."""
        calls = list(calls)
        result = DraftResult.from_wire(draft)
        for i, b in enumerate(members):
            calls[b] = (calls[b][0], result.drafts[i], result.proposals.get(i))
        rows, seconds, _, prompt, failed, cached = self.verify(calls)
        return rows, seconds, result.without_proposals().wire(), prompt, failed, cached

    def _timed_verify(self, calls: list[tuple]) -> tuple | None:
        with self.busy:
            result = self._verify([VerifyCall.from_wire(call) for call in calls])
        return None if result is None else result.wire()

    def _verify(self, calls: list[VerifyCall]) -> VerifyResult | None:
        start = time.perf_counter()
        runner = self.runner
        seq_ids, feeds, widths, positions = [], [], [], []
        prompt: dict[int, PromptLogprobs | None] = {}  # rows scoring prompt tokens (engine/prompt_logprobs.py)
        for b, call in enumerate(calls):
            known = self._known.apply(call.seq)
            if not runner.has(call.seq.seq_id):
                runner.add(call.seq.seq_id)
            seq_ids.append(call.seq.seq_id)
            positions.append(len(known))  # the absolute position of the row's first scored token
            feed = runner.sync(call.seq.seq_id, known)
            if call.seq.prompt_logprobs is not None:  # the LM head over its prompt positions, fed first
                feed, prompt[b] = score_prefill(runner, call.seq.seq_id, known, feed, call.seq.output_start,
                                                call.seq.prompt_logprobs, reduce=self.rank == 0)
            feeds.append(feed + list(call.draft))
            widths.append(len(call.draft) + 1)
        logits = runner.forward(seq_ids, feeds, widths)  # [B, K+1, V]; every rank runs it (collectives)
        cached = dict(getattr(runner, "last_prefix_hits", {}))  # row -> tokens read from the prefix cache
        self._counted(len(calls))
        if self.rank != 0:
            return None
        for b, run in list(prompt.items()):  # a prompt chunk's last logits score the next chunk's first token
            call = calls[b]
            if call.seq.prompt_next is not None:
                end = PromptLogprobs(positions[b], score_tokens(logits[b, :1], [call.seq.prompt_next],
                                                                call.seq.prompt_logprobs))
                run = end if run is None else PromptLogprobs(run.first, run.entries + end.entries)
            prompt[b] = run
        rows, kept, failed = [], [], {}
        for b, (call, position) in enumerate(zip(calls, positions)):
            try:
                allowed = self._grammar_masks(call)
            except GrammarError as exc:  # this row's request fails (a 500 naming structured outputs); the others go on
                failed[b] = grammar_failure("target", call.seq.seq_id, exc)
                continue
            params = call.seq.sampling()
            kept.append(b)
            rows.append(RowVerify(params, row_scheme(params, call.seq.seed, call.seq.coupled, position), call.draft,
                                  proposal_from_wire(call.proposal), self._known.processing(call.seq.seq_id),
                                  allowed))
        # the accept step on the target's device (engine/accept.py, the in-process engine's too): tokens come back
        verdicts: list = [None] * len(calls)
        if rows:
            for b, verdict in zip(kept, verify_rows(logits[kept] if failed else logits, rows)):
                verdicts[b] = verdict
                if self.grammars is not None:  # a grammar keeps the accepted drafts and the token after them
                    with contextlib.suppress(GrammarError):  # remembered: the row's next call fails
                        self.grammars.matcher(calls[b].seq.seq_id, self._known.tokens[calls[b].seq.seq_id]
                                              + verdict.tokens)
        return VerifyResult(verdicts, time.perf_counter() - start, failed=failed,
                            prompt_logprobs={b: run for b, run in prompt.items() if run is not None},
                            cached_tokens=cached)

    def _grammar_masks(self, call: VerifyCall):  # [K+1, V] bool, or None: the row has no grammar
        """The row's grammar masks at each verify position (engine/grammar.py): its matcher, made from the grammar
        its sequence's first delta carried, synced to the committed tokens, probes the drafts. GrammarError when
        the grammar cannot be compiled here (the router compiled it before admission: a tokenizer mismatch, or no
        tokenizer table) or its matcher broke."""
        spec = call.seq.grammar_spec()
        if spec is not None:
            if self.grammars is None:
                raise GrammarError("this target worker has no grammar compiler")
            self.grammars.track(call.seq.seq_id, spec, call.seq.output_start)
        if self.grammars is None:
            return None
        return self.grammars.masks(call.seq.seq_id, self._known.tokens[call.seq.seq_id], call.draft)

    def release(self, seq_ids: list[str]) -> None:
        """Rank 0 passes the release on to the other ranks, in order with the verifies."""
        self._in_group("release", (seq_ids,), self._release)

    def _forget(self, seq_id: str) -> None:
        super()._forget(seq_id)
        if self.grammars is not None:
            self.grammars.release(seq_id)

    def stats(self) -> dict:
        return {"rank": self.rank, **super().stats(), "parameters": num_parameters(self.runner.model),
                "full_parameters": self.full_parameters,
                "grammar": None if self.grammars is None else self.grammars.compiler.stats.as_dict()}

    def ping(self) -> float:
        """As ModelWorker.ping; a rank whose group broke fails its health check at once."""
        if self.broken is not None:
            raise TensorParallelBroken(self.broken)
        return super().ping()


def ray_actor_classes():
    """The Ray actor versions of the cores (imported lazily so the cores stay usable without Ray)."""
    import ray

    # `cancel` and `ping` run on their own thread while a model call computes; every other method stays serial
    # (the default group's size is the actor's max_concurrency, 1)
    return (ray.remote(concurrency_groups={"control": 1})(DraftWorkerCore),
            ray.remote(concurrency_groups={"control": 1})(TargetWorkerCore))


