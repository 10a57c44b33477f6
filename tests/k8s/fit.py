"""Do the placement groups Serve will ask for fit in the pods the RayService makes? Computed, not assumed.

Each group's pod resources are what Ray's own KubeRay autoscaler reads from the group spec
(`_get_ray_resources_from_group_spec`: rayStartParams first, then the container's limits), the bundles are what
`deployments.app.deployment_options` computes from the serveConfigV2 args. Host memory is tracked as an extra
resource: a pod's memory limit less its object store and a fixed overhead, against each worker's and router's
stated needs (the overlay's numbers: Ray's scheduler itself does not reserve memory for our workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deployments.app import deployment_options
from k8s.manifests import GPU_RESOURCE
from k8s.overlay import Overlay, quantity_bytes

from .checks import app_config_of

HOST_MEMORY = "host_memory"  # pseudo-resource of this check
WORKER_GROUP = {"Draft": "draft", "Target": "target"}  # the deployment -> the worker group meant for it


@dataclass
class Node:
    group: str
    index: int
    free: dict[str, float]

    def fits(self, demand: dict[str, float]) -> bool:
        return all(self.free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items() if v > 0)

    def take(self, demand: dict[str, float]) -> None:
        for k, v in demand.items():
            self.free[k] = self.free.get(k, 0.0) - v


@dataclass
class Placement:
    problems: list[str] = field(default_factory=list)
    where: dict[str, list[str]] = field(default_factory=dict)  # "Target#0[2]" -> bundle 2 of replica 0 -> "target/0"


def _groups(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def ray_resources(group_spec: dict, is_head: bool) -> dict[str, float]:
    """What Ray's autoscaler believes a pod of this group offers (the same function decides which group to scale)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _get_ray_resources_from_group_spec,
    )

    return {k: float(v) for k, v in _get_ray_resources_from_group_spec(group_spec, is_head).items()}


def _container(group_spec: dict) -> dict:
    return group_spec["template"]["spec"]["containers"][0]


def pod_problems(rayservice: dict) -> list[str]:
    """Each group's Ray resources agree with what Kubernetes gives the pod."""
    problems = []
    for name, spec in _groups(rayservice).items():
        res = ray_resources(spec, name == "head")
        k8s = _container(spec).get("resources", {})
        limits, requests = k8s.get("limits", {}), k8s.get("requests", {})
        if limits != requests:
            problems.append(f"{name}: requests differ from limits (GPU pods need both equal)")
        k8s_gpus = int(limits.get(GPU_RESOURCE, 0))
        if res.get("GPU", 0) != k8s_gpus:
            problems.append(f"{name}: Ray sees {res.get('GPU', 0):g} GPUs, Kubernetes gives {k8s_gpus}")
        if res.get("CPU", 0) > float(limits.get("cpu", 0)):
            problems.append(f"{name}: Ray's num-cpus {res.get('CPU'):g} over the pod's {limits.get('cpu')} CPUs")
        store = int(spec["rayStartParams"].get("object-store-memory", 0))
        if store >= quantity_bytes(limits.get("memory", 0)):
            problems.append(f"{name}: object store {store} B does not fit in the pod's memory {limits.get('memory')}")
        if name == "head" and (res.get("CPU", 0) or res.get("GPU", 0)):
            problems.append("head: advertises CPUs or GPUs, so Serve replicas or model workers could land on it")
    return problems


def _nodes(rayservice: dict, overlay: Overlay, scale: str) -> list[Node]:
    nodes = []
    for name, spec in _groups(rayservice).items():
        res = ray_resources(spec, name == "head")
        limit = quantity_bytes(_container(spec)["resources"]["limits"]["memory"])
        store = int(spec["rayStartParams"].get("object-store-memory", 0))
        res[HOST_MEMORY] = float(limit - store - quantity_bytes(overlay.node_overhead))
        count = 1 if name == "head" else spec["minReplicas" if scale == "min" else "maxReplicas"]
        nodes += [Node(name, i, dict(res)) for i in range(count)]
    return nodes


def _bundles(options: dict, deployment: str, overlay: Overlay) -> list[dict[str, float]]:
    group = WORKER_GROUP[deployment]
    per_worker = overlay.pod(group).host_memory_per_worker
    bundles = [dict(b) for b in options[deployment]["placement_group_bundles"]]
    for b in bundles[1:]:  # bundle 0 is the replica actor itself; 1.. are model workers
        b[HOST_MEMORY] = float(quantity_bytes(per_worker)) if per_worker else 0.0
    return bundles


