"""deployments/autoscaling.py: Draft/Target replicas scale by the sequences their routers hold, and a lease being
released is no longer load."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments.autoscaling import LIVE_SEQUENCES, OVERLAP_ALLOWANCE, live_sequences_policy, replicas_for
from deployments.workers.replicas import _LeasedReplica
from tests.deployments.workers.test_replicas import _Worker, until_sent


def _context(reported: dict[str, float], running: list[str], target: float, ongoing: float = 0.0):
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    return SimpleNamespace(config=config, running_replicas=running, total_num_requests=ongoing,
                           aggregated_metrics={LIVE_SEQUENCES: reported})


@pytest.mark.parametrize("live, target, want", [(4, 2, 2), (4.3, 2, 2), (4.6, 2, 3), (2.2, 2, 1), (0, 2, 0),
                                                (8, 8, 1), (9, 8, 1), (11, 8, 2), (16, 4, 4)])
def test_the_replicas_live_sequences_need(live, target, want):
    assert replicas_for(live, target) == want


def test_a_brief_overlap_of_leases_does_not_add_a_replica_but_real_load_does():
    # four streams at two per replica: a request's lease overlapping its successor's for a moment lifts the
    # look-back average a little over 4, which is still 2 replicas; a fifth stream (5 > 4 + 2 * allowance) is 3
    assert 4 + 2 * OVERLAP_ALLOWANCE > 4.2
    assert live_sequences_policy(_context({"a": 2.1, "b": 2.05}, ["a", "b"], 2))[0] == 2
    assert live_sequences_policy(_context({"a": 2.5, "b": 2.5}, ["a", "b"], 2))[0] == 3


def test_serve_s_count_stands_in_until_every_running_replica_has_reported():
    # replica b just started and has not reported: the ongoing calls Serve counts decide
    assert live_sequences_policy(_context({"a": 1.0}, ["a", "b"], 2, ongoing=6))[0] == 3
    # a replica that stopped is not counted even if its last report is still held
    assert live_sequences_policy(_context({"a": 1.0, "gone": 9.0}, ["a"], 2, ongoing=6))[0] == 1


def test_a_lease_its_router_ended_is_not_load_while_the_worker_releases_it():
    replica, worker = _LeasedReplica(), _Worker()
    worker.arrive.clear()  # the release reaches the worker when the test says

    async def go():
        first, second = replica._hold("a", [worker], "e"), replica._hold("b", [worker], "e")
        await first.__anext__()
        await second.__anext__()
        both = replica.record_autoscaling_stats()
        held = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        held.cancel()  # the router ends request a: its release is on its way to the worker
        await until_sent(worker)
        releasing = (replica.record_autoscaling_stats(), replica.leases, list(worker.released))
        worker.arrive.set()
        await asyncio.gather(held, return_exceptions=True)
        return both, releasing, replica.record_autoscaling_stats()

    both, releasing, after = asyncio.run(go())
    assert both == {LIVE_SEQUENCES: 2.0}
    assert releasing == ({LIVE_SEQUENCES: 1.0}, 2, []), "not load any more, but its slot stays taken"
    assert after == {LIVE_SEQUENCES: 1.0}
