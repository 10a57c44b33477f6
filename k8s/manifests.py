"""KubeRay manifests generated from serve_config.yaml plus an overlay; never edited by hand.

Run from the repository root (every path below and in an overlay is relative to it; `--root` names another):

    python -m k8s.manifests           # (re)write every overlay's outputs (k8s/prod/, k8s/kind/, ...)
    python -m k8s.manifests --check   # exit 1 and name the files that differ from what would be written

This is a build tool beside the manifests it writes, not serving code: it is not part of the installed package
(the image holds engine/ and deployments/ only). It validates with the application's own config model.

An overlay (k8s/overlays/*.yaml) holds two things: `args`, merged over the application args of serve_config.yaml
and validated by `deployments.config.SpecServeConfig` (the one config model of the application), and the cluster
layout that is not the application's business (image, pod sizes, volumes, ingress), validated by `Overlay`
(k8s/overlay.py).
Pod resources follow the Serve options `deployments.app.deployment_options` computes from the config: a draft pod
advertises one draft worker's GPUs and custom resources, a target pod `tp_size` workers' (its STRICT_PACK group).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import math
import sys
from pathlib import Path

import yaml

from deployments.config import ScalingSection, SpecServeConfig
from deployments.dashboard import build_dashboard
from deployments.ray_env import SERVE_ENV

from .overlay import OVERLAYS_DIR, Overlay, app_config, load_overlay, overlays, quantity_bytes

SERVE_CONFIG = Path("serve_config.yaml")  # relative to the repository root, like every path here
GPU_RESOURCE = "nvidia.com/gpu"
SERVE_PORT, METRICS_PORT, DASHBOARD_PORT, AGENT_PORT, GCS_PORT, CLIENT_PORT = 8000, 8080, 8265, 52365, 6379, 10001
GROUPS = ("draft", "target")  # worker group name == the Serve deployment it hosts
MODEL_PAIR_ANNOTATION = "specserve.io/model-pair"
CACHE_DIR = "/cache"
_HEALTH = "wget -T 2 -q -O- http://localhost:{port}/{path} | grep success"
RAYLET_HEALTH = _HEALTH.format(port=AGENT_PORT, path="api/local_raylet_healthz")
GCS_HEALTH = _HEALTH.format(port=DASHBOARD_PORT, path="api/gcs_healthz")
SERVE_PROXY_HEALTH = _HEALTH.format(port=SERVE_PORT, path="-/healthz")  # Serve's proxy alone, whatever the app's state
# the application's readiness: 200 once the router can lease the Draft and Target replicas, 503 while they start
# (deployments/api/readiness.py); wget exits non-zero on a 503
APP_READY = f"wget -T 2 -q -O /dev/null http://localhost:{SERVE_PORT}/health"
APP_START_PROBES = 360  # x 5 s: how long the application may take to start (load its models) before a restart
def workers_per_pod(cfg: SpecServeConfig, group: str) -> int:
    return cfg.tp_size if group == "target" else 1


def section(cfg: SpecServeConfig, group: str) -> ScalingSection:
    return cfg.target if group == "target" else cfg.draft


def pod_gpus(cfg: SpecServeConfig, group: str) -> int:
    return math.ceil(section(cfg, group).num_gpus * workers_per_pod(cfg, group))


def pod_custom_resources(cfg: SpecServeConfig, group: str) -> dict[str, int]:
    """One replica's worth: what the group's pods advertise, so a pod holds exactly one replica's workers."""
    out = {}
    for name, amount in sorted(section(cfg, group).resources.items()):
        total = amount * workers_per_pod(cfg, group)
        if total != int(total):
            raise ValueError(f"{group}.resources.{name} x workers per pod must be whole (Ray start parameters)")
        out[name] = int(total)
    return out


