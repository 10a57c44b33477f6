"""Tensor parallelism and autoscaling on a real local Ray cluster, with tiny random-weight models (fast)."""

import concurrent.futures
import time

import httpx
import pytest

from tests.deployments.conftest import LocalBroker, http_server, tiny_config, write_profile
from tests.deployments.serve_cluster import serve_env

pytestmark = pytest.mark.ray
PORT = 8123


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray import serve

    # "local": always a new cluster, never one named by a stale /tmp/ray/ray_current_cluster of an earlier run
    with serve_env():  # Serve as `make run` starts it: HAProxy in front of the routers' own HTTP servers
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 namespace="specserve-tests")
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        yield
        serve.shutdown()
        ray.shutdown()


def replica_stats(app_name: str, timeout_s: float = 60.0) -> dict:
    """The Target deployment's `stats()` through a Serve handle from the driver. (Such a call can go unanswered,
    with the replica and its worker idle, where the replica's calls to its worker wedge behind a cancelled release:
    `replicas.detached_call` prevents that, and no retry hides it.)"""
    from ray import serve

    return serve.get_deployment_handle("Target", app_name=app_name).stats.remote().result(timeout_s=timeout_s)


def deploy(config, name):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(config.model_dump()), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{PORT}/{name}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"app {name} did not come up")


def complete(base, prompt, n=24):
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def live_sequences_of_every_worker() -> dict[str, tuple[int, list[str]]]:
    """Sequences each model worker actor of the cluster holds now, and the first ids (found by their actor names,
    every app's)."""
    import ray
    from ray.exceptions import RayActorError

    live = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(("specserve-draft-", "specserve-target-")):
            try:  # a replica scaled down meanwhile takes its workers with it
                worker = ray.get_actor(actor["name"], namespace=actor["namespace"])
                stats = ray.get(worker.stats.remote(), timeout=60)
                live[actor["name"]] = (stats["live_sequences"], stats["live_sequence_ids"])
            except (RayActorError, ValueError):
                continue
    return live


def assert_no_sequence_outlives_its_request(timeout_s: float = 15) -> None:
    """Once every request has been answered, every worker has released every sequence (a lease's release travels
    after the answer, so give it a moment). A sequence left behind would hold its KV-cache slot for good."""
    deadline = time.time() + timeout_s
    while True:
        live = live_sequences_of_every_worker()
        if not any(n for n, _ in live.values()) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert live and not any(n for n, _ in live.values()), \
        f"sequences left on workers after every request ended: {live}"


def assert_no_leak(swept_before: dict[str, int], timeout_s: float = 15) -> None:
    """After a load: every worker has released every sequence, and none of them needed the replicas' sweep since
    `swept_before` (a sequence it releases outlived its lease: a leak the guard caught, counted in `swept`)."""
    assert_no_sequence_outlives_its_request(timeout_s)
    swept = {name: n - swept_before.get(name, 0) for name, n in swept_by_every_worker().items()
             if n > swept_before.get(name, 0)}
    assert not swept, f"the sweep released sequences that outlived their leases: {swept}"


def swept_by_every_worker() -> dict[str, int]:
    import ray
    from ray.exceptions import RayActorError

    swept = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(("specserve-draft-", "specserve-target-")):
            try:
                worker = ray.get_actor(actor["name"], namespace=actor["namespace"])
                swept[actor["name"]] = ray.get(worker.stats.remote(), timeout=60)["swept"]
            except (RayActorError, ValueError):
                continue
    return swept


def target_replicas(app: str) -> int:
    """The app's RUNNING Target replicas, as Serve reports them."""
    from ray import serve

    return serve.status().applications[app].deployments["Target"].replica_states.get("RUNNING", 0)


def steady_load(base: str, app: str, streams: int, expect: int, hold_s: float = 20.0,
                limit_s: float = 120.0) -> list[int]:
    """`streams` threads sending back-to-back requests to `base` until `expect` Target replicas have been running for
    `hold_s` (or `limit_s` passed); the replica count every half second meanwhile. The window counts from the rise,
    not from the start: a replica's start (a process importing torch, loading and measuring its models) takes longer
    on a busier machine, and a fixed 30-s window once ended before the second replica ran. The requests are long
    (120 tokens), so each stream's sequence holds its lease for most of the time: between requests (HTTP,
    tokenizing, admission) a stream holds none, and with 60-token requests on these fast tiny models those gaps left
    ~2 of 4 sequences live on average (one clean-clone CI then never saw a second replica)."""
    stop = time.time() + limit_s  # the load threads read it as it moves
    counts = []

    def load():
        while time.time() < stop:
            complete(base, [5, 6, 7], n=120)

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(load) for _ in range(streams)]
        while time.time() < stop:
            counts.append(target_replicas(app))
            if counts[-1] >= expect:
                stop = min(stop, time.time() + hold_s)
            time.sleep(0.5)
        for f in futures:
            f.result()
    return counts


