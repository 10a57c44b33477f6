"""Leases taken while requests run: a request's Draft lease on its first drafting round, and the new leases that
replace a dead replica's.

A Target replica that dies mid-request is replaced by a new lease, taken in a task of its own (it can wait for
Serve to replace the replica) while the round loop goes on for every other request; the sequence is then re-sent
from token 0 (re-prefill). Committed tokens never change, so the output does not either. A request whose Target
replica failed MAX_REPLICA_FAILURES times is answered with an error. A dead Draft replica costs less: its rows
verify without drafts that round and take a new Draft lease the next time their plan gives them drafts; a request
that finds no Draft replica decodes plainly for DRAFT_LEASE_RETRY_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from deployments.errors import ReplicaGone
from deployments.router.admission import SpaceWait
from deployments.router.live import DraftLease, LeaseBroker, LiveRequest

logger = logging.getLogger("ray.serve")

MAX_REPLICA_FAILURES = 3  # per request, before it is answered with an error
DRAFT_LEASE_RETRY_S = 5.0  # after a failed Draft lease, the request decodes plainly this long before trying again


class Recovery:
    """Takes and replaces the leases of the scheduler's live requests (`requests`, by id, shared with it)."""

    def __init__(self, broker: LeaseBroker, requests: dict[str, LiveRequest], space: SpaceWait, stats,
                 wake: Callable[[], None]) -> None:
        self.broker = broker
        self.requests = requests  # the scheduler's live requests: one that left meanwhile gets no new lease
        self.space = space
        self.stats = stats  # scheduler.SchedulerStats: replica_failures
        self._wake = wake  # a re-leased request can run rounds again
        self._relets: set[asyncio.Task] = set()
        self.last_draft: DraftLease | None = None  # the latest Draft lease taken (its replica's measured costs)

    def _is_live(self, live: LiveRequest) -> bool:
        return self.requests.get(live.seq.request_id) is live

    # ---- Target replicas --------------------------------------------------------------------------------------
    async def replace_target(self, rows: list[LiveRequest]) -> None:
        """Lease another Target replica for these rows in a task of its own: taking a lease can wait for Serve
        to replace the dead replica, and meanwhile the round loop goes on for every other request."""
        self.stats.replica_failures += 1
        for live in rows:
            live.failures += 1
            live.reletting = True
            await live.target.close()
        task = asyncio.get_running_loop().create_task(self._relet(rows))
        self._relets.add(task)  # keep a reference until it is done
        task.add_done_callback(self._relets.discard)

    async def _relet(self, rows: list[LiveRequest]) -> None:
        for live in rows:
            request_id = live.seq.request_id
            if not self._is_live(live):
                continue  # aborted meanwhile
            if live.failures > MAX_REPLICA_FAILURES:
                await self._drop(live, ReplicaGone("the target replica failed repeatedly; giving up on this request"))
                continue
            try:
                target = await self.space.lease(lambda: self.broker.target(request_id), starting=False)
            except Exception as exc:
                await self._drop(live, exc)
                continue
            if not self._is_live(live):
                await target.close()  # aborted while the lease was being taken
                continue
            live.target, live.target_sent, live.reletting = target, 0, False  # re-prefill from token 0
            live.marked_ahead = live.drafted_last = False  # the new replica holds no step or drafts of it
        self._wake()

    async def _drop(self, live: LiveRequest, exc: BaseException) -> None:
        """End a request with an error; its target lease is already closed."""
        self.requests.pop(live.seq.request_id, None)
        live.queue.put_nowait(exc)
        if live.draft is not None:
            await live.draft.close()

    # ---- Draft replicas ---------------------------------------------------------------------------------------
    async def lease_drafts(self, rows: list[LiveRequest]) -> None:
        """Draft leases for rows about to draft for the first time (or again after losing theirs). A row that gets
        none decodes plainly this round and for DRAFT_LEASE_RETRY_S."""
        async def lease(live: LiveRequest) -> None:
            try:
                draft = await self.broker.draft(live.seq.request_id)
            except Exception as exc:  # no Draft replica right now (overloaded, restarting): decode plainly meanwhile
                logger.warning("no draft lease (%s); the request decodes plainly for %.0f s", exc, DRAFT_LEASE_RETRY_S)
                live.draft_retry_at = time.monotonic() + DRAFT_LEASE_RETRY_S
                return
            if not self._is_live(live):
                await draft.close()  # the request ended while the lease was being taken
                return
            live.draft, live.draft_sent, live.draft_extra = draft, 0, []
            self.last_draft = draft

        await asyncio.gather(*(lease(live) for live in rows))

    async def replace_draft(self, rows: list[LiveRequest]) -> None:
        """The rows' Draft worker died: they verify without drafts this round and take a new Draft lease the next
        time their plan gives them drafts (reading their whole context again: the plan weighs that catch-up)."""
        self.stats.replica_failures += 1
        for live in rows:
            await live.draft.close()
            live.draft, live.ready, live.draft_extra, live.draft_sent = None, None, [], 0

    async def replace_live_drafts(self, rows: list[LiveRequest]) -> None:
        """A draft worker died under an ahead draft: new draft leases for those of `rows` still live."""
        await self.replace_draft([live for live in rows if live.seq.request_id in self.requests])