def place(rayservice: dict, overlay: Overlay, scale: str = "max") -> Placement:
    """First-fit every replica of every deployment at its min or max count onto the groups' min or max pods.
    Success proves a placement exists (first fit is not optimal, so it errs on the side of failing)."""
    _, cfg = app_config_of(rayservice)
    options = deployment_options(cfg)
    nodes = _nodes(rayservice, overlay, scale)
    out = Placement()
    for deployment in ("Target", "Draft"):
        if deployment not in options:
            continue
        opts = options[deployment]
        scaling = opts["autoscaling_config"]
        replicas = scaling["max_replicas"] if scale == "max" else scaling["min_replicas"]
        bundles = _bundles(options, deployment, overlay)
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        for r in range(replicas):
            key = f"{deployment}#{r}"
            home = next((n for n in nodes if n.fits(total)), None)
            if home is not None:  # STRICT_PACK must, PACK prefers, all bundles on one node
                home.take(total)
                out.where[key] = [f"{home.group}/{home.index}"] * len(bundles)
                continue
            if opts["placement_group_strategy"] == "STRICT_PACK":
                out.problems.append(f"{key}: no {scale}-scale pod holds all {len(bundles)} bundles {total}")
                continue
            spots = []
            for i, b in enumerate(bundles):
                node = next((n for n in nodes if n.fits(b)), None)
                if node is None:
                    out.problems.append(f"{key} bundle {i} {b}: fits no {scale}-scale pod")
                    break
                node.take(b)
                spots.append(f"{node.group}/{node.index}")
            out.where[key] = spots
    router = {"CPU": cfg.router.num_cpus, HOST_MEMORY: float(quantity_bytes(overlay.router_host_memory))}
    count = cfg.router.max_replicas if scale == "max" else cfg.router.min_replicas
    for r in range(count):
        node = next((n for n in nodes if n.fits(router)), None)
        if node is None:
            out.problems.append(f"Router#{r} {router}: fits no {scale}-scale pod beside the model replicas")
            continue
        node.take(router)
        out.where[f"Router#{r}"] = [f"{node.group}/{node.index}"]
    for key, spots in out.where.items():
        deployment = key.split("#")[0]
        if deployment in WORKER_GROUP:
            wrong = [s for s in spots[1:] if not s.startswith(WORKER_GROUP[deployment] + "/")]
            if wrong:
                out.problems.append(f"{key}: model workers on {wrong}, not on {WORKER_GROUP[deployment]} pods")
    return out


def _model_deployments(rayservice: dict):
    """(deployment, its worker group's name, its Serve options, all worker groups) for each model deployment."""
    _, cfg = app_config_of(rayservice)
    options = deployment_options(cfg)
    groups = _groups(rayservice)
    for deployment, group in WORKER_GROUP.items():
        if deployment in options:
            yield deployment, group, options[deployment], groups


def exclusivity_problems(rayservice: dict) -> list[str]:
    """A model worker's bundle fits only pods of its own group, whatever else is running (custom resources)."""
    problems = []
    for deployment, group, opts, groups in _model_deployments(rayservice):
        worker = opts["placement_group_bundles"][1]
        for name, spec in groups.items():
            fits = Node(name, 0, ray_resources(spec, name == "head")).fits(worker)
            if fits and name != group:
                problems.append(f"{deployment} worker bundle {worker} also fits an empty {name} pod")
            if not fits and name == group:
                problems.append(f"{deployment} worker bundle {worker} does not fit an empty {name} pod")
    return problems


def replica_bound_problems(rayservice: dict) -> list[str]:
    """One model replica per pod (custom resources = one replica's worth), so the group's bounds must match."""
    problems = []
    for deployment, group, opts, groups in _model_deployments(rayservice):
        scaling = opts["autoscaling_config"]
        spec = groups.get(group)
        if spec is None:
            problems.append(f"no worker group {group!r} for the {deployment} deployment")
            continue
        if spec["maxReplicas"] < scaling["max_replicas"]:
            problems.append(f"{group}: maxReplicas {spec['maxReplicas']} < {deployment} max_replicas "
                            f"{scaling['max_replicas']}")
        if spec["minReplicas"] < scaling["min_replicas"]:
            problems.append(f"{group}: minReplicas {spec['minReplicas']} < {deployment} min_replicas "
                            f"{scaling['min_replicas']}")
    return problems