def test_tp2_matches_tp1_and_each_rank_holds_a_shard(ray_cluster, tiny_model_dirs):
    """The served TP-2 application's greedy texts equal one rank's: the same router and worker cores in this process
    over the unsharded models (tests/deployments/conftest.py's LocalBroker; no second application to deploy)."""
    from ray import serve

    from deployments.router.router import Router

    tp2 = deploy(tiny_config(tiny_model_dirs, tp_size=2, target={"num_cpus": 0.5, "torch_threads": 1}), "tp2")
    prompts = [[5, 6, 7, 8], [20, 21, 22, 23, 24, 25, 26], [40, 3]]
    tp1_config = tiny_config(tiny_model_dirs, tp_size=1)
    with http_server(Router(tp1_config, LocalBroker(tp1_config))) as tp1:
        for p in prompts:
            assert complete(tp2, p) == complete(tp1, p)
    stats = replica_stats("tp2")
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2, "two worker processes"
    for r in ranks:
        assert r["parameters"] < 0.55 * r["full_parameters"], r  # a shard, not a full copy
        assert r["runner"] == "StaticRunner", r  # the static runner over the rank's shard (engine/models/static/tp.py)
        assert r["gomp_spincount"] == "20000", r  # the worker processes got their environment
    assert_no_sequence_outlives_its_request()
    serve.delete("tp2")


def test_autoscaler_holds_steady_while_speculation_switches_off_and_on(ray_cluster, tiny_model_dirs, tmp_path):
    """Speculation turns off above the profile's knee (2 sequences per Target replica) and back on when a
    replica is added; throughput changes, but the replica count follows the live sequences (the leases),
    so under steady load it only rises and never swings back while the load lasts."""
    from ray import serve

    scaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2, "max_ongoing_requests": 8,
               "upscale_delay_s": 0.5, "downscale_delay_s": 2, "look_back_period_s": 1,
               "metrics_interval_s": 0.25, "num_cpus": 0.25}
    config = tiny_config(tiny_model_dirs, target=scaling,
                         speculation={"adaptive": True, "calibration": write_profile(tmp_path / "c.json", 2)})
    base = deploy(config, "steady")
    swept_before = swept_by_every_worker()
    counts = steady_load(base, "steady", streams=4, expect=2)
    spec = httpx.get(f"{base}/stats", timeout=10).json()["speculative"]
    assert 0 < spec["num_drafts"] < spec["rounds"], "rounds ran both with and without drafts"
    # 4 sequences at 2 per replica: 2 replicas (the autoscaler counts live sequences, deployments/autoscaling.py: a
    # request's lease overlapping its successor's is not a fifth), and never back down while the load lasts
    assert max(counts) == 2, f"4 sequences at 2 per replica: 2 replicas ({counts})"
    assert counts == sorted(counts), f"the replica count went down while the load lasted: {counts}"
    assert_no_leak(swept_before)
    serve.delete("steady")


def test_a_steady_load_of_n_streams_at_n_over_2_per_replica_holds_exactly_2_replicas(ray_cluster, tiny_model_dirs):
    """N = 4 streams of back-to-back requests at a per-replica target of N/2 = 2 live sequences: the Target
    deployment rises to 2 replicas, then stays at exactly 2 while the load lasts (no third from lease overlaps
    between a request and its successor, no drop between requests), and idleness lowers it to 1 again."""
    from ray import serve

    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2, "max_ongoing_requests": 8,
               "upscale_delay_s": 0.5, "downscale_delay_s": 2, "look_back_period_s": 1,
               "metrics_interval_s": 0.25, "num_cpus": 0.25}
    config = tiny_config(tiny_model_dirs, model={"draft": "ngram"}, target=scaling)
    base = deploy(config, "halves")
    swept_before = swept_by_every_worker()
    counts = steady_load(base, "halves", streams=4, expect=2)
    assert 2 in counts, f"4 streams at 2 per replica: a second replica ({counts})"
    held = counts[counts.index(2):]
    assert set(held) == {2}, f"exactly 2 replicas once the second came up ({counts})"
    assert set(counts[:counts.index(2)]) <= {1}, counts
    assert_no_leak(swept_before)
    deadline = time.time() + 60
    while time.time() < deadline and target_replicas("halves") > 1:
        time.sleep(1)
    assert target_replicas("halves") == 1, "idleness lowered it again"
    serve.delete("halves")


