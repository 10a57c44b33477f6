"""The Draft/Target replicas' own logic without a cluster: lease accounting against the KV-cache capacity."""

import asyncio

from deployments.admission import LeaseRefused
from deployments.messages import LeaseInfo
from deployments.model_deployments import _LeasedReplica


class _Worker:
    """A model worker whose `release.remote()` is awaited by the replica; records what it released."""

    def __init__(self) -> None:
        self.released = []
        self.release = self

    def remote(self, seq_ids):
        async def run():
            await asyncio.sleep(0.01)  # the release reaches the worker a little later
            self.released.extend(seq_ids)
        return run()


def test_a_replica_refuses_leases_past_its_capacity_and_frees_the_slot_once_the_worker_released():
    replica, worker = _LeasedReplica(), _Worker()
    replica.capacity = 1

    async def go():
        first = replica._hold("a", [worker], "endpoint")
        grant = await first.__anext__()
        refused = [item async for item in replica._hold("b", [worker], "endpoint")]
        held = asyncio.ensure_future(first.__anext__())  # the lease stays open until the router cancels it
        await asyncio.sleep(0)
        held.cancel()
        await asyncio.sleep(0.002)
        releasing = (list(worker.released), replica.leases)  # the release is on its way to the worker
        await asyncio.gather(held, return_exceptions=True)
        released = (list(worker.released), replica.leases)
        third = replica._hold("c", [worker], "endpoint")
        again = await third.__anext__()
        return grant, refused, releasing, released, again, replica.leases

    grant, refused, releasing, released, again, leases = asyncio.run(go())
    assert grant == LeaseInfo(replica.replica_id, [worker], "endpoint", None)
    assert refused == [LeaseRefused(replica.replica_id, 1, 1)], "refused, and the refusal ends the stream"
    assert releasing == ([], 1), "the slot stays taken until the worker has released the sequence"
    assert released == (["a"], 0)
    assert again.replica == replica.replica_id and leases == 1, "the freed slot is leased again"


def test_an_unbounded_replica_never_refuses():
    replica = _LeasedReplica()

    async def go():
        holds = [replica._hold(f"s{i}", [_Worker()], "e") for i in range(5)]
        return [await hold.__anext__() for hold in holds], replica.leases

    grants, leases = asyncio.run(go())
    assert all(isinstance(g, LeaseInfo) for g in grants) and leases == 5
