"""An overlay (k8s/overlays/*.yaml): the application args it merges over serve_config.yaml's, and the cluster layout
around them (image, pod sizes, volumes, ingress), validated with the application's own strict config base model.
Paths are relative to the repository root."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml
from pydantic import Field, field_validator

from deployments.config import SpecServeConfig, StrictModel

OVERLAYS_DIR = Path("k8s/overlays")
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity_bytes(q: str | int) -> int:
    """A Kubernetes memory quantity ('64Gi', '512M', 1000) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(q))
    if not match:
        raise ValueError(f"not a memory quantity: {q!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class PodSize(StrictModel):
    cpu: int = Field(ge=1, description="whole CPUs: k8s requests = limits; Ray's num-cpus (0 on the head)")
    memory: str = Field(description="k8s memory quantity, requests = limits (Ray's `memory` follows the limit)")
    object_store: str = Field(description="Ray object store (/dev/shm), part of `memory`")
    host_memory_per_worker: str | None = Field(None, description="host RAM one model worker needs (fit check)")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, str]] = Field(default_factory=list)

    @field_validator("memory", "object_store", "host_memory_per_worker")
    @classmethod
    def _quantity(cls, v):
        if v is not None:
            quantity_bytes(v)
        return v


class ModelsVolume(StrictModel):
    pvc: str
    storage: str = "100Gi"
    storage_class: str = Field("", description="'' = the cluster's default class")
    mount_path: str = "/models"
    hf_home: str | None = Field(None, description="HF_HOME on the volume: cached HF ids resolve offline")


class SecretRef(StrictModel):
    name: str
    key: str


class IngressSpec(StrictModel):
    host: str
    class_name: str = "nginx"
    tls_secret: str | None = None
    read_timeout_s: int = Field(3600, ge=60, description="longest a stream may stay open")


class Monitoring(StrictModel):
    labels: dict[str, str] = Field(default_factory=dict, description="labels Prometheus' selectors match")
    interval: str = "15s"


class Upgrade(StrictModel):
    cluster_deletion_delay_s: int = Field(900, ge=0, description="old cluster's life after traffic switched")


class Autoscaler(StrictModel):
    idle_timeout_s: int = Field(120, ge=0)
    upscaling_mode: str = Field("Default", pattern="^(Default|Aggressive|Conservative)$")


class Overlay(StrictModel):
    output_dir: str
    serve_config_out: str | None = Field(None, description="also write the serve config for a `ray up` cluster")
    name: str
    namespace: str
    image: str
    image_pull_policy: str = "IfNotPresent"
    ray_version: str
    args: dict = Field(default_factory=dict, description="merged over serve_config.yaml's application args")
    head: PodSize
    draft_group: PodSize
    target_group: PodSize
    router_host_memory: str = "2Gi"
    node_overhead: str = Field("1Gi", description="raylet, agents and replica actors of a pod (fit check)")
    models: ModelsVolume | None = None
    api_key_secret: SecretRef
    ingress: IngressSpec | None = None
    monitoring: Monitoring | None = None
    upgrade: Upgrade = Field(default_factory=Upgrade)
    autoscaler: Autoscaler = Field(default_factory=Autoscaler)

    def pod(self, group: str) -> PodSize:
        return {"head": self.head, "draft": self.draft_group, "target": self.target_group}[group]


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_overlay(path: Path) -> Overlay:
    return Overlay.model_validate(yaml.safe_load(Path(path).read_text()))


def app_config(overlay: Overlay, serve_config: Path) -> tuple[dict, SpecServeConfig]:
    """The Serve config document (serveConfigV2) from the file `serve_config` with the overlay's args merged in, and
    the validated application config it carries."""
    doc = yaml.safe_load(Path(serve_config).read_text())
    if len(doc["applications"]) != 1:
        raise ValueError("serve_config.yaml must hold exactly one application")
    app = doc["applications"][0]
    cfg = SpecServeConfig.model_validate(deep_merge(app.get("args") or {}, overlay.args))
    args = cfg.model_dump(mode="json", exclude_unset=True)
    return {**doc, "applications": [{**app, "args": args}]}, cfg


def overlays(root: Path) -> list[Path]:
    """Every overlay of the repository at `root`."""
    return sorted((Path(root) / OVERLAYS_DIR).glob("*.yaml"))