def test_health_check_answers_during_a_long_model_call_and_fails_a_hung_one(ray_cluster, tiny_model_dirs,
                                                                            monkeypatch):
    import asyncio
    import threading

    import ray

    from deployments.workers import replicas
    from deployments.workers.actors import ray_actor_classes
    from deployments.workers.base import BusyClock

    # the real workers answer pings on their "control" thread (an unknown group would raise here)
    engine_config = tiny_config(tiny_model_dirs).engine_config()
    draft_cls, target_cls = ray_actor_classes()
    workers = [draft_cls.options(num_cpus=0.1).remote(engine_config),
               target_cls.options(num_cpus=0.1).remote(engine_config)]
    assert ray.get([w.ping.options(concurrency_group="control").remote() for w in workers]) == [0.0, 0.0]
    for w in workers:
        ray.kill(w)

    @ray.remote(concurrency_groups={"control": 1})
    class LongCall:  # a worker in one model call until the test ends it (the real ones' take milliseconds here)
        def __init__(self):
            self.busy, self.ended = BusyClock(), threading.Event()

        def compute(self):
            with self.busy:
                self.ended.wait(300)

        @ray.method(concurrency_group="control")
        def end(self):
            self.ended.set()

        def ping(self):
            return self.busy.seconds()

    def busy_for(seconds: float) -> None:
        """Until the call has run over `seconds`, by the clock its pings report (120 s: a hang)."""
        deadline = time.monotonic() + 120
        while ray.get(worker.ping.options(concurrency_group="control").remote()) <= seconds:
            assert time.monotonic() < deadline, f"the call never ran {seconds} s"
            time.sleep(0.05)

    worker = LongCall.options(num_cpus=0.1, max_concurrency=1).remote()
    ray.get(worker.ping.remote())
    # HEALTH_PING_TIMEOUT_S as deployed (20 s): a ping stuck behind the call, which lasts until the test ends it,
    # would fail the first check
    replica = replicas._LeasedReplica()
    call = worker.compute.remote()
    busy_for(0.0)
    asyncio.run(replica._check([worker]))  # in the call, and answered: healthy
    monkeypatch.setattr(replicas, "STUCK_CALL_S", 1.5)
    busy_for(2.0)
    with pytest.raises(TimeoutError, match="taken as hung"):
        asyncio.run(replica._check([worker]))
    ray.get(worker.end.remote())
    ray.get(call, timeout=60)
    asyncio.run(replica._check([worker]))  # the call ended: healthy again
    ray.kill(worker)


def test_health_is_503_naming_the_missing_target_while_it_cannot_start(ray_cluster, tiny_model_dirs):
    from ray import serve

    from deployments.app import build_app

    # a Target replica that never starts (its worker asks for more CPUs than the cluster has); n-gram drafts, so the
    # Target is all a completion needs (serve.run would wait for the whole application)
    config = tiny_config(tiny_model_dirs, model={"draft": "ngram"}, target={"num_cpus": 64})
    serve._run(build_app(config.model_dump()), _blocking=False, name="stuck", route_prefix="/stuck")
    answers, deadline = [], time.time() + 180
    while len(answers) < 2:  # the Router's own answers (before it runs, the proxy answers 404 in plain text)
        assert time.time() < deadline, f"the Router never answered: {serve.status()}"
        # the Target never starts: a probe that waited for it would never answer (the timeout turns that into a
        # failure); one that waits readiness.PROBE_TIMEOUT_S answers 503 (tests/deployments/api/test_readiness.py)
        r = httpx.get(f"http://127.0.0.1:{PORT}/stuck/health", timeout=120)
        if r.headers.get("content-type") == "application/json":
            answers.append(r)
        time.sleep(0.5)
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "not_ready" and "no Target replica" in error["message"], error
    # Serve stops the never-placed Target replica after its graceful_shutdown_timeout_s (20 s, deployments/app.py):
    # nothing of it runs meanwhile, so the next tests go on while the application goes away. Health turning 200 once
    # a completion can run: test_one_and_two_kv_slots_start_measure_their_costs_and_serve_once_health_says_200
    serve.delete("stuck", _blocking=False)


