"""Leases on Draft/Target replicas through Ray Serve handles; rounds call the leased workers directly.

A worker the router has seen die is remembered. Until Serve's health check replaces its Target replica, a new target
lease that lands there is given back and tried again (with a short pause), so a request re-leasing after a crash
waits for a healthy replica instead of burning its retries on the broken one; past LEASE_RETRY_TIMEOUT_S it is
answered 503. Draft leases are not retried: a request whose draft is gone goes on with plain decoding.
"""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from .scheduler import Overloaded, ReplicaGone
from .workers import DraftCall, VerifyCall

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)
# How long a lease waits for a replica without dead workers (Serve's health check every 5 s, then a new replica
# starts) before the request is answered 503; and the pause between tries.
LEASE_RETRY_TIMEOUT_S = 90.0
LEASE_RETRY_PAUSE_S = 0.25


class _RayLease:
    def __init__(self, stream, first: dict, dead: set) -> None:
        self._stream = stream
        self.key: str = first["replica"]
        self.workers = first["workers"]
        self.costs: dict | None = first.get("costs")  # measured by the replica at start, for the K policy
        self._dead = dead  # the broker's set of worker handles seen dead

    async def close(self) -> None:
        self._stream.cancel()

    def _gone(self, worker, exc: BaseException) -> ReplicaGone:
        self._dead.add(worker)
        return ReplicaGone(f"a worker of replica {self.key} died: {exc}")


class RayDraftLease(_RayLease):
    async def propose(self, calls: list[DraftCall], ahead_id: int | None = None) -> dict:
        try:
            if ahead_id is None:
                return await self.workers[0].propose.remote(calls)
            return await self.workers[0].propose.remote(calls, ahead_id)
        except _DEAD as exc:
            raise self._gone(self.workers[0], exc) from exc

    def cancel(self, ahead_id: int) -> None:
        # served on the worker's "control" thread while `propose` computes (workers.ray_actor_classes)
        self.workers[0].cancel.options(concurrency_group="control").remote(ahead_id)


def _consume(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a rank's late error after the round was given up is not logged as lost


class RayTargetLease(_RayLease):
    async def verify(self, calls: list[VerifyCall]) -> dict:
        """Every rank runs the forward in lockstep; rank 0 answers.

        A dead rank ends the call at once (ReplicaGone), without waiting for the surviving ranks, which may be
        blocked in a collective with the dead one until their process group notices.
        """
        if len(self.workers) == 1:
            try:
                return await self.workers[0].verify.remote(calls)
            except _DEAD as exc:
                raise self._gone(self.workers[0], exc) from exc
        tasks = {asyncio.ensure_future(w.verify.remote(calls)): w for w in self.workers}
        pending = set(tasks)
        first_error = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    exc = task.exception()
                    if isinstance(exc, _DEAD):
                        raise self._gone(tasks[task], exc) from exc
                    if exc is not None and first_error is None:
                        # maybe a survivor's collective failing because a peer died: wait for the others
                        first_error = exc
        finally:
            for task in tasks:
                task.add_done_callback(_consume)
        if first_error is not None:
            raise first_error
        return next(iter(tasks)).result()


class RayLeaseBroker:
    def __init__(self, draft_handle, target_handle) -> None:
        self.draft_handle = draft_handle
        self.target_handle = target_handle
        self.dead_workers: set = set()  # actor handles (hashed by actor id) seen dead by a round

    async def _lease(self, handle, seq_id: str, cls, wait_for_healthy: bool):
        deadline = time.monotonic() + LEASE_RETRY_TIMEOUT_S
        while True:
            stream = handle.options(stream=True).lease.remote(seq_id)
            try:
                first = await stream.__anext__()
            except BackPressureError as exc:
                raise Overloaded(str(exc)) from exc
            except _DEAD as exc:  # the replica actor itself died between routing and answering
                if not wait_for_healthy:
                    raise ReplicaGone(str(exc)) from exc
                error: BaseException = exc
            else:
                if not wait_for_healthy or not any(w in self.dead_workers for w in first["workers"]):
                    return cls(stream, first, self.dead_workers)
                stream.cancel()
                error = RuntimeError(f"replica {first['replica']} has a dead worker and awaits replacement")
            if time.monotonic() >= deadline:
                raise ReplicaGone(f"no healthy replica within {LEASE_RETRY_TIMEOUT_S:.0f} s: {error}") from error
            await asyncio.sleep(LEASE_RETRY_PAUSE_S)

    async def draft(self, seq_id: str) -> RayDraftLease:
        if self.draft_handle is None:
            raise RuntimeError("no Draft deployment in this application")
        return await self._lease(self.draft_handle, seq_id, RayDraftLease, wait_for_healthy=False)

    async def target(self, seq_id: str) -> RayTargetLease:
        return await self._lease(self.target_handle, seq_id, RayTargetLease, wait_for_healthy=True)
