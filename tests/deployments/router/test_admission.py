"""KV-cache admission: refusal at the replica, the router's wait for a free slot, 503 + Retry-After past it."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from deployments.errors import Overloaded, ReplicaFull
from deployments.router import admission
from deployments.router.admission import LeaseRefused, SpaceWait, min_capacity, refusal
from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, bound_kv_cache, tiny_config
from tests.deployments.held_rounds import HeldRounds
from tests.deployments.router.test_router import PROMPT_IDS, client, complete, plain_reference


def test_a_replica_refuses_only_past_its_capacity():
    assert refusal("r", 3, None) is None, "an unbounded cache never refuses"
    assert refusal("r", 1, 2) is None
    refused = refusal("r", 2, 2)
    assert refused == LeaseRefused("r", 2, 2) and "replica r holds 2" in refused.message()
    assert min_capacity([None, None]) is None and min_capacity([8, None, 6]) == 6


def test_the_admission_limit_counts_live_waiting_and_reserved_sequences_and_a_slot_frees_its_place_once():
    gate = admission.Admission(max_live=3, max_queue_wait_s=1.0)
    first, second = gate.slot(live=0), gate.slot(live=0)
    assert gate.reserved == 2
    with pytest.raises(Overloaded, match="1 live and 2 starting"):
        gate.slot(live=1)
    first.release()
    first.release()  # idempotent: a 4xx after the place was given back frees nothing more
    assert gate.reserved == 1 and not first.held and second.held
    gate.waiting = 1  # admitted, taking its leases
    with pytest.raises(Overloaded):
        gate.check(live=1)
    gate.space.waiting = 1  # ... and it waits for a free KV-cache slot: it does not join the next round
    assert gate.joining() == 0


def test_the_wait_tries_again_until_a_slot_is_free(monkeypatch):
    monkeypatch.setattr(admission, "FIRST_PAUSE_S", 0.001)
    space, tries = SpaceWait(max_wait_s=5.0), []

    async def take():
        tries.append(space.waiting)
        if len(tries) < 3:
            raise ReplicaFull("full")
        return "lease"

    assert asyncio.run(space.lease(take)) == "lease"
    assert tries == [0, 1, 1], "counted as waiting from its first refusal on"
    assert space.waiting == 0


def test_the_wait_ends_in_an_overload_past_its_bound_and_other_errors_are_not_retried(monkeypatch):
    """The wait gives up at its first refusal past `max_wait_s` after the first one, not before and not after: on
    a clock that each refusal moves on by 0.02 s (whatever the machine's real pauses), a 0.05-s bound is the
    fourth refusal (at 0.02, 0.04, 0.06 and 0.08 s: past 0.02 + 0.05)."""
    monkeypatch.setattr(admission, "FIRST_PAUSE_S", 0.001)
    clock = [100.0]
    monkeypatch.setattr(admission, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    space, refusals = SpaceWait(max_wait_s=0.05), []

    async def full():
        clock[0] += 0.02
        refusals.append(clock[0])
        raise ReplicaFull("replica t holds 1 sequences")

    with pytest.raises(ReplicaFull, match="no free KV-cache slot within 0.05 s") as info:
        asyncio.run(asyncio.wait_for(space.lease(full), 60))
    assert isinstance(info.value, Overloaded) and len(refusals) == 4, refusals
    assert space.waiting == 0

    calls = []

    async def back_pressure():
        calls.append(1)
        raise Overloaded("the Target deployment's queue is full")

    with pytest.raises(Overloaded, match="queue is full"):
        asyncio.run(space.lease(back_pressure))
    assert calls == [1]


def test_a_request_ending_wakes_the_waiting_ones_at_once(monkeypatch):
    monkeypatch.setattr(admission, "FIRST_PAUSE_S", 3600.0)  # only the wake-up can end the pause (60 s: a hang)
    monkeypatch.setattr(admission, "MAX_PAUSE_S", 3600.0)
    space, full = SpaceWait(max_wait_s=7200.0), [True]

    async def take():
        if full[0]:
            raise ReplicaFull("full")
        return "lease"

    async def go():
        waiter = asyncio.ensure_future(space.lease(take))
        while space.waiting == 0:
            await asyncio.sleep(0.001)
        full[0] = False
        space.freed()
        return await asyncio.wait_for(waiter, 60)

    assert asyncio.run(go()) == "lease"


# ---- the router with in-process leases over a target whose KV cache has `capacity` slots ----------------------
def _router(dirs, capacity: int, **limits):
    config = tiny_config(dirs, limits=limits)
    broker = LocalBroker(config)
    bound_kv_cache(broker.cores["target"], capacity)  # a verify past the capacity would raise KVCacheFull
    return Router(config, broker), broker


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_second_request_waits_for_the_slot_and_completes_after_the_first_ends(tiny_model_dirs, monkeypatch):
    router, broker = _router(tiny_model_dirs, capacity=1)
    rounds = HeldRounds(broker, monkeypatch, free=1)  # the first request's rounds wait until the second waits
    second_prompt = [9, 8, 7, 6]

    async def go():
        async with client(router) as c:
            first = asyncio.ensure_future(complete(c, max_tokens=24))
            await _until(lambda: router.scheduler.num_live == 1)
            second = asyncio.ensure_future(complete(c, prompt=second_prompt, max_tokens=12))
            await _until(lambda: router.scheduler.space.waiting == 1)
            assert not first.done() and broker.refused >= 1
            rounds.release()
            r1 = await first
            waited_until_first_ended = not second.done()
            return r1, await second, waited_until_first_ended

    r1, r2, waited = asyncio.run(go())
    assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
    assert waited and router.scheduler.stats.timings.max_batch == 1, "the two never shared the target's cache"
    assert r1.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, PROMPT_IDS, 24)
    assert r2.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, second_prompt, 12)
    assert broker.cores["target"].runner.num_live == 0 and broker.open_leases["target"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_wait_bound_a_request_gets_503_with_retry_after_and_later_ones_are_admitted(tiny_model_dirs,
                                                                                              monkeypatch, stream):
    router, broker = _router(tiny_model_dirs, capacity=1, max_queue_wait_s=0.1)
    rounds = HeldRounds(broker, monkeypatch, free=1)  # the first request holds its slot until the second has its 503

    async def go():
        async with client(router) as c:
            first = asyncio.ensure_future(complete(c, max_tokens=30))
            await _until(lambda: router.scheduler.num_live == 1)
            refused = await complete(c, prompt=[9, 8, 7, 6], max_tokens=4, stream=stream)
            assert not first.done(), "the first request held its slot all along"
            rounds.release()
            r1 = await first
            later = await complete(c, prompt=[9, 8, 7, 6], max_tokens=4)
            return r1, refused, later

    r1, refused, later = asyncio.run(go())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "overloaded" and "no free KV-cache slot" in error["message"]
    assert r1.status_code == 200 and r1.json()["usage"]["completion_tokens"] == 30, "the running request unaffected"
    assert r1.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, PROMPT_IDS, 30)
    assert later.status_code == 200, "the slot is reused once the first request ended"
    assert router.scheduler.space.waiting == 0 and router.scheduler.num_live == 0
    assert broker.cores["target"].runner.num_live == 0 and broker.open_leases["target"] == 0


def test_requests_beyond_the_capacity_queue_and_all_complete_correctly(tiny_model_dirs):
    router, broker = _router(tiny_model_dirs, capacity=2)
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(5)]

    async def go():
        async with client(router) as c:
            return await asyncio.gather(*[complete(c, prompt=p, max_tokens=10) for p in prompts])

    results = asyncio.run(go())
    for p, r in zip(prompts, results):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, p, 10)
    assert broker.refused >= 1 and router.scheduler.stats.timings.max_batch == 2, "two at a time, batched"
    assert broker.cores["target"].runner.num_live == 0