def test_a_full_target_replica_refuses_leases_and_takes_one_again_once_a_lease_ended(ray_cluster, tiny_model_dirs):
    import asyncio

    from ray import serve

    from deployments.app import worker_spec
    from deployments.errors import ReplicaFull
    from deployments.router.leases import RayLeaseBroker
    from deployments.workers.replicas import TargetServer

    class OneSlotTarget(TargetServer):  # as if its workers' KV caches held one sequence
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.capacity = 1

    cfg = tiny_config(tiny_model_dirs)
    app = serve.deployment(OneSlotTarget, name="Target").bind(cfg.engine_config(), worker_spec(cfg, "target"), 1)
    serve.run(app, name="slots", route_prefix=None)
    broker = RayLeaseBroker(None, serve.get_deployment_handle("Target", app_name="slots"))

    async def go():
        first = await broker.target("a")
        with pytest.raises(ReplicaFull, match="holds 1 sequences"):
            await broker.target("b")
        await first.close()
        deadline = time.monotonic() + 30
        while True:  # the slot frees once the worker has released "a"
            try:
                third = await broker.target("c")
                break
            except ReplicaFull:
                assert time.monotonic() < deadline, "the slot was never freed"
                await asyncio.sleep(0.05)
        await third.close()
        return first, third.key

    first, third_key = asyncio.run(go())
    assert first.key == third_key
    stats = replica_stats("slots")
    assert stats["kv_capacity"] == 1 and "kv_capacity" in stats["ranks"][0]  # the workers report their runner's
    assert stats["swept"] == 0
    # a call reaching the worker after the lease of "a" ended would create the sequence again (none does today):
    # the replica's health checks find it and release it (deployments/workers/lease_ledger.py)
    import ray

    from deployments.transport.messages import VerifyCall
    from engine.request.delta import first_delta

    worker = first.workers[0]
    ray.get(worker.verify.remote([VerifyCall(first_delta("a", [5, 6, 7]), []).wire()]))
    assert "a" in ray.get(worker.stats.remote())["live_sequence_ids"]
    deadline = time.time() + 60
    while "a" in ray.get(worker.stats.remote())["live_sequence_ids"]:
        assert time.time() < deadline, "the sequence outlived its lease for good"
        time.sleep(0.5)
    assert replica_stats("slots")["swept"] == 1
    serve.delete("slots")


def test_one_and_two_kv_slots_start_measure_their_costs_and_serve_once_health_says_200(ray_cluster, tiny_model_dirs):
    """Replicas whose KV caches hold one or two sequences measure their costs at start within them (a start-up
    measurement past the free slots would kill the constructor, again and again); /health answers
    503 not_ready until they can serve, and once it answers 200 a speculative completion runs at once."""
    from ray import serve

    for slots in (1, 2):
        name = f"slots{slots}"
        base = deploy(tiny_config(tiny_model_dirs, runner={"max_num_seqs": slots},
                                  speculation={"adaptive": True}), name)
        deadline = time.time() + 120
        while (r := httpx.get(f"{base}/health", timeout=10)).status_code != 200:
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
            assert time.time() < deadline, "never ready"
            time.sleep(0.5)
        assert replica_stats(name)["kv_capacity"] == slots
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "speculative": {"k": 3, "adaptive": False}})  # the tiny pair costs alike: the policy would not draft
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 12 and usage["speculative"]["num_draft_tokens"] > 0, usage
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        serve.delete(name)


def test_a_kv_budget_that_holds_no_sequence_fails_the_application_and_health_says_why(ray_cluster, tiny_model_dirs):
    """Replicas that cannot start for their configuration are retried a few times only (app.CONSTRUCTOR_RETRIES),
    then the application is DEPLOY_FAILED with the workers' one-line reason, which /health's 503 carries."""
    from ray import serve

    from deployments.app import build_app

    config = tiny_config(tiny_model_dirs, runner={"kv_cache_gib": 1e-6})
    serve._run(build_app(config.model_dump()), _blocking=False, name="nobudget", route_prefix="/nobudget")
    deadline = time.time() + 240
    while (app := serve.status().applications.get("nobudget")) is None or app.status != "DEPLOY_FAILED":
        assert time.time() < deadline, f"not failed within 240 s: {app}"
        time.sleep(2)
    # the first deployment to fail fails the application; the other may still be on its last retries
    failed = [name for name, d in app.deployments.items() if d.status == "DEPLOY_FAILED"]
    assert failed and set(failed) <= {"Draft", "Target"}, app
    for name in failed:
        assert f"{name} worker cannot start: the KV-cache budget" in app.deployments[name].message, app
    while True:  # the router is up; its status lookup is cached a few seconds
        r = httpx.get(f"http://127.0.0.1:{PORT}/nobudget/health", timeout=30)
        shown = r.json().get("deployments", {}) if r.headers.get("content-type") == "application/json" else {}
        if all(shown.get(name, {}).get("status") == "DEPLOY_FAILED" for name in failed):
            break
        assert time.time() < deadline + 60, r.text
        time.sleep(1)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
    for name in failed:
        assert shown[name]["message"].startswith(f"{name} worker cannot start: the KV-cache budget"), shown
        assert "raise kv_cache_gib" in shown[name]["message"], shown
        assert f"{name} DEPLOY_FAILED: {name} worker cannot start" in r.json()["error"]["message"], r.text
    serve.delete("nobudget")
