"""What the round loop and the model workers say to each other, as plain typed dataclasses.

A round's calls and replies cross the worker channel (deployments/transport/channel.py) as plain tuples (`wire()`,
`from_wire`): a worker unpickles a call right after its compute, with its caches cold, and there plain tuples load
much faster than dataclass instances (bench/RESULTS.md). So they are converted at the edges only: the worker cores
read calls `from_wire` and answer a result's `wire()`; the leases (deployments/router/leases.py, or the tests'
in-process ones) turn the replies back into results. Everything between, the round loop included, sees these types.

A round sends only token deltas (engine/request/delta.SeqDelta): each call names a sequence, the position `start` from
which the router's committed tokens are new to the worker, and those tokens; a sequence's first delta to a worker
carries its settings (engine/request/settings.SequenceSettings: the frozen sampling parameters with the grammar, the
seed, the prompt's length), which the worker keeps with its known tokens. The target worker samples (engine/spec/accept.py, on its device) and answers per row
the tokens to emit, how many drafts it accepted and, when asked, their logprobs (and a prefilling row's prompt logprobs,
engine/request/prompt_logprobs.py): a few dozen bytes per token, never a probability tensor. A row a worker cannot serve
(its grammar fails there) is answered as a RowFailure in the reply, by call index, so one request's failure never fails
the call's other rows. The only distributions on the wire are the draft's compact proposals of unseeded sampled rows
([K, N] token ids and probabilities, engine/spec/proposal.py): in a chained round they go from the draft worker straight
to the target worker; when the router holds drafts made ahead (deployments/router/draft_ahead.py) or drafted by several
Draft leases, it forwards each row's compact proposal unchanged inside its VerifyCall (router -> target), never reading
it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.request.delta import SeqDelta
from engine.request.prompt_logprobs import PromptLogprobs
from engine.spec.accept import TokenLogprob, Verdict
from engine.spec.target_drafts import DraftFrom
from engine.spec.tree import DraftTree
from engine.spec.proposal import CompactProposal

# a compact proposal on the wire: ([K, N] int32 token ids, [K, N] float32 probabilities)
WireProposal = tuple[np.ndarray, np.ndarray]


class Method(str, enum.Enum):
    """The worker channel's methods: the one list of the names the router and the workers call each other by
    (a worker's handlers are keyed by these; a call names one)."""

    PROPOSE = "propose"  # router -> draft: DraftCalls, an ahead id or None -> a DraftResult
    PROPOSE_CHAINED = "propose_chained"  # router -> draft: DraftCalls, VerifyCalls, members, the target's route
    VERIFY = "verify"  # router -> target rank 0 (and rank 0 -> the other ranks): VerifyCalls -> a VerifyResult
    VERIFY_CHAINED = "verify_chained"  # draft -> target rank 0: VerifyCalls, members, a DraftResult
    VERIFY_AHEAD = "verify_ahead"  # target rank 0 -> its other ranks: a step decoded ahead
    # target rank 0 -> its other ranks, with a drafter inside the target (engine/spec/target_drafts.DraftPeers):
    TARGET_DRAFTING = "target_drafting"  # the rows its drafter drafts from and their verdicts' tokens
    TARGET_DRAFTS = "target_drafts"  # the drafts it made, kept for the rows' next calls
    RELEASE = "release"  # router -> worker: sequence ids whose requests ended


def proposal_to_wire(proposal: CompactProposal | None) -> WireProposal | None:
    return None if proposal is None else (proposal.token_ids.numpy(), proposal.probs.numpy())


def proposal_from_wire(wire: WireProposal | None) -> CompactProposal | None:
    return None if wire is None else CompactProposal(torch.from_numpy(wire[0]), torch.from_numpy(wire[1]))


def head(wire: WireProposal | None, start: int, end: int | None = None) -> WireProposal | None:
    """Draft positions [start, end) of a wire proposal (an ahead draft's, cut to a round's K)."""
    return None if wire is None else (wire[0][start:end], wire[1][start:end])


@dataclass(frozen=True)
class DraftCall:
    seq: SeqDelta
    k: int  # drafts wanted (0: only read the tokens, a long prompt's chunk)
    tree: int = 0  # drafts as a token tree of at most this many nodes, k deep (engine/spec/tree.py); 0: a chain

    def wire(self) -> tuple:
        return (self.seq.wire(), self.k, self.tree)

    @staticmethod
    def from_wire(wire: tuple) -> "DraftCall":
        return DraftCall(SeqDelta(*wire[0]), wire[1], wire[2])


@dataclass(frozen=True)
class VerifyCall:
    seq: SeqDelta
    draft: list[int]  # the draft tokens to score (may be empty: plain decoding)
    proposal: WireProposal | None = None  # unseeded sampled model drafts: the compact proposal they came from
    # the row will not draft next round: the target may decode its next token ahead
    # (deployments/workers/decode_ahead.py)
    ahead: bool = False
    # drafts from the target's own drafter (engine/spec/target_drafts.py): verify up to this many of those it
    # holds for the row, and make as many for its next round (0: none)
    target_k: int = 0
    # the draft as a token tree (engine/spec/tree.py): each draft token's parent (0: the row's last committed token,
    # i: draft i - 1); None: a chain
    parents: list[int] | None = None
    # with target_k: the target drafter makes a tree of at most this many nodes for the next round (0: a chain)
    target_tree: int = 0

    def tree(self) -> DraftTree | None:
        return None if self.parents is None else DraftTree(tuple(self.draft), tuple(self.parents))

    def wire(self) -> tuple:
        return (self.seq.wire(), self.draft, self.proposal, self.ahead, self.target_k, self.parents, self.target_tree)

    @staticmethod
    def from_wire(wire: tuple) -> "VerifyCall":
        seq, draft, proposal, ahead, target_k, parents, target_tree = wire
        return VerifyCall(SeqDelta(*seq), draft, proposal, ahead, target_k, parents, target_tree)


@dataclass(frozen=True)
class RowFailure:
    """One row's failure on a worker after admission (its grammar would not compile or broke there, say): that
    row's request ends with this error (deployments/errors.RequestFailed: a 500 naming the cause), while the call's
    other rows go on. A typed reply, not an exception: one row must not fail the whole call."""

    code: str  # OpenAI error JSON's `code`, e.g. "structured_outputs_failed"
    message: str  # for the client: what failed, and where

    def wire(self) -> tuple:
        return (self.code, self.message)


def failures_to_wire(failed: dict[int, RowFailure]) -> dict[int, tuple]:
    return {i: f.wire() for i, f in failed.items()}


def failures_from_wire(wire: dict[int, tuple]) -> dict[int, RowFailure]:
    return {i: RowFailure(*f) for i, f in wire.items()}


@dataclass(frozen=True)
class DraftResult:
    """A draft worker's answer to a list of DraftCalls, by call index."""

    drafts: list[list[int]]  # per call, the drafted token ids
    # unseeded sampled calls only: the compact proposals their drafts were drawn from (for the target's sampler;
    # a chained round's reply to the router comes without them)
    proposals: dict[int, WireProposal]
    seconds: float  # the worker's own compute, so the router can tell the round's overhead apart
    cancelled: bool = False  # an ahead draft stopped early (`DraftWorkerCore.cancel`): `drafts` is empty
    failed: dict[int, RowFailure] = field(default_factory=dict)  # calls that failed (their drafts are empty)
    parents: dict[int, list[int]] = field(default_factory=dict)  # calls whose drafts are a tree: its parents

    def wire(self) -> tuple:
        return (self.drafts, self.proposals, self.seconds, self.cancelled, failures_to_wire(self.failed),
                self.parents)

    @staticmethod
    def from_wire(wire: tuple) -> "DraftResult":
        drafts, proposals, seconds, cancelled, failed, parents = wire
        return DraftResult(drafts, proposals, seconds, cancelled, failures_from_wire(failed), parents)

    def without_proposals(self) -> "DraftResult":
        return DraftResult(self.drafts, {}, self.seconds, self.cancelled, self.failed, self.parents)


def calls_with_drafts(calls: list[tuple], members: list[int], draft: DraftResult) -> list[tuple]:
    """A chained round's VerifyCalls (wire form) with call i of the draft's tokens and compact proposal in row
    members[i]; the other rows as they came."""
    calls = list(calls)
    for i, b in enumerate(members):
        seq, _, _, ahead, target_k, _, target_tree = calls[b]
        calls[b] = (seq, draft.drafts[i], draft.proposals.get(i), ahead, target_k, draft.parents.get(i), target_tree)
    return calls


def chained_reply(verified: tuple, draft: DraftResult) -> tuple:
    """A chained round's reply to the router: the verify's VerifyResult (wire form) carrying the draft's result,
    without its proposals (the router does not need them)."""
    rows, seconds, _, *rest = verified
    return (rows, seconds, draft.without_proposals().wire(), *rest)


@dataclass(frozen=True)
class VerifyResult:
    """A target worker's (rank 0's) answer to a list of VerifyCalls, by call index: each row's verdict (its tokens
    to emit, drafts accepted, logprobs if asked), computed on the target's device by engine/spec/accept.verify_rows."""

    verdicts: list[Verdict | None]  # None: the row failed (`failed`)
    seconds: float  # the worker's own compute
    draft: DraftResult | None = None  # a chained round's draft result, without proposals (DraftLease.chain)
    # by call index: the prompt logprobs the call's prompt tokens were scored with (rows that asked, while prefilling)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    failed: dict[int, RowFailure] = field(default_factory=dict)  # rows that failed on the target, by call index
    # by call index: tokens of the call's feed whose keys/values came from the prefix cache
    # (engine/models/static/prefix_cache.py)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    ahead_rows: int = 0  # rows answered from a step decoded ahead (deployments/workers/decode_ahead.py)
    # by call index, rows with a target_k: the target drafter's drafts they verified (empty: none held for them)
    target_drafts: dict[int, list[int]] = field(default_factory=dict)
    target_draft_seconds: float = 0.0  # of `seconds`, the target drafter's (the next round's drafts)

    def wire(self) -> tuple:
        rows = [None if v is None else
                (v.tokens, v.num_accepted, None if v.logprobs is None else [tuple(lp) for lp in v.logprobs], v.depth)
                for v in self.verdicts]
        return (rows, self.seconds, None if self.draft is None else self.draft.wire(),
                {b: run.wire() for b, run in self.prompt_logprobs.items()}, failures_to_wire(self.failed),
                self.cached_tokens, self.ahead_rows, self.target_drafts, self.target_draft_seconds)

    @staticmethod
    def from_wire(wire: tuple) -> "VerifyResult":
        rows, seconds, draft, prompt, failed, cached, ahead, target_drafts, target_draft_seconds = wire
        verdicts = [None if row is None else
                    Verdict(row[0], row[1], None if row[2] is None else [TokenLogprob(*lp) for lp in row[2]],
                            depth=row[3])
                    for row in rows]
        return VerifyResult(verdicts, seconds, None if draft is None else DraftResult.from_wire(draft),
                            {b: PromptLogprobs.from_wire(run) for b, run in prompt.items()},
                            failures_from_wire(failed), cached, ahead, target_drafts, target_draft_seconds)


@dataclass(frozen=True)
class LeaseInfo:
    """A replica's grant of a lease (the first item of its lease stream, deployments/workers/replicas.py)."""

    replica: str  # the replica's unique id: its key in the router (a failed one is remembered by it)
    workers: list  # its worker actors' handles (cancels go to workers[0]'s "control" thread)
    endpoint: Any  # channel.Endpoint of the worker every round calls (a target's rank 0)
    # measured by the replica at start for the K policy, or None: {"batch_sizes", "draft_step_seconds"} (a draft),
    # {"batch_sizes", "verify_seconds"} (a target); engine/calibration/measure.py
    costs: dict | None = None


@dataclass(frozen=True)
class CostObservation:
    """What one draft or verify call of a round cost: fed to the pairing's cost correction
    (round_costs.RoundCosts.observe) once the round's result is in hand."""

    draft: Any  # the pairing's DraftLease (None: no Draft lease taken yet)
    target: Any  # its TargetLease
    kind: str  # "draft" | "verify"
    calls: list  # the call's DraftCalls or VerifyCalls (a prompt among them makes it no steady-state round)
    k: int  # the call's longest draft
    seconds: float  # the worker's own compute


def draft_starts_to_wire(rows: list[DraftFrom]) -> list[tuple]:
    """Where a target drafter's rows start (TARGET_DRAFTING, TARGET_DRAFTS), as plain tuples."""
    return [(r.seq_id, r.index, r.position, r.committed, r.last, r.k, r.tree) for r in rows]


def draft_starts_from_wire(wire: list[tuple]) -> list[DraftFrom]:
    return [DraftFrom(*row) for row in wire]


def target_drafts_to_wire(drafts: list[list[int] | DraftTree]) -> list[tuple]:
    """A target drafter's drafts per row: (tokens, None) for a chain, (tokens, parents) for a tree."""
    return [(list(d.tokens), list(d.parents)) if isinstance(d, DraftTree) else (list(d), None) for d in drafts]


def target_drafts_from_wire(wire: list[tuple]) -> list[list[int] | DraftTree]:
    return [tokens if parents is None else DraftTree(tuple(tokens), tuple(parents)) for tokens, parents in wire]
