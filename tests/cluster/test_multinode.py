"""The app on a real multi-node Ray cluster (three raylets on this machine, cluster/local_cluster.py): Draft and
Target workers land on the nodes whose custom resources stand for their GPUs, nothing lands on the head, and
requests cross nodes (head proxy -> router -> draft and target workers) and succeed."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.local_cluster_module import lc
from tests.deployments.conftest import tiny_config, tiny_model_dirs  # noqa: F401 (fixture)

pytestmark = pytest.mark.ray
TP_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import ray

    cluster = lc.LocalCluster(Path(tempfile.mkdtemp(prefix="ssmn-", dir="/tmp")), lc.default_nodes(TP_SIZE))
    started = time.time()
    try:
        cluster.up()  # also switches this process to the cluster's token auth
        ray.init(address=cluster.gcs_address, namespace="specserve-multinode", log_to_driver=False)
        cluster.startup_s = time.time() - started
        yield cluster
    finally:
        if ray.is_initialized():  # (serve.shutdown() would start a local Ray instance otherwise)
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        cluster.down(timeout_s=3)  # Ray's processes sit out a 20-s SIGTERM grace here; this cluster is disposable
        assert cluster.pids() == set() or not any(lc._alive(p) for p in cluster.pids()), "cluster processes left"


def _roles() -> dict[str, str]:
    """node id -> head / draft / target, from the resources each raylet advertises."""
    import ray

    roles = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        res = node["Resources"]
        roles[node["NodeID"]] = ("draft" if lc.DRAFT_RESOURCE in res else
                                 "target" if lc.TARGET_RESOURCE in res else "head")
    return roles


def test_workers_land_on_their_nodes_and_requests_cross_nodes(cluster, tiny_model_dirs):  # noqa: F811
    from ray import serve
    from ray.util.state import list_actors

    from deployments.app import build_app

    roles = _roles()
    assert sorted(roles.values()) == ["draft", "head", "target"]
    worker = {"num_cpus": 0.25, "torch_threads": 1}
    config = tiny_config(
        tiny_model_dirs, tp_size=TP_SIZE, router={"num_cpus": 0.25},
        draft={**worker, "resources": {lc.DRAFT_RESOURCE: 1}},
        target={**worker, "resources": {lc.TARGET_RESOURCE: 1}},
    )
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    started = time.time()
    serve.run(build_app(config.model_dump()), name="mn", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 150
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail("the app did not come up on the multi-node cluster")
    deploy_s = time.time() - started

    actors = [a for a in list_actors(address=cluster.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)]
    where = {a.name: roles[a.node_id] for a in actors if a.name}
    drafts = {n: r for n, r in where.items() if n.startswith("specserve-draft-")}
    targets = {n: r for n, r in where.items() if n.startswith("specserve-target-r")}
    replicas = {a.class_name: roles[a.node_id] for a in actors if a.class_name.startswith("ServeReplica:mn:")}
    print(f"\ncluster up {cluster.startup_s:.1f} s, app up {deploy_s:.1f} s; placements: {sorted(where.items())}; "
          f"replicas: {replicas}")
    assert list(drafts.values()) == ["draft"], drafts
    assert sorted(n.split("-")[2] for n in targets) == [f"r{r}" for r in range(TP_SIZE)], targets
    assert set(targets.values()) == {"target"}, targets
    target_nodes = {a.node_id for a in actors if a.name in targets}
    assert len(target_nodes) == 1, "STRICT_PACK: every TP rank on one node"
    assert replicas["ServeReplica:mn:Draft"] == "draft" and replicas["ServeReplica:mn:Target"] == "target"
    assert replicas["ServeReplica:mn:Router"] != "head", "the head offers no CPU to replicas"

    # requests: proxy on the head -> router on a worker node -> draft and target workers on their nodes
    def complete(prompt, speculative: bool) -> dict:
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "speculative": {"enabled": speculative}})
        assert r.status_code == 200, r.text
        return r.json()

    for prompt in ([5, 6, 7, 8], [20, 21, 22, 23, 24]):
        spec, plain = complete(prompt, True), complete(prompt, False)
        assert spec["usage"]["completion_tokens"] == 16
        assert spec["usage"]["speculative"]["num_draft_tokens"] > 0, "the draft model on the draft node was used"
        # greedy: drafting on one node and verifying on two ranks of another changes nothing
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": [30, 31, 32], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    stats = serve.get_deployment_handle("Target", app_name="mn").stats.remote().result()
    assert [r["rank"] for r in stats["ranks"]] == list(range(TP_SIZE))
    assert all(r["calls"] > 0 for r in stats["ranks"]), "every rank verified"
    serve.delete("mn")
