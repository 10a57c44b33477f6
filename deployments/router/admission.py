"""KV-cache admission: a replica leases no more sequences than its KV cache has slots for, and a request that finds
no free slot waits for one, then is answered 503 with Retry-After.

The model runner's KV cache is allocated once with a fixed number of sequence slots (`runner.capacity`, from a byte
budget; None: unbounded), and `runner.add` raises `engine.models.runner.KVCacheFull` past it. A round must never meet
that: one verify carries many requests' rows, and a failed one would fail them all. So admission happens at the
lease, before a request joins any round: a Target replica counts its live leases (one per sequence) and answers a
lease past its capacity with `LeaseRefused` instead of a grant; the broker raises `ReplicaFull`. The request then
tries again with a short backoff (woken at once when one of this router's own requests ends, since its slot is free
then) until `limits.max_queue_wait_s` has passed, and ends as an overload: 503 with Retry-After, never an
out-of-memory crash. Requests already running are unaffected: they hold their slots until they end.

A slot is free again when the lease closes and the worker has released the sequence (`_LeasedReplica._hold` counts
the lease until the release has run on the worker, so a new sequence never reaches a cache that still holds the old
one). How many requests may wait is bounded by the router's admission limit (`max_live_sequences_per_router`
counts live and waiting requests). Waiting is not first-come first-served: whichever retry reaches a replica right
after a slot frees takes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from deployments.errors import Overloaded, ReplicaFull

T = TypeVar("T")

FIRST_PAUSE_S = 0.02  # the first pause between tries for a slot; doubled each try, up to MAX_PAUSE_S
MAX_PAUSE_S = 0.5


@dataclass(frozen=True)
class LeaseRefused:
    """A replica's answer to a lease when its KV cache is full (instead of the grant)."""

    replica: str
    live: int  # sequences it holds
    capacity: int  # sequences its KV cache has slots for

    def message(self) -> str:
        return f"replica {self.replica} holds {self.live} sequences, its KV cache's capacity"


def refusal(replica: str, live: int, capacity: int | None) -> LeaseRefused | None:
    """The refusal a replica holding `live` leases answers a new one with, or None: there is a free slot."""
    if capacity is not None and live >= capacity:
        return LeaseRefused(replica, live, capacity)
    return None


def min_capacity(capacities: list[int | None]) -> int | None:
    """A replica's capacity from its workers' (tensor-parallel ranks hold a shard of every sequence): the smallest
    bounded one; None when none is bounded."""
    bounded = [c for c in capacities if c is not None]
    return min(bounded) if bounded else None


class Admission:
    """The router's admission limit: its live sequences, those admitted and waiting for their leases, and the
    places taken at the door (`AdmissionSlot`) together stay under `max_live`; past it, Overloaded (503)."""

    def __init__(self, max_live: int, max_queue_wait_s: float) -> None:
        self.max_live = max_live
        self.reserved = 0  # admission slots taken at the door, not yet in the scheduler's `generate`
        self.waiting = 0  # admitted, waiting for leases (some of them for a free KV-cache slot: `space`)
        self.space = SpaceWait(max_queue_wait_s)

    def check(self, live: int) -> None:
        """Raise Overloaded when `live` sequences and those starting fill the limit."""
        if live + self.waiting + self.reserved >= self.max_live:
            raise Overloaded(f"{live} live and {self.waiting + self.reserved} starting sequences: at the router's "
                             "admission limit")

    def slot(self, live: int) -> "AdmissionSlot":
        """Take a place under the limit now (raises Overloaded when there is none)."""
        self.check(live)
        self.reserved += 1
        return AdmissionSlot(self)

    def joining(self) -> int:
        """Requests admitted and about to join the rounds (taking their leases; not those waiting for a free
        KV-cache slot: they join when a request ends)."""
        return self.waiting - self.space.waiting


class AdmissionSlot:
    """A place under the router's admission limit, taken at the HTTP door before the body is parsed or tokenized,
    so that a refusal costs no parsing; the request's `generate` consumes it. Released (idempotently) when the
    request ends before reaching the scheduler (a 4xx, a dropped connection)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission.reserved -= 1


class SpaceWait:
    """A router's requests waiting for a free KV-cache slot on a Target replica."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.waiting = 0  # requests starting that were refused and wait (they join no round meanwhile)
        self._wakers: set[asyncio.Future] = set()

    def freed(self) -> None:
        """One of this router's leases ended: a slot is (about to be) free, so waiting requests try again now."""
        for waker in self._wakers:
            if not waker.done():
                waker.set_result(None)
        self._wakers.clear()

    async def lease(self, take: Callable[[], Awaitable[T]], starting: bool = True) -> T:
        """`take()` (a lease), tried again while it raises ReplicaFull, for up to `max_wait_s` after the first
        refusal; then ReplicaFull (an Overloaded: 503 with Retry-After). `starting`: a new request (counted in
        `waiting`), not one re-leasing after its replica failed."""
        deadline, pause = None, FIRST_PAUSE_S
        try:
            while True:
                try:
                    return await take()
                except ReplicaFull as exc:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.max_wait_s
                        self.waiting += starting
                    if now >= deadline:
                        raise ReplicaFull(f"no free KV-cache slot within {self.max_wait_s:g} s "
                                          f"({exc})") from exc
                    await self._pause(min(pause, deadline - now))
                    pause = min(2 * pause, MAX_PAUSE_S)
        finally:
            if deadline is not None:
                self.waiting -= starting

    async def _pause(self, seconds: float) -> None:
        waker = asyncio.get_running_loop().create_future()
        self._wakers.add(waker)
        try:
            await asyncio.wait_for(waker, seconds)
        except asyncio.TimeoutError:
            pass
        finally:
            self._wakers.discard(waker)