def model_pair_hash(cfg: SpecServeConfig) -> str:
    """Changes with the model pair (and tp_size): the pod templates carry it, so KubeRay rolls a new cluster."""
    key = json.dumps({"model": cfg.model.model_dump(mode="json"), "tp_size": cfg.tp_size}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _probe(command: str, **timing) -> dict:
    return {"exec": {"command": ["bash", "-c", command]}, **timing}


def _container(ov: Overlay, cfg: SpecServeConfig, group: str) -> dict:
    pod = ov.pod(group)
    limits = {"cpu": str(pod.cpu), "memory": pod.memory}
    gpus = pod_gpus(cfg, group) if group != "head" else 0
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    ports = [{"name": "serve", "containerPort": SERVE_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}]
    env = [
        {"name": cfg.api_key_env,
         "valueFrom": {"secretKeyRef": {"name": ov.api_key_secret.name, "key": ov.api_key_secret.key}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},  # weights come from the volume or the cache, never downloaded
        {"name": "SPECSERVE_CACHE", "value": f"{CACHE_DIR}/specserve"},
        # Ray Serve's throughput mode behind HAProxy (deployments/ray_env.py), read by Ray when the pod starts it
        *({"name": k, "value": v} for k, v in SERVE_ENV.items()),
    ]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}]
    if ov.models:
        if ov.models.hf_home:
            env.append({"name": "HF_HOME", "value": ov.models.hf_home})
        mounts.append({"name": "models", "mountPath": ov.models.mount_path, "readOnly": True})
    if group == "head":
        ports = [{"name": "gcs", "containerPort": GCS_PORT}, {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                 {"name": "client", "containerPort": CLIENT_PORT}] + ports
        ready = f"{RAYLET_HEALTH} && {GCS_HEALTH}"
        readiness = _probe(ready, initialDelaySeconds=10, periodSeconds=5, timeoutSeconds=5, failureThreshold=10)
        liveness = _probe(ready, initialDelaySeconds=30, periodSeconds=5, timeoutSeconds=5, failureThreshold=120)
        startup = None
    else:
        # The pod joins the Serve service once the application can run a completion (the startup probe: /health,
        # 503 while the model replicas load), and stays in it while its raylet and its Serve proxy answer. /health
        # is not part of readiness: under overload Serve sheds it with a 503 like any request, which would take every
        # pod out of the service at once.
        startup = _probe(f"{RAYLET_HEALTH} && {APP_READY}", initialDelaySeconds=10, periodSeconds=5,
                         timeoutSeconds=5, failureThreshold=APP_START_PROBES)
        readiness = _probe(f"{RAYLET_HEALTH} && {SERVE_PROXY_HEALTH}", periodSeconds=5, timeoutSeconds=5,
                           failureThreshold=1)
        liveness = _probe(RAYLET_HEALTH, periodSeconds=5, timeoutSeconds=5, failureThreshold=120)
    return {
        "name": "ray-head" if group == "head" else "ray-worker",
        "image": ov.image, "imagePullPolicy": ov.image_pull_policy,
        "ports": ports, "env": env, "volumeMounts": mounts,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        **({"startupProbe": startup} if startup else {}),
        "readinessProbe": readiness, "livenessProbe": liveness,
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def _pod_template(ov: Overlay, cfg: SpecServeConfig, group: str) -> dict:
    pod = ov.pod(group)
    volumes = [{"name": "cache", "emptyDir": {}}]
    if ov.models:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": ov.models.pvc, "readOnly": True}})
    spec = {"containers": [_container(ov, cfg, group)], "volumes": volumes,
            "terminationGracePeriodSeconds": 60}
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [dict(t) for t in pod.tolerations]
    labels = {"app.kubernetes.io/name": ov.name, "app.kubernetes.io/component": group}
    return {"metadata": {"labels": labels, "annotations": {MODEL_PAIR_ANNOTATION: model_pair_hash(cfg)}},
            "spec": spec}


def _start_params(ov: Overlay, cfg: SpecServeConfig, group: str) -> dict[str, str]:
    pod = ov.pod(group)
    params = {"num-cpus": "0" if group == "head" else str(pod.cpu),  # no Serve replica ever on the head
              "num-gpus": "0" if group == "head" else str(pod_gpus(cfg, group)),
              "object-store-memory": str(quantity_bytes(pod.object_store)),
              "metrics-export-port": str(METRICS_PORT), "dashboard-agent-listen-port": str(AGENT_PORT)}
    if group == "head":
        params["dashboard-host"] = "0.0.0.0"
    else:
        custom = pod_custom_resources(cfg, group)
        if custom:  # KubeRay's quoting: the JSON inside escaped double quotes
            params["resources"] = '"' + json.dumps(custom).replace('"', '\\"') + '"'
    return params


def build_rayservice(ov: Overlay, serve_doc: dict, cfg: SpecServeConfig) -> dict:
    workers = []
    for group in GROUPS:
        if group == "draft" and not cfg.draft_source().remote:
            continue
        s = section(cfg, group)
        workers.append({
            "groupName": group,
            "replicas": s.min_replicas, "minReplicas": s.min_replicas, "maxReplicas": s.max_replicas,
            "rayStartParams": _start_params(ov, cfg, group),
            "template": _pod_template(ov, cfg, group),
        })
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": ov.name, "namespace": ov.namespace, "labels": {"app.kubernetes.io/name": ov.name}},
        "spec": {
            "upgradeStrategy": {"type": "NewCluster"},
            "rayClusterDeletionDelaySeconds": ov.upgrade.cluster_deletion_delay_s,
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": yaml.safe_dump(serve_doc, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": ov.ray_version,
                # Ray's own token auth (Ray >= 2.52, KubeRay >= 1.5.1): the operator makes the token Secret and
                # hands it to every Ray container; health checks, metrics and the Serve port stay open
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": ov.autoscaler.upscaling_mode, "idleTimeoutSeconds": ov.autoscaler.idle_timeout_s,
                    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                                  "limits": {"cpu": "500m", "memory": "512Mi"}},
                },
                "headGroupSpec": {"rayStartParams": _start_params(ov, cfg, "head"),
                                  "template": _pod_template(ov, cfg, "head")},
                "workerGroupSpecs": workers,
            },
        },
    }


