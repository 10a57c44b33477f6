"""Leases on Draft/Target replicas through Ray Serve handles; rounds call the leased workers directly."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from .scheduler import Overloaded, ReplicaGone
from .workers import DraftCall, VerifyCall

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


class _RayLease:
    def __init__(self, stream, first: dict) -> None:
        self._stream = stream
        self.key: str = first["replica"]
        self.workers = first["workers"]

    async def close(self) -> None:
        self._stream.cancel()


class RayDraftLease(_RayLease):
    async def propose(self, calls: list[DraftCall]) -> dict:
        try:
            return await self.workers[0].propose.remote(calls)
        except _DEAD as exc:
            raise ReplicaGone(str(exc)) from exc


class RayTargetLease(_RayLease):
    async def verify(self, calls: list[VerifyCall]) -> dict:
        try:  # every rank runs the forward in lockstep; rank 0 answers
            if len(self.workers) == 1:
                return await self.workers[0].verify.remote(calls)
            results = await asyncio.gather(*[w.verify.remote(calls) for w in self.workers])
        except _DEAD as exc:
            raise ReplicaGone(str(exc)) from exc
        return results[0]


class RayLeaseBroker:
    def __init__(self, draft_handle, target_handle) -> None:
        self.draft_handle = draft_handle
        self.target_handle = target_handle

    @staticmethod
    async def _lease(handle, seq_id: str, cls):
        stream = handle.options(stream=True).lease.remote(seq_id)
        try:
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise Overloaded(str(exc)) from exc
        return cls(stream, first)

    async def draft(self, seq_id: str) -> RayDraftLease:
        if self.draft_handle is None:
            raise RuntimeError("no Draft deployment in this application")
        return await self._lease(self.draft_handle, seq_id, RayDraftLease)

    async def target(self, seq_id: str) -> RayTargetLease:
        return await self._lease(self.target_handle, seq_id, RayTargetLease)
