"""A live request's state in the router's round loop, and the lease protocols the loop calls
(deployments/router/leases.py implements them over Ray Serve and the worker channel; tests/deployments/conftest.py
in-process)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from deployments.transport.messages import DraftCall, DraftResult, VerifyCall, VerifyResult, WireProposal
from engine.request.delta import SeqDelta, seq_delta
from engine.spec.plan import SpecRow


class DraftLease(Protocol):
    key: str
    costs: dict | None  # {"batch_sizes": [...], "draft_step_seconds": [...]} measured by the replica, or None

    async def propose(self, calls: list[DraftCall], ahead_id: int | None = None) -> DraftResult: ...

    async def chain(self, calls: list[DraftCall], target: "TargetLease", verify_calls: list[VerifyCall],
                    members: list[int]) -> VerifyResult:
        """Draft `calls`, then verify `verify_calls` at `target` with call i's drafts for row members[i], the draft
        worker handing them straight to the target's: the verify result, with the draft's as `draft`. Raises DraftGone,
        ReplicaGone (the target) or ChainBroken."""
        ...

    def cancel(self, ahead_id: int) -> None: ...

    async def close(self) -> None: ...


class TargetLease(Protocol):
    key: str
    costs: dict | None  # {"batch_sizes": [...], "verify_seconds": [[...]]} measured by the replica, or None

    async def verify(self, calls: list[VerifyCall]) -> VerifyResult: ...

    async def release(self) -> None:
        """Free the sequence on the worker now, through the round's own channel (its request ended with a round
        that has come back, so none of its calls is on the way); `close` still ends the lease."""
        ...

    async def close(self) -> None: ...


class LeaseBroker(Protocol):
    async def draft(self, seq_id: str) -> DraftLease: ...

    async def target(self, seq_id: str) -> TargetLease:
        """Raises ReplicaFull when the replica's KV cache has no free slot (deployments/router/admission.py)."""
        ...

    async def ready(self, kind: str, timeout_s: float) -> bool:
        """Whether a replica of the "draft" or "target" deployment answers within `timeout_s` (one can be
        leased: deployments/api/readiness.py)."""
        ...


@dataclass
class LiveRequest(SpecRow):
    """A request in the served round loop: its speculation state (SpecRow: sequence, acceptance, fixed K, what its
    Draft worker holds) and its leases, queue and recovery state."""

    queue: asyncio.Queue = field(kw_only=True)
    target: TargetLease = field(kw_only=True)
    draft: DraftLease | None = None
    draft_extra: list[int] = field(default_factory=list)  # tokens past those it was sent (an ahead draft's base)
    failures: int = 0
    reletting: bool = False  # its Target replica died; a new lease is being taken (it sits out the rounds)
    overlap: bool = False  # draft its next round during this round's verify
    ready: tuple[list[int], WireProposal | None] | None = None  # next round's draft (tokens, proposal), made ahead
    draft_retry_at: float = 0.0  # time.monotonic() before which no Draft lease is tried (the last one failed)
    marked_ahead: bool = False  # its last verify call asked the target to decode its next token ahead

    def delta(self, sent: int, end: int | None = None) -> SeqDelta:
        """The committed tokens [sent, end) (to the last one without `end`) for a target worker that holds [0, sent)
        (engine/request/delta.seq_delta: the settings go with a sequence's first delta to a worker only)."""
        return seq_delta(self.seq, sent, end)

    def draft_delta(self, extra: list[int], end: int | None = None) -> SeqDelta:
        """The call that leaves the draft worker holding the committed tokens plus `extra`, re-sending as little as
        possible (after a right guess the worker already holds the new tokens). With `end`: the committed tokens
        [0, end) only (a prompt chunk, read without drafting)."""
        wanted = self.seq.tokens[:end] + extra
        start, held = self.draft_sent, self.draft_extra
        same = 0
        while same < len(held) and start + same < len(wanted) and held[same] == wanted[start + same]:
            same += 1
        start += same
        delta = SeqDelta(self.seq.request_id, start, wanted[start:], self.seq.settings if start == 0 else None)
        self.draft_sent, self.draft_extra = len(self.seq.tokens[:end]), list(extra)
        return delta
