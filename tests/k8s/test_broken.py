"""Deliberately broken manifests: the checks that pass the committed ones reject each of these."""

from __future__ import annotations

import copy

import pytest
import yaml

from k8s import overlay
from tests import REPO

from . import checks, fit

PROD = overlay.load_overlay(REPO / "k8s/overlays/prod.yaml")


def _rs() -> dict:
    return copy.deepcopy(checks.load_all(REPO / PROD.output_dir / "rayservice.yaml")[0])


def _doc(name: str) -> dict:
    return copy.deepcopy(checks.load_all(REPO / PROD.output_dir / f"{name}.yaml")[0])


def _group(rs: dict, name: str) -> dict:
    cluster = rs["spec"]["rayClusterConfig"]
    if name == "head":
        return cluster["headGroupSpec"]
    return next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == name)


def _with_args(rs: dict, **sections) -> dict:
    doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
    doc["applications"][0]["args"] = overlay.deep_merge(doc["applications"][0]["args"], sections)
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(doc, sort_keys=False)
    return rs


# ---- typos and wrong types: schema checks ---------------------------------------------------------------------
def test_typo_in_a_worker_group_field():
    rs = _rs()
    _group(rs, "target")["minReplica"] = 1
    assert any("minReplica" in p for p in checks.crd_problems(rs))


def test_typo_in_the_pod_template():
    rs = _rs()
    _group(rs, "draft")["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert any("imagePullPolicyy" in p for p in checks.crd_problems(rs))


def test_typo_in_the_cluster_config_is_caught_as_a_raycluster_too():
    rs = _rs()
    rs["spec"]["rayClusterConfig"]["enableInTreeAutoscalling"] = True
    assert checks.crd_problems(rs) and checks.crd_problems(checks.raycluster_from(rs))


def test_wrong_type_and_typo_in_metadata():
    rs = _rs()
    _group(rs, "target")["maxReplicas"] = "4"
    rs["metadata"]["lables"] = {}
    problems = checks.crd_problems(rs)
    assert any("maxReplicas" in p for p in problems) and any("lables" in p for p in problems)


def test_typo_in_ingress_pvc_and_podmonitor():
    ing = _doc("ingress")
    ing["spec"]["rules"][0]["http"]["paths"][0]["pathtype"] = "Prefix"
    assert checks.core_problems(ing)
    pvc = _doc("models-pvc")
    pvc["spec"]["acessModes"] = pvc["spec"].pop("accessModes")
    assert checks.core_problems(pvc)
    pm = _doc("podmonitor")
    pm["spec"]["podMetricEndpoints"] = pm["spec"].pop("podMetricsEndpoints")
    assert any("podMetricEndpoints" in p for p in checks.podmonitor_problems(pm))
    pm = _doc("podmonitor")
    pm["spec"]["podMetricsEndpoints"][0]["port"] = 8080  # a name, not a number
    assert checks.podmonitor_problems(pm)


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(proxy_locaton="EveryNode"), "proxy_locaton"),
    (lambda d: d["applications"][0].update(improt_path="x:y"), "improt_path"),
    (lambda d: d["applications"][0]["args"].update(tp_sise=2), "tp_sise"),
    (lambda d: d["applications"][0]["args"].update(tp_size=0), "tp_size"),
    (lambda d: d["applications"][0]["args"]["target"].update(min_replicas=9), "min_replicas"),
    (lambda d: d["applications"][0].update(import_path="deployments.app:app"), "import_path"),
])
def test_bad_serve_config_v2(edit, needle):
    doc = yaml.safe_load(_rs()["spec"]["serveConfigV2"])
    edit(doc)
    problems = checks.serve_config_problems(yaml.safe_dump(doc))
    assert any(needle in p for p in problems), problems


# ---- sizes: the placement check -----------------------------------------------------------------------------
def test_target_bundles_too_large_for_the_target_pod():
    rs = _with_args(_rs(), target={"num_cpus": 7})  # 2 x 7 + 0.05 CPUs > the pod's 12
    problems = fit.place(rs, PROD, "min").problems
    assert any(p.startswith("Target#0") and "no min-scale pod" in p for p in problems), problems


def test_more_gpus_per_worker_than_the_target_pod_has():
    rs = _with_args(_rs(), target={"num_gpus": 2})  # each worker fits an empty pod; the four together do not
    assert fit.exclusivity_problems(rs) == []
    problems = fit.place(rs, PROD, "min").problems
    assert any(p.startswith("Target#0") and "'GPU': 4.0" in p for p in problems), problems


def test_tp_size_grown_without_the_pods():
    rs = _with_args(_rs(), tp_size=4)
    assert any("Target" in p for p in fit.place(rs, PROD, "min").problems)


def test_a_custom_resource_no_pod_advertises():
    rs = _rs()
    doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
    doc["applications"][0]["args"]["draft"]["resources"] = {"specserve_draft_gpu_typo": 1}
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(doc)
    problems = fit.exclusivity_problems(rs)
    assert any("Draft" in p and "does not fit an empty draft pod" in p for p in problems), problems
    assert fit.place(rs, PROD, "min").problems


def test_workers_without_the_custom_resource_could_land_elsewhere():
    rs = _rs()
    doc = yaml.safe_load(rs["spec"]["serveConfigV2"])
    doc["applications"][0]["args"]["target"]["resources"] = {}  # a plain GPU worker: any GPU pod will do
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(doc)
    assert any("also fits an empty draft pod" in p for p in fit.exclusivity_problems(rs))


def test_pod_memory_too_small_for_the_workers():
    rs = _rs()
    limits = _group(rs, "target")["template"]["spec"]["containers"][0]["resources"]
    limits["limits"]["memory"] = limits["requests"]["memory"] = "24Gi"  # < 2 x 12Gi workers + 4Gi object store
    assert any("Target#0" in p for p in fit.place(rs, PROD, "min").problems)


def test_routers_with_no_room_beside_the_model_replicas():
    rs = _with_args(_rs(), router={"num_cpus": 4, "min_replicas": 3, "max_replicas": 3})
    assert any(p.startswith("Router#") for p in fit.place(rs, PROD, "min").problems)


def test_max_replicas_beyond_the_groups_pods():
    rs = _with_args(_rs(), draft={"max_replicas": 8})
    assert any("maxReplicas" in p for p in fit.replica_bound_problems(rs))
    assert fit.place(rs, PROD, "max").problems


def test_gpu_counts_that_disagree_and_a_head_that_would_take_work():
    rs = _rs()
    _group(rs, "target")["rayStartParams"]["num-gpus"] = "4"
    _group(rs, "head")["rayStartParams"]["num-cpus"] = "2"
    problems = fit.pod_problems(rs)
    assert any(p.startswith("target:") and "GPUs" in p for p in problems)
    assert any(p.startswith("head:") for p in problems)
