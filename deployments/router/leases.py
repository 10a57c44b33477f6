"""Leases on Draft/Target replicas through Ray Serve handles; rounds call the leased workers' channels directly.

A lease's first item (messages.LeaseInfo) names the replica, its workers' actor handles (cancels go there, on the
"control" thread) and the endpoint of the direct channel every round's call travels (deployments/transport/channel.py;
for a target, rank 0's, which passes each call on to the other ranks). A replica the router has seen fail (its channel
closed, or its tensor-parallel group broken) is remembered. Until Serve's health check replaces it, a new target lease
that lands there is given back and tried again (with a short pause), so a request re-leasing after a crash waits for a
healthy replica instead of burning its retries on the broken one; past LEASE_RETRY_TIMEOUT_S it is answered 503. Draft
leases are not retried: a request whose draft is gone goes on with plain decoding. A replica whose KV cache is full
answers a lease with `admission.LeaseRefused`, raised here as ReplicaFull (the scheduler waits and tries again).
"""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.errors import ChainBroken, DraftGone, Overloaded, ReplicaFull, ReplicaGone, TensorParallelBroken
from deployments.router.admission import LeaseRefused
from deployments.transport.client import AsyncChannels
from deployments.transport.messages import DraftCall, DraftResult, LeaseInfo, Method, VerifyCall, VerifyResult
from deployments.transport.wire import ChannelClosed, RelayFailed

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)
# How long a lease waits for a replica that has not failed (Serve's health check every 5 s, then a new replica
# starts) before the request is answered 503; and the pause between tries.
LEASE_RETRY_TIMEOUT_S = 90.0
LEASE_RETRY_PAUSE_S = 0.25


class _RayLease:
    def __init__(self, stream, first: LeaseInfo, channels: AsyncChannels, dead: set, seq_id: str) -> None:
        self._stream = stream
        self.seq_id = seq_id
        self.key: str = first.replica
        self.workers = first.workers
        self.endpoint = first.endpoint
        self.costs: dict | None = first.costs  # measured by the replica at start, for the K policy
        self._channels = channels
        self._dead = dead  # the broker's keys of replicas seen failing

    async def close(self) -> None:
        self._stream.cancel()

    async def release(self) -> None:
        """The worker frees the sequence now, whatever becomes of the lease's cancel on its way through Serve (the
        replica's own release follows and finds nothing: releases are idempotent; and the replica's sweep closes a
        lease whose sequence was released like this: workers/replicas._reclaim_released). A target's rank 0
        passes it on."""
        try:
            await self._channels.call(self.endpoint, Method.RELEASE, [self.seq_id])
        except (ChannelClosed, TensorParallelBroken):  # the worker is gone, and its caches with it
            pass

    async def _call(self, method: str, *args):
        try:
            return await self._channels.call(self.endpoint, method, *args)
        except (ChannelClosed, TensorParallelBroken) as exc:
            raise self._failed(exc, ReplicaGone) from exc

    def _failed(self, exc: BaseException, error: type[ReplicaGone]) -> ReplicaGone:
        """Remember this replica as failed (the broker's dead set) and say so."""
        self._dead.add(self.key)
        return error(f"replica {self.key} failed: {exc}")


class RayDraftLease(_RayLease):
    async def propose(self, calls: list[DraftCall], ahead_id: int | None = None) -> DraftResult:
        return DraftResult.from_wire(await self._call(Method.PROPOSE, [call.wire() for call in calls], ahead_id))

    async def chain(self, calls: list[DraftCall], target: "RayTargetLease", verify_calls: list[VerifyCall],
                    members: list[int]) -> VerifyResult:
        """One chained round trip (transport.client.AsyncChannels.chain): this worker drafts and hands the drafts (with
        the compact proposals of unseeded sampled rows) to the target's rank 0, which samples and answers here with
        the tokens, the draft's among them."""
        try:
            result = await self._channels.chain(
                self.endpoint, target.endpoint, Method.PROPOSE_CHAINED, [call.wire() for call in calls],
                [call.wire() for call in verify_calls], members)
        except ChannelClosed as exc:
            if exc.endpoint == target.endpoint:
                raise target._failed(exc, ReplicaGone) from exc
            raise self._failed(exc, DraftGone) from exc
        except TensorParallelBroken as exc:
            raise target._failed(exc, ReplicaGone) from exc
        except RelayFailed as exc:
            raise ChainBroken(str(exc)) from exc
        return VerifyResult.from_wire(result)

    def cancel(self, ahead_id: int) -> None:
        # served on the worker's "control" thread while `propose` computes (workers.ray_actor_classes)
        self.workers[0].cancel.options(concurrency_group="control").remote(ahead_id)


class RayTargetLease(_RayLease):
    async def verify(self, calls: list[VerifyCall]) -> VerifyResult:
        """Rank 0 runs the verify with every rank in lockstep and answers.

        A dead rank 0 closes the channel; a dead peer fails rank 0's collectives (gloo: at once; NCCL: when Serve's
        health check tears the replica down). Either way the call ends with ReplicaGone.
        """
        return VerifyResult.from_wire(await self._call(Method.VERIFY, [call.wire() for call in calls]))


class RayLeaseBroker:
    def __init__(self, draft_handle, target_handle) -> None:
        self.draft_handle = draft_handle
        self.target_handle = target_handle
        self.channels = AsyncChannels()  # this router's connections to the workers' channels
        self.dead_replicas: set[str] = set()  # keys of replicas a round saw fail

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
                if isinstance(first, LeaseRefused):
                    stream.cancel()
                    raise ReplicaFull(first.message())
                if not wait_for_healthy or first.replica not in self.dead_replicas:
                    return cls(stream, first, self.channels, self.dead_replicas, seq_id)
                stream.cancel()
                error = RuntimeError(f"replica {first.replica} failed and awaits replacement")
            if time.monotonic() >= deadline:
                raise ReplicaGone(f"no healthy replica within {LEASE_RETRY_TIMEOUT_S:.0f} s: {error}") from error
            await asyncio.sleep(LEASE_RETRY_PAUSE_S)

    async def draft(self, seq_id: str) -> RayDraftLease:
        if self.draft_handle is None:
            raise RuntimeError("no Draft deployment in this application")
        return await self._lease(self.draft_handle, seq_id, RayDraftLease, wait_for_healthy=False)

    async def target(self, seq_id: str) -> RayTargetLease:
        return await self._lease(self.target_handle, seq_id, RayTargetLease, wait_for_healthy=True)

    async def ready(self, kind: str, timeout_s: float) -> bool:
        """Whether a replica of the deployment answers `ready()` within `timeout_s` (Serve holds the call while the
        deployment has no running replica; it is cancelled then)."""
        handle = self.draft_handle if kind == "draft" else self.target_handle
        if handle is None:
            return False
        response = handle.ready.remote()
        try:
            return bool(await asyncio.wait_for(response, timeout_s))
        except asyncio.TimeoutError:
            response.cancel()
            return False
