"""What the round loop and the model workers say to each other, as plain typed dataclasses.

A round's calls and replies cross the worker channel (deployments/channel.py) as plain tuples (`wire()`,
`from_wire`): a worker unpickles a call right after its compute, with its caches cold, and there plain tuples load
~4x faster than dataclass instances (bench/RESULTS.md). So they are converted at the edges only: the worker cores
read calls `from_wire` and answer a result's `wire()`; the leases (deployments/leases.py, or the tests' in-process
ones) turn the replies back into results. Everything between, the round loop included, sees these types.

A round sends only token deltas: each call names a sequence, the position `start` from which the router's
committed tokens are new to the worker, and those tokens. Replies carry token ids (greedy rows) or processed
probabilities (sampled rows) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class SeqDelta:
    seq_id: str
    start: int  # committed tokens [0, start) were sent to this worker before
    tokens: list[int]  # committed tokens [start, ...)
    temperature: float
    top_k: int
    top_p: float
    seed: int | None

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def wire(self) -> tuple:
        return (self.seq_id, self.start, self.tokens, self.temperature, self.top_k, self.top_p, self.seed)


@dataclass(frozen=True)
class DraftCall:
    seq: SeqDelta
    k: int  # drafts wanted (0: only read the tokens, a long prompt's chunk)

    def wire(self) -> tuple:
        return (self.seq.wire(), self.k)

    @staticmethod
    def from_wire(wire: tuple) -> "DraftCall":
        return DraftCall(SeqDelta(*wire[0]), wire[1])


@dataclass(frozen=True)
class VerifyCall:
    seq: SeqDelta
    draft: list[int]  # the draft tokens to score (may be empty: plain decoding)

    def wire(self) -> tuple:
        return (self.seq.wire(), self.draft)

    @staticmethod
    def from_wire(wire: tuple) -> "VerifyCall":
        return VerifyCall(SeqDelta(*wire[0]), wire[1])


@dataclass(frozen=True)
class DraftResult:
    """A draft worker's answer to a list of DraftCalls, by call index."""

    drafts: list[list[int]]  # per call, the drafted token ids
    # sampled calls only: their draft distributions, [K, V] each; greedy rows are one-hot and the router rebuilds them
    probs: dict[int, np.ndarray]
    seconds: float  # the worker's own compute, so the router can tell the round's overhead apart
    cancelled: bool = False  # an ahead draft stopped early (`DraftWorkerCore.cancel`): `drafts` is empty

    def wire(self) -> tuple:
        return (self.drafts, self.probs, self.seconds, self.cancelled)

    @staticmethod
    def from_wire(wire: tuple) -> "DraftResult":
        return DraftResult(*wire)


@dataclass(frozen=True)
class VerifyResult:
    """A target worker's (rank 0's) answer to a list of VerifyCalls, by call index: each row's K+1 positions."""

    argmax: dict[int, list[int]]  # greedy rows: the target's argmax token at each position
    probs: dict[int, np.ndarray]  # sampled rows: the target's processed distributions, [K+1, V]
    seconds: float  # the worker's own compute
    draft: DraftResult | None = None  # a chained round's draft result (DraftLease.chain)

    def wire(self) -> tuple:
        return (self.argmax, self.probs, self.seconds, None if self.draft is None else self.draft.wire())

    @staticmethod
    def from_wire(wire: tuple) -> "VerifyResult":
        argmax, probs, seconds, draft = wire
        return VerifyResult(argmax, probs, seconds, None if draft is None else DraftResult.from_wire(draft))


def draft_replies_directly(calls: list[DraftCall]) -> bool:
    """Whether a chained round's draft result goes to the router straight from the draft worker: when some row
    samples, since its draft probabilities ([K, V]) are large and the target does not need them. Greedy rows' drafts
    are a few token ids, and travel with the target's reply (the router then wakes once per round)."""
    return any(call.seq.temperature > 0 for call in calls)


@dataclass(frozen=True)
class LeaseInfo:
    """A replica's grant of a lease (the first item of its lease stream, deployments/model_deployments.py)."""

    replica: str  # the replica's unique id: its key in the router (a failed one is remembered by it)
    workers: list  # its worker actors' handles (cancels go to workers[0]'s "control" thread)
    endpoint: Any  # channel.Endpoint of the worker every round calls (a target's rank 0)
    # measured by the replica at start for the K policy, or None: {"batch_sizes", "draft_step_seconds"} (a draft),
    # {"batch_sizes", "verify_seconds"} (a target); engine/calibrate.py
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
