"""GET /health: 503 with an OpenAI-style error until the router can lease the replicas a completion needs, then 200."""

import asyncio

import pytest

from deployments.router import Router
from tests.deployments.conftest import LocalBroker, tiny_config
from tests.deployments.test_router import client, complete


def _router(dirs, starting: set[str], **config):
    cfg = tiny_config(dirs, **config)
    broker = LocalBroker(cfg)
    broker.starting = set(starting)
    return Router(cfg, broker), broker


def test_health_is_503_until_draft_and_target_answer_then_200_without_asking_again(tiny_model_dirs):
    router, broker = _router(tiny_model_dirs, {"draft", "target"})
    router.readiness.timeout_s = 0.01

    async def go():
        async with client(router) as c:
            both = await c.get("/health")
            broker.starting = {"draft"}  # the Target replica is up, the Draft one still loads
            draft_only = await c.get("/health")
            broker.starting = set()
            ready = await c.get("/health")
            probes = dict(broker.ready_probes)
            again = await c.get("/health")
            return both, draft_only, ready, again, probes

    both, draft_only, ready, again, probes = asyncio.run(go())
    for r in (both, draft_only):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "not_ready" and error["type"] == "server_error"
    assert "no Draft and no Target replica" in both.json()["error"]["message"]
    assert "Draft" in draft_only.json()["error"]["message"] and "Target" not in draft_only.json()["error"]["message"]
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    assert again.status_code == 200
    assert probes == {"draft": 3, "target": 2}, "a deployment found ready is not asked again"
    assert broker.ready_probes == probes, "nor is anything once all are ready"


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_without_a_draft_model_only_the_target_must_be_ready(tiny_model_dirs, draft):
    router, broker = _router(tiny_model_dirs, {"target"}, model={"draft": draft})
    router.readiness.timeout_s = 0.01

    async def go():
        async with client(router) as c:
            starting = await c.get("/health")
            broker.starting = set()
            return starting, await c.get("/health")

    starting, ready = asyncio.run(go())
    assert starting.status_code == 503 and "no Target replica" in starting.json()["error"]["message"]
    assert ready.status_code == 200
    assert broker.ready_probes["draft"] == 0, "no Draft deployment to ask"


def test_concurrent_health_requests_share_one_probe_and_a_ready_server_completes(tiny_model_dirs):
    router, broker = _router(tiny_model_dirs, {"target"})
    router.readiness.timeout_s = 0.05

    async def go():
        async with client(router) as c:
            waiting = await asyncio.gather(*[c.get("/health") for _ in range(5)])
            broker.starting = set()
            return waiting, await c.get("/health"), await complete(c, max_tokens=4)

    waiting, ready, completion = asyncio.run(go())
    assert [r.status_code for r in waiting] == [503] * 5
    assert broker.ready_probes["target"] == 2, "the five waiting health requests made one probe"
    assert ready.status_code == 200 and completion.status_code == 200
