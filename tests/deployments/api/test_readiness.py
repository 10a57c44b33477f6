"""GET /health: 503 with an OpenAI-style error until the router can lease the replicas a completion needs, then 200."""

import asyncio

import pytest

from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, tiny_config
from tests.deployments.router.test_router import client, complete


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


SERVE_MESSAGE = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
                 "or initial health check failing. See controller logs for details. Error:\nTraceback (most recent "
                 "call last):\n  File \"replica.py\", line 1, in initialize\ndeployments.errors.StartupError: Draft "
                 "worker cannot start: the KV-cache budget (0.000 GiB) does not hold one sequence: raise kv_cache_gib")


class FakeStatuses:
    """Serve's status source for the readiness logic: what `serve_statuses` would answer, or an error."""

    def __init__(self, states=None, error: Exception | None = None) -> None:
        self.states, self.error, self.calls = states or {}, error, 0

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.states


def test_health_names_why_a_deployment_is_not_ready_and_logs_it_once(tiny_model_dirs, caplog):
    from deployments.api.readiness import DeploymentState, DeploymentStatuses

    router, broker = _router(tiny_model_dirs, {"draft"})
    router.readiness.timeout_s = 0.01
    source = FakeStatuses({"Draft": DeploymentState("DEPLOY_FAILED", SERVE_MESSAGE),
                           "Target": DeploymentState("HEALTHY"), "Router": DeploymentState("HEALTHY")})
    router.readiness.statuses = DeploymentStatuses(source, ttl_s=60)
    caplog.set_level("WARNING", logger="ray.serve")

    async def go():
        async with client(router) as c:
            return [await c.get("/health") for _ in range(3)]

    answers = asyncio.run(go())
    reason = ("Draft worker cannot start: the KV-cache budget (0.000 GiB) does not hold one sequence: raise "
              "kv_cache_gib")
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        body = r.json()
        assert body["error"]["code"] == "not_ready"
        assert body["error"]["message"] == \
            f"not ready: no Draft replica can be leased yet (Draft DEPLOY_FAILED: {reason})"
        assert body["deployments"] == {"Draft": {"status": "DEPLOY_FAILED", "message": reason}}, "only the missing"
    assert source.calls == 1, "the status is looked up once within its time to live"
    logged = [rec.getMessage() for rec in caplog.records if "not ready" in rec.getMessage()]
    assert logged == [f"/health: the Draft deployment is not ready: DEPLOY_FAILED: {reason}"]


def test_a_failing_or_slow_status_lookup_leaves_health_as_it_was(tiny_model_dirs):
    """A lookup that fails, or that has not answered within its timeout, answers {}: /health is not held up by it.
    The slow lookup here answers only once /health has (a wait for it would end at the 60-s bound, too late)."""
    import threading

    from deployments.api.readiness import DeploymentStatuses

    router, broker = _router(tiny_model_dirs, {"target"}, model={"draft": "ngram"})
    router.readiness.timeout_s = 0.01
    failing = FakeStatuses(error=RuntimeError("no Serve controller"))
    router.readiness.statuses = DeploymentStatuses(failing, ttl_s=0)
    answered, lookup_ended = threading.Event(), threading.Event()

    def slow_lookup():
        answered.wait(60)
        lookup_ended.set()
        return {}

    async def go():
        async with client(router) as c:
            broken = await c.get("/health")
            router.readiness.statuses = DeploymentStatuses(slow_lookup, timeout_s=0.05)
            slow = await c.get("/health")
            ended_first = lookup_ended.is_set()
            answered.set()
            return broken, slow, ended_first

    broken, slow, lookup_ended_first = asyncio.run(go())
    for r in (broken, slow):
        assert r.status_code == 503 and r.json()["deployments"] == {}
        assert "(still starting: loading the models)" in r.json()["error"]["message"]
    assert failing.calls == 1 and not lookup_ended_first, "a slow lookup is not waited for"


def test_a_starting_deployment_shows_serves_status_and_a_traceback_shrinks_to_its_ends():
    from deployments.api.readiness import MESSAGE_CHARS, DeploymentState

    assert DeploymentState("UPDATING").wire() == {"status": "UPDATING", "message": ""}
    retrying = DeploymentState("UPDATING", "A replica failed to start with exception. Retrying 2 more time(s). "
                                           "Error:\nTraceback:\n  File x\n" + "  more\n" * 500 + "OSError: disk full")
    assert retrying.reason() == ("A replica failed to start with exception. Retrying 2 more time(s). Error: ... "
                                 "OSError: disk full")
    assert len(DeploymentState("UNHEALTHY", "x" * 5000).reason()) == MESSAGE_CHARS
