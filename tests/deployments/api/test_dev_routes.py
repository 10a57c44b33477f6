"""/pause, /resume and /is_paused (deployments/api/dev_routes.py) over a Router without a cluster: a paused router runs
no round and keeps its requests, which finish after /resume with the same text."""

import asyncio
import concurrent.futures
import json
import time

import httpx

from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, http_server, tiny_config
from tests.deployments.held_rounds import HeldRounds, until
from tests.deployments.router.test_router import PROMPT_IDS, client, plain_reference

BODY = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def dev_router(tiny_model_dirs, **overrides):
    config = tiny_config(tiny_model_dirs, dev_endpoints=True, **overrides)
    broker = LocalBroker(config)
    return Router(config, broker), broker


def test_a_paused_router_runs_no_round_and_its_requests_finish_unchanged_after_resume(tiny_model_dirs, monkeypatch):
    router, broker = dev_router(tiny_model_dirs)
    # the stream's first round goes, its second waits until /pause has reached the scheduler (so the pause lands
    # mid-stream however busy the machine), then every later round goes unless the router is paused
    with http_server(router) as base, HeldRounds(broker, monkeypatch, free=1) as rounds, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        text, paused, held, resumed, second = "", None, None, None, None
        with httpx.stream("POST", f"{base}/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if paused is None:
                    pausing = pool.submit(httpx.post, f"{base}/pause", timeout=60)
                    until(lambda: router.scheduler.gate.paused, "/pause reaching the scheduler")
                    rounds.release()  # the round in flight comes back; /pause answers after it
                    paused = pausing.result(timeout=60)
                    passed = rounds.passed
                    # admitted while paused: it becomes live, and gets no round either
                    second = pool.submit(httpx.post, f"{base}/v1/completions", json=BODY, timeout=60)
                    until(lambda: router.scheduler.num_live == 2, "the second request admitted")
                    time.sleep(0.2)  # a round that should not run would run within this (it is not a bound)
                    held = (rounds.passed - passed, httpx.get(f"{base}/is_paused").json())
                    resumed = httpx.post(f"{base}/resume", timeout=60)
        second = second.result(timeout=60)
    assert paused.status_code == 200 and paused.json() == {"paused": True, "live_sequences": 1}
    assert held == (0, {"is_paused": True}), "no verify call while paused"
    assert resumed.json() == {"paused": False, "live_sequences": 2}
    reference = plain_reference(tiny_model_dirs, PROMPT_IDS, 24)
    assert text == reference
    assert second.status_code == 200 and second.json()["choices"][0]["text"] == reference
    assert not router.scheduler.gate.paused


def test_pause_modes_other_than_keep_are_refused_by_name(tiny_model_dirs):
    router, _ = dev_router(tiny_model_dirs)

    async def go():
        async with client(router) as c:
            return await c.post("/pause", params={"mode": "abort"})

    refused = asyncio.run(go())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
    assert not router.scheduler.gate.paused


def test_the_dev_routes_are_absent_unless_configured_and_behind_the_api_key(tiny_model_dirs, monkeypatch):
    config = tiny_config(tiny_model_dirs)
    plain = Router(config, LocalBroker(config))
    monkeypatch.setenv("SPECSERVE_API_KEY", "s3cret")
    keyed, _ = dev_router(tiny_model_dirs)

    async def go():
        async with client(plain) as c:
            absent = await c.post("/pause")
        async with client(keyed) as c:
            none = await c.post("/pause")
            right = await c.post("/pause", headers={"Authorization": "Bearer s3cret"})
            await c.post("/resume", headers={"Authorization": "Bearer s3cret"})
        return absent, none, right

    absent, none, right = asyncio.run(go())
    assert absent.status_code == 404 and not plain.scheduler.gate.paused
    assert none.status_code == 401 and right.status_code == 200
    assert not keyed.scheduler.gate.paused