def serve_service_name(ov: Overlay) -> str:
    return f"{ov.name}-serve-svc"  # made by the KubeRay operator for a RayService


def build_ingress(ov: Overlay, cfg: SpecServeConfig) -> dict:
    ing = ov.ingress
    timeout = str(ing.read_timeout_s)
    annotations = {  # server-sent events: pass every chunk through at once and keep long streams open
        "nginx.ingress.kubernetes.io/proxy-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-request-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-read-timeout": timeout,
        "nginx.ingress.kubernetes.io/proxy-send-timeout": timeout,
        "nginx.ingress.kubernetes.io/proxy-http-version": "1.1",
        "nginx.ingress.kubernetes.io/proxy-body-size": f"{math.ceil(cfg.limits.max_body_bytes / 1024)}k",
    }
    spec = {
        "ingressClassName": ing.class_name,
        "rules": [{"host": ing.host, "http": {"paths": [{
            "path": "/", "pathType": "Prefix",
            "backend": {"service": {"name": serve_service_name(ov), "port": {"number": SERVE_PORT}}}}]}}],
    }
    if ing.tls_secret:
        spec["tls"] = [{"hosts": [ing.host], "secretName": ing.tls_secret}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"name": ov.name, "namespace": ov.namespace, "annotations": annotations,
                         "labels": {"app.kubernetes.io/name": ov.name}},
            "spec": spec}


def build_podmonitor(ov: Overlay) -> dict:
    """Every Ray pod's metrics port (Ray system, Serve and specserve metrics), labelled as Ray's dashboards expect."""
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": ov.name, "namespace": ov.namespace,
                     "labels": {"app.kubernetes.io/name": ov.name, **ov.monitoring.labels}},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": ov.name}},
            "namespaceSelector": {"matchNames": [ov.namespace]},
            "podMetricsEndpoints": [{
                "port": "metrics", "path": "/metrics", "interval": ov.monitoring.interval,
                "relabelings": [{"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                                 "targetLabel": "ray_io_cluster"}],
            }],
        },
    }


