"""Faults on a real local Ray cluster (tiny random-weight models): a tensor-parallel Target rank killed mid-stream,
a Router replica killed under load. Nothing here waits on a timing threshold; the deadlines only bound "no hang"."""

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from tests.deployments.conftest import tiny_config
from tests.deployments.serve_cluster import serve_env

pytestmark = pytest.mark.ray
PORT = 8125
APP = "faults"
TP = 2
PROMPT = [5, 6, 7, 8]
# one token per round (speculation off): many rounds, so a kill lands while the request is still generating
LONG = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True,
        "speculative": {"enabled": False}}
SHORT = {**LONG, "max_tokens": 16}
# seeded sampling with n-gram drafts at a pinned K: its text must be plain decoding's with that seed (Gumbel coupling,
# engine/spec/accept.py), also when a re-prefill on a new Target replica continues it after a failure
SEEDED = {**LONG, "temperature": 1.0, "seed": 1234, "speculative": {"k": 3, "adaptive": False}}
NO_HANG_S = 180  # a request still unanswered after this long counts as hung


def wait_for(predicate, timeout, what, interval=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def app(tiny_model_dirs):
    """Two Router replicas, one Target replica of two tensor-parallel ranks, n-gram drafts (no Draft deployment)."""
    import ray
    from ray import serve

    from deployments.app import build_app

    # the state API (ray.util.state) needs the dashboard; its port is free-ish and never the default 8265, so
    # another local cluster does not collide with this one
    with serve_env():  # Serve as `make run` starts it: HAProxy in front of the routers' own HTTP servers
        ray.init(address="local", num_cpus=8, include_dashboard=True, dashboard_port=8298, log_to_driver=False,
                 namespace="specserve-tests")
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        config = tiny_config(tiny_model_dirs, model={"draft": "ngram"}, tp_size=TP, limits={"max_tokens": 250},
                             target={"num_cpus": 0.5, "torch_threads": 1},
                             router={"min_replicas": 2, "max_replicas": 2, "num_cpus": 0.25,
                                     "max_ongoing_requests": 64, "max_queued_requests": 64})
        serve.run(build_app(config.model_dump()), name=APP, route_prefix=f"/{APP}", blocking=False)
        base = f"http://127.0.0.1:{PORT}/{APP}"

        def up():
            try:
                return httpx.get(f"{base}/v1/models", timeout=2).status_code == 200 and running("Router") == 2
            except httpx.HTTPError:
                return False

        wait_for(up, 240, "the application to come up")
        yield base
        # this process's own cluster: its replicas and workers go with it (Serve's graceful path is slow)
        ray.shutdown()


def running(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def alive_actors(prefix: str) -> list:
    """ALIVE actors whose name starts with `prefix`, from Ray's state API."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")],
                         limit=10_000, raise_on_missing_output=False)
    return [a for a in actors if (a.name or "").startswith(prefix)]


def complete(base: str, body: dict) -> str:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=NO_HANG_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == body["max_tokens"], r.json()  # EOS ignored: all of them
    return r.json()["choices"][0]["text"]


def stream(base: str, body: dict, on_first_text=None) -> dict:
    """One streaming completion; returns {"text", "done", "error"}: `done` after [DONE], `error` from an SSE error
    event, an HTTP error status, or a broken connection. Bounded: the whole exchange must end within NO_HANG_S."""
    out = {"text": "", "done": False, "error": None, "status": None}
    start = time.time()
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                          timeout=httpx.Timeout(NO_HANG_S, connect=30)) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                out["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
                return out
            for line in r.iter_lines():
                assert time.time() - start < NO_HANG_S, "stream hung"
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = event["error"]
                        continue
                    out["text"] += event["choices"][0]["text"]
                    if on_first_text is not None and out["text"]:
                        on_first_text()
                        on_first_text = None
    except httpx.TransportError as exc:  # connection closed or reset by a dying replica
        out["error"] = repr(exc)
    out["seconds"] = time.time() - start
    return out


@pytest.fixture
def target(app):
    """A handle on the Target deployment, shut down before the cluster: a handle's router thread outliving
    `ray.shutdown` would push its metrics through an automatic `ray.init` at exit."""
    from ray import serve

    handle = serve.get_deployment_handle("Target", app_name=APP)
    yield handle
    handle.shutdown()


def test_killing_one_tensor_parallel_rank_mid_stream(app, target):
    import ray

    reference = complete(app, LONG)
    seeded_reference = complete(app, {**SEEDED, "speculative": {"enabled": False}})
    before = target.stats.remote().result()
    workers = alive_actors("specserve-target-")
    assert len(workers) == TP, [a.name for a in workers]
    victim = next(a for a in workers if a.name.startswith("specserve-target-r1-"))
    killed = {}

    both_streaming, once = threading.Barrier(2), threading.Lock()

    def kill_rank_1():
        both_streaming.wait(60)  # the greedy and the seeded stream both generate
        with once:
            if not killed:
                kill()

    def kill():
        killed["leases"] = target.stats.remote().result()["leases"]  # the streams hold the replica's leases
        ray.kill(ray.get_actor(victim.name, namespace=victim.ray_namespace), no_restart=True)
        killed["at"] = time.time()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        greedy, seeded = pool.map(lambda body: stream(app, body, on_first_text=kill_rank_1), (LONG, SEEDED))
    assert killed.get("leases") == 2, "rank 1 died while both requests were generating"
    # in flight: either it completed after a re-lease with the same output (greedy; seeded: the same stream of
    # counter-based random numbers), or it ended with a clear error
    for result, expected in ((greedy, reference), (seeded, seeded_reference)):
        if result["error"] is None:
            assert result["done"] and result["text"] == expected, result
        else:
            assert not result["done"] and isinstance(result["error"], dict), result
            assert result["error"]["type"] == "server_error" and result["error"]["message"], result
    result = greedy

    print(f"in-flight request after the kill: {'error ' + str(result['error']) if result['error'] else 'completed'}"
          f" in {result['seconds']:.1f} s")
    # Serve's health check (TargetServer.check_health) finds the dead rank and replaces the replica
    def replaced():
        try:
            stats = target.stats.remote().result(timeout_s=10)
        except Exception:  # the new replica is still starting
            return False
        return stats["replica"] != before["replica"] and running("Target") == 1 and stats

    after = wait_for(replaced, 150, "a new Target replica")
    assert [r["rank"] for r in after["ranks"]] == list(range(TP))
    # later requests succeed with the right output, through both Router replicas
    for _ in range(4):
        assert complete(app, LONG) == reference
    # no orphans: the old replica's surviving rank went with it; exactly one live group of TP workers remains
    survivor = next(a for a in workers if a.name.startswith("specserve-target-r0-"))
    wait_for(lambda: len(alive_actors("specserve-target-")) == TP
             and survivor.name not in {a.name for a in alive_actors("specserve-target-")}, 60,
             "the old replica's surviving rank to exit")
    assert {a.pid for a in alive_actors("specserve-target-")} == {r["pid"] for r in after["ranks"]}


def test_killing_a_router_replica_under_load(app):
    import ray

    reference = complete(app, LONG)
    short_reference = complete(app, SHORT)
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#Router#")]
    assert len(replicas) == 2, replicas
    victim = replicas[0]

    # four long streams in flight, spread over both replicas by the proxy
    started = threading.Barrier(5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, app, LONG, lambda: started.wait(60)) for _ in range(4)]
        started.wait(120)
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        killed_at = time.time()
        # requests sent while Serve notices and replaces the replica: every one is answered (never hangs)
        during = []
        while running("Router") == 2 and time.time() - killed_at < 60:  # until the controller sees the death
            r = httpx.post(f"{app}/v1/completions", json=SHORT, timeout=NO_HANG_S)
            during.append(r.status_code)
            assert r.status_code in (200, 500, 503), r.text
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == short_reference
                assert r.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
        results = [f.result(timeout=NO_HANG_S) for f in streams]
    for res in results:
        if res["error"] is None:  # on the surviving replica: complete (the four streams shared rounds)
            assert res["done"] and res["text"] == reference, res
        else:  # on the killed replica: an error or a closed connection, not a hang
            assert not res["done"], res
    assert any(res["error"] is None for res in results), "the surviving replica finished its streams"
    print(f"in-flight streams: {sum(r['error'] is None for r in results)} completed, "
          f"{[r['error'] for r in results if r['error'] is not None]} cut")

    # Serve starts a replacement; meanwhile and afterwards the surviving replica answers every request
    def replaced():
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"SERVE_REPLICA::{APP}#Router#")}
        return running("Router") == 2 and victim["name"] not in names and len(names) == 2

    while not replaced():
        assert time.time() - killed_at < 150, "no replacement Router replica"
        assert complete(app, SHORT) == short_reference  # one at a time: exact
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # both replicas serve concurrent requests
        texts = list(pool.map(lambda _: complete(app, SHORT), range(8)))
    assert all(t == short_reference for t in texts), texts
    for _ in range(4):  # and sequential ones, whichever replica answers
        assert complete(app, SHORT) == short_reference
    print(f"requests sent before Serve saw the killed router: {during}")
