"""The speculative decoding loop over many sequences: draft, verify, rejection-sample, stop, stream.

One `step()` is one round for every live sequence (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1,
batched): plan -> draft -> verify -> commit, as the served round runs it spread over machines. The round plan gives
each sequence its K (engine/spec/plan.py, the served round's planner), the proposer drafts, and the target's verify
step (engine/spec/verify.TargetVerifier, the served target worker's too) scores all of them in one batched forward and
keeps the agreeing prefix plus one recovered or bonus token, on the logits' device; engine/spec/accept.commit commits
it.
Every request has a seed (its own, or one drawn at admission: SequenceState.seed), and every random number is a
function of it and the token position (engine/spec/randomness.py), so no generator state lives here. Sequences join and
leave between rounds. k = 0 (or speculation off for a sequence) is plain target decoding through the same path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.models.loading import tokenizer_eos_ids
from engine.models.transformers_runner import ModelRunner
from engine.proposers.base import Proposer, draft_rows
from engine.proposers.draft_model import DraftModelProposer
from engine.spec.target_drafts import TargetDrafter
from engine.request.delta import seq_delta
from engine.request.grammar import GrammarCompiler, GrammarError, SequenceGrammars
from engine.request.sampling import SamplingParams
from engine.request.sequence import RequestOutput, SequenceState
from engine.spec.accept import Verdict, commit
from engine.spec.options import SpeculationOptions
from engine.spec.plan import SpecRow, TreeSettings, plan_rows, plan_trees
from engine.spec.policy import AcceptanceTracker, CostProfile
from engine.spec.stats import EngineTimings, SpecStats
from engine.spec.tree import DraftTree
from engine.spec.verify import TargetVerifier, VerifyRow


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
        profile: CostProfile | None = None,
        drafter: TargetDrafter | None = None,
        tree: TreeSettings = TreeSettings(),
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.drafter = drafter  # drafts made inside the target (engine/spec/target_drafts.py), or None
        if proposer is not None and drafter is not None:
            raise ValueError("one draft source: a proposer or a drafter inside the target")
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch_for_speculation = max_batch_for_speculation  # without a profile (engine/spec/plan.py)
        self.tree = tree  # whether rounds may verify token trees (engine/spec/tree.py), planned by plan_trees
        self.profile = profile  # the costs K is planned with (engine/calibration/measure.measure_profile); None: the threshold
        self.eos_token_ids = frozenset(eos_token_ids) | tokenizer_eos_ids(tokenizer)  # see engine.models.loading
        self.timings = EngineTimings()
        self.stats = SpecStats()
        self._rows: dict[str, SpecRow] = {}  # each live request's sequence, acceptance and draft state
        self.population = AcceptanceTracker()  # acceptance over all requests (a new request's prior)
        self.tree_population = AcceptanceTracker()  # the same over tree rounds (engine/spec/plan.plan_trees)
        # structured outputs: the target's matcher per constrained request (engine/request/grammar.py); the proposer
        # keeps its own
        self.grammars = SequenceGrammars(GrammarCompiler(tokenizer, target.vocab_size, self.eos_token_ids))
        # the target's side of each round, the served target worker's too (engine/spec/verify.py)
        self.verifier = TargetVerifier(target, self.grammars, drafter=drafter)

    # ---- admission ------------------------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._rows)

    def has_work(self) -> bool:
        return bool(self._rows)

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    speculation: SpeculationOptions = SpeculationOptions()) -> None:
        """Admit a request, with its own speculation options (engine/spec/options.py): its K (0 = plain decoding;
        never above the engine's), pinned to exactly that many drafts per round with `adaptive=False`, as the served
        API's `speculative` field."""
        if request_id in self._rows:
            raise ValueError(f"request id {request_id!r} is already live")
        k = min(speculation.k_or(self.num_speculative_tokens), self.num_speculative_tokens)
        drafts = self.proposer is not None or self.drafter is not None
        seq = SequenceState.create(request_id, prompt_ids, params, k if drafts else 0,
                                   self.target.max_model_len, self.eos_token_ids, self.tokenizer)
        if params.grammar is not None:  # a bad grammar raises engine.request.grammar.GrammarError here
            try:
                self.grammars.track(request_id, params.grammar, len(seq.prompt_ids))
            except GrammarError:
                self.grammars.release(request_id)  # not admitted: nothing of it is kept
                raise
        self._rows[request_id] = SpecRow(seq, AcceptanceTracker(prior=self.population.acceptance),
                                         options=speculation)

    def abort(self, request_id: str) -> None:
        """Drop a request now (client gone); its caches are freed at once."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._release(row.seq)

    def _release(self, seq: SequenceState) -> None:
        self.verifier.release(seq.request_id)
        if self.proposer is not None:
            self.proposer.release(seq.request_id)

    # ---- one round ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        rows = list(self._rows.values())
        if not rows:
            return []
        seqs = [row.seq for row in rows]
        ks = self.plan(rows)
        trees = plan_trees(self.profile, rows, ks, len(rows), self.tree, self.tree_population)
        t0 = time.perf_counter()
        own = self.drafter is not None  # the target drafts for itself: this round verifies the drafts it holds
        drafts, proposals = draft_rows(self.proposer, seqs, ks, None if own else trees)
        for row, k in zip(rows, ks):
            if k > 0 and self.proposer is not None:
                row.draft_sent = row.seq.num_tokens
        t1 = time.perf_counter()
        verify = []
        for b, row in enumerate(rows):
            delta, tree = seq_delta(row.seq, row.target_sent), drafts[b]
            if isinstance(tree, DraftTree):
                drafts[b] = list(tree.tokens)
                verify.append(VerifyRow(delta, drafts[b], None, tree=tree))
            else:
                verify.append(VerifyRow(delta, tree, proposals[b], ks[b] if own else 0,
                                        target_tree=trees[b] if own else 0))
        outcome = self.verifier.verify(verify)
        for b, held in outcome.drafts.items():
            drafts[b] = held
        for row, k in zip(rows, ks):
            row.target_sent, row.drafted_last = row.seq.num_tokens, k > 0
        if outcome.failed:  # the grammar was compiled at admission: a matcher that broke
            raise next(iter(outcome.failed.values()))
        for b, run in outcome.prompt_logprobs.items():
            seqs[b].add_prompt_logprobs(run)
        for b, count in outcome.cached_tokens.items():
            seqs[b].add_cached_tokens(count)
        t2 = time.perf_counter()
        outputs = [self._commit(row, len(drafts[b]), outcome.verdicts[b]) for b, row in enumerate(rows)]
        t3 = time.perf_counter()
        self.timings.record(len(seqs), t1 - t0, t2 - t1, t3 - t2)
        return outputs

    def plan(self, rows: list[SpecRow]) -> list[int]:
        """Each row's draft length this round, from the planner the served round uses (engine/spec/plan.py): with
        a cost profile, planned for the batch as a whole; else the fixed `max_batch_for_speculation` threshold."""
        reads_context = isinstance(self.proposer, DraftModelProposer)  # n-gram lookup reads nothing ahead
        return plan_rows(self.profile, rows, [row.seq.k for row in rows], reads_context, len(rows), len(rows),
                         self.max_batch_for_speculation, drafts_lag=self.drafter is not None)

    def _commit(self, row: SpecRow, num_draft: int, verdict: Verdict) -> RequestOutput:
        out = commit(row.seq, num_draft, verdict, self.stats,
                     row.trackers(verdict, self.population, self.tree_population))
        if out.finished:
            self._rows.pop(row.seq.request_id, None)
            self._release(row.seq)
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
            self.add_request(rid, prompt, p, SpeculationOptions(k=k))
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
    logprobs: list | None = None  # per token an accept.TokenLogprob, when the request asked for logprobs
    prompt_logprobs: list | None = None  # [None] + per prompt token a PromptLogprob, when the request asked

    def absorb(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.text += out.new_text
        if out.finished:
            self.finished, self.finish_reason, self.stats = True, out.finish_reason, out.stats