def build_pvc(ov: Overlay) -> dict:
    m = ov.models
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": m.storage}}}
    if m.storage_class:
        spec["storageClassName"] = m.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": m.pvc, "namespace": ov.namespace, "labels": {"app.kubernetes.io/name": ov.name}},
            "spec": spec}


def build_dashboard_configmap(ov: Overlay) -> dict:
    """Grafana's sidecar loads ConfigMaps labelled grafana_dashboard=1."""
    dashboard = build_dashboard()
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{ov.name}-grafana-dashboard", "namespace": ov.namespace,
                         "labels": {"grafana_dashboard": "1", "app.kubernetes.io/name": ov.name}},
            "data": {f"{dashboard.get('uid', ov.name)}.json": json.dumps(dashboard, indent=2, sort_keys=True) + "\n"}}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


GENERATOR = "python -m k8s.manifests"


def dump(obj: dict, source: str) -> str:
    header = f"# Generated by `{GENERATOR}` from serve_config.yaml and {source}. Do not edit.\n"
    return header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def render(overlay_path: Path, root: Path) -> dict[Path, str]:
    """Every file one overlay produces, path (relative to the repository root `root`) -> text."""
    root = Path(root).resolve()
    ov = load_overlay(overlay_path)
    serve_doc, cfg = app_config(ov, root / SERVE_CONFIG)
    source = str(Path(overlay_path).resolve().relative_to(root))
    out_dir = Path(ov.output_dir)
    files = {out_dir / "rayservice.yaml": dump(build_rayservice(ov, serve_doc, cfg), source)}
    if ov.ingress:
        files[out_dir / "ingress.yaml"] = dump(build_ingress(ov, cfg), source)
    if ov.monitoring:
        files[out_dir / "podmonitor.yaml"] = dump(build_podmonitor(ov), source)
        files[out_dir / "grafana-dashboard.configmap.yaml"] = dump(build_dashboard_configmap(ov),
                                                                   "deployments/dashboard.py")
    if ov.models:
        files[out_dir / "models-pvc.yaml"] = dump(build_pvc(ov), source)
    if ov.serve_config_out:
        text = yaml.safe_dump(serve_doc, sort_keys=False)
        files[Path(ov.serve_config_out)] = (f"# Generated by `{GENERATOR}` from serve_config.yaml "
                                            f"and {source}: `serve deploy` on a `ray up` cluster. Do not edit.\n{text}")
    return files


def render_all(root: Path) -> dict[Path, str]:
    """Every file every overlay of the repository at `root` produces."""
    files: dict[Path, str] = {}
    for path in overlays(root):
        files.update(render(path, root))
    return files


def stale(files: dict[Path, str], root: Path) -> list[str]:
    """Files under `root` whose text differs from the generated one (missing ones included), with a short diff."""
    problems = []
    for rel, text in files.items():
        path = Path(root) / rel
        current = path.read_text() if path.is_file() else ""
        if current != text:
            diff = "".join(list(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                     str(rel), f"{rel} (generated)"))[:40])
            problems.append(f"{rel} is stale:\n{diff}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed manifest differs")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: here)")
    args = parser.parse_args(argv)
    if not (args.root / SERVE_CONFIG).is_file() or not overlays(args.root):
        parser.error(f"{args.root} has no {SERVE_CONFIG} or no {OVERLAYS_DIR}/*.yaml: run from the repository "
                     "root or pass --root")
    files = render_all(args.root)
    if args.check:
        problems = stale(files, args.root)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(files) - len(problems)} of {len(files)} manifests up to date")
        return 1 if problems else 0
    for rel, text in files.items():
        (args.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (args.root / rel).write_text(text)
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
