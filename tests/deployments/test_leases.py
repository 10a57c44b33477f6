"""The Ray lease broker's fault handling, with stand-in worker handles and Serve handles (no cluster)."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from deployments import leases
from deployments.leases import RayLeaseBroker, RayTargetLease
from deployments.scheduler import Overloaded, ReplicaGone


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class FakeWorker:
    """A worker actor handle: `verify` answers, hangs (a rank blocked in a collective), fails, or dies."""

    def __init__(self, rank: int, behaviour: str = "ok") -> None:
        self.rank, self.behaviour = rank, behaviour
        self.verify = _Method(self._verify)

    async def _verify(self, calls):
        await asyncio.sleep(0.01)
        if self.behaviour == "hang":
            await asyncio.Event().wait()
        if self.behaviour == "dead":
            raise ActorDiedError()
        if self.behaviour == "error":
            raise RuntimeError("gloo: connection closed by peer")
        return {"rank": self.rank} if self.rank == 0 else None


class FakeStream:
    def __init__(self, first) -> None:
        self.first, self.cancelled = first, False

    async def __anext__(self):
        if isinstance(self.first, BaseException):
            raise self.first
        return self.first

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A Serve handle whose lease streams answer with the given replicas in turn (the last one repeats)."""

    def __init__(self, replicas: list) -> None:
        self.replicas, self.streams = replicas, []
        self.lease = _Lease(self)

    def options(self, stream: bool):
        assert stream
        return self


class _Lease:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def remote(self, seq_id):
        h = self.handle
        first = h.replicas[min(len(h.streams), len(h.replicas) - 1)]
        h.streams.append(FakeStream(first))
        return h.streams[-1]


def _lease(workers, dead=None) -> RayTargetLease:
    return RayTargetLease(FakeStream(None), {"replica": "r", "workers": workers}, set() if dead is None else dead)


def test_a_dead_rank_ends_the_verify_while_the_survivor_is_still_blocked():
    dead = set()
    workers = [FakeWorker(0, "hang"), FakeWorker(1, "dead")]

    async def run():
        with pytest.raises(ReplicaGone, match="died"):
            await asyncio.wait_for(_lease(workers, dead).verify([]), 30)  # bounded: a hang fails the test

    asyncio.run(run())
    assert dead == {workers[1]}, "the broker remembers the dead worker"


def test_a_survivor_failing_its_collective_first_still_reads_as_a_dead_replica():
    workers = [FakeWorker(0, "error"), FakeWorker(1, "dead")]
    workers[1].verify = _Method(lambda calls: _later(ActorDiedError(), 0.1))  # the death is heard after the error
    with pytest.raises(ReplicaGone):
        asyncio.run(_lease(workers).verify([]))


async def _later(exc, seconds):
    await asyncio.sleep(seconds)
    raise exc


def test_rank_zero_answers_and_a_plain_error_stays_an_error():
    assert asyncio.run(_lease([FakeWorker(0), FakeWorker(1)]).verify([])) == {"rank": 0}
    with pytest.raises(RuntimeError, match="gloo"):  # every rank alive: a bug, not a dead replica
        asyncio.run(_lease([FakeWorker(0, "error"), FakeWorker(1)]).verify([]))


def test_a_target_lease_skips_a_replica_with_a_dead_worker_until_a_healthy_one_answers(monkeypatch):
    monkeypatch.setattr(leases, "LEASE_RETRY_PAUSE_S", 0.001)
    dead_worker, new_workers = FakeWorker(1), [FakeWorker(0), FakeWorker(1)]
    broken = {"replica": "old", "workers": [FakeWorker(0), dead_worker]}
    handle = FakeHandle([broken, broken, ActorDiedError(), {"replica": "new", "workers": new_workers}])
    broker = RayLeaseBroker(None, handle)
    broker.dead_workers.add(dead_worker)
    lease = asyncio.run(broker.target("seq"))
    assert lease.key == "new" and lease.workers == new_workers
    assert [s.cancelled for s in handle.streams] == [True, True, False, False], "broken leases were given back"


def test_a_target_lease_gives_up_with_replica_gone_after_the_deadline(monkeypatch):
    monkeypatch.setattr(leases, "LEASE_RETRY_PAUSE_S", 0.001)
    monkeypatch.setattr(leases, "LEASE_RETRY_TIMEOUT_S", 0.05)
    dead_worker = FakeWorker(0)
    broker = RayLeaseBroker(None, FakeHandle([{"replica": "old", "workers": [dead_worker]}]))
    broker.dead_workers.add(dead_worker)
    with pytest.raises(ReplicaGone, match="no healthy replica"):
        asyncio.run(broker.target("seq"))


def test_draft_leases_are_not_retried_and_back_pressure_is_overload():
    dead_worker = FakeWorker(0)
    broker = RayLeaseBroker(FakeHandle([{"replica": "d", "workers": [dead_worker]}]),
                            FakeHandle([BackPressureError(num_queued_requests=3, max_queued_requests=2)]))
    broker.dead_workers.add(dead_worker)
    assert asyncio.run(broker.draft("seq")).key == "d"  # the round finds it dead and decodes plainly
    with pytest.raises(Overloaded):
        asyncio.run(broker.target("seq"))
