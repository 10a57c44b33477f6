"""Offline checks of generated Kubernetes manifests, shared by the tests (and usable from a REPL).

Each check returns a list of problems (empty = fine), so a test can assert on the problems of a deliberately
broken manifest with the very same function that passes the committed one.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from tests import REPO

SCHEMAS = REPO / "k8s" / "schemas" / "kuberay-v1.7.0"
K8S_VERSION = "1.31"  # core kinds are validated against this Kubernetes version's schemas


# ---- KubeRay CRDs ------------------------------------------------------------------------------------------------
def _close(node, path: str = "") -> None:
    """OpenAPI v3 (structural, as the API server reads it) -> JSON Schema: objects without
    x-kubernetes-preserve-unknown-fields are closed, `nullable` admits null."""
    if isinstance(node, list):
        for item in node:
            _close(item, path)
        return
    if not isinstance(node, dict):
        return
    if node.get("nullable") and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        node.setdefault("additionalProperties", False)
    for key, value in node.items():
        if key == "properties":
            for name, sub in value.items():
                _close(sub, f"{path}.{name}")
        elif isinstance(value, (dict, list)) and key not in ("enum", "default", "required", "x-kubernetes-validations"):
            _close(value, path)


@functools.cache
def crd_schema(kind: str) -> dict:
    """spec.versions[v1].schema.openAPIV3Schema of KubeRay's CRD for `kind`, closed. The top-level `metadata`
    (an ObjectMeta the API server checks itself) is validated separately with Kubernetes' own schema."""
    crd = yaml.safe_load((SCHEMAS / f"ray.io_{kind.lower()}s.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    schema = copy.deepcopy(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
    schema["properties"].pop("metadata")
    _close(schema)
    schema["properties"]["metadata"] = {"type": "object"}  # checked by object_meta_problems
    return schema


def _path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(root)"


def object_meta_problems(metadata: dict) -> list[str]:
    """The top-level metadata against Kubernetes' ObjectMeta (strict), by wrapping it in a ConfigMap."""
    return core_problems({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata})


def crd_problems(obj: dict) -> list[str]:
    import jsonschema

    if obj.get("apiVersion") != "ray.io/v1" or obj.get("kind") not in ("RayService", "RayCluster"):
        return [f"not a ray.io/v1 RayService/RayCluster: {obj.get('apiVersion')} {obj.get('kind')}"]
    validator = jsonschema.Draft202012Validator(crd_schema(obj["kind"]))
    problems = [f"{obj['kind']} {_path(e)}: {e.message}" for e in validator.iter_errors(obj)]
    return problems + object_meta_problems(obj.get("metadata", {}))


def raycluster_from(rayservice: dict) -> dict:
    """The RayService's rayClusterConfig as the RayCluster KubeRay makes of it (checked against that CRD too)."""
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": rayservice["metadata"]["name"]},
            "spec": copy.deepcopy(rayservice["spec"]["rayClusterConfig"])}


# ---- core kinds and the PodMonitor --------------------------------------------------------------------------------
def core_problems(obj: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{obj.get('kind')} {_path(e)}: {e.message}"]
    return []


def _dropped(given, kept, path: str = "") -> list[str]:
    """Keys present in `given` but missing from `kept` (a model that ignores unknown fields dropped them)."""
    if isinstance(given, dict) and isinstance(kept, dict):
        out = []
        for key, value in given.items():
            if key not in kept:
                out.append(f"{path}.{key}".lstrip("."))
            else:
                out += _dropped(value, kept[key], f"{path}.{key}")
        return out
    if isinstance(given, list) and isinstance(kept, list):
        return [p for i, (g, k) in enumerate(zip(given, kept)) for p in _dropped(g, k, f"{path}[{i}]")]
    return []


def podmonitor_problems(obj: dict) -> list[str]:
    """Against the prometheus-operator models (cloudcoil-models-prometheus-operator, generated from its CRDs);
    those models ignore unknown fields, so a round trip finds the ones they dropped."""
    import pydantic
    from cloudcoil.models.prometheus_operator import v1

    try:
        model = v1.PodMonitor.model_validate(obj)
    except pydantic.ValidationError as e:
        return [f"PodMonitor {err['loc']}: {err['msg']}" for err in e.errors()]
    kept = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return [f"PodMonitor unknown field {p}" for p in _dropped(obj, kept)]


# ---- serveConfigV2 -------------------------------------------------------------------------------------------------
def serve_config_problems(text: str) -> list[str]:
    """Ray's own Serve schema (unknown keys included: Ray silently ignores them) and the app args with
    SpecServeConfig."""
    import pydantic
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import SpecServeConfig

    doc = yaml.safe_load(text)
    try:
        schema = ServeDeploySchema.model_validate(doc)
    except pydantic.ValidationError as e:
        return [f"serveConfigV2 {err['loc']}: {err['msg']}" for err in e.errors()]
    kept = schema.model_dump(mode="json", exclude_unset=True)
    problems = [f"serveConfigV2 unknown field {p}" for p in _dropped(doc, kept)]
    for app in schema.applications:
        if app.import_path != "deployments.app:build_app":
            problems.append(f"serveConfigV2 application {app.name}: import_path {app.import_path}")
        try:
            SpecServeConfig.model_validate(app.args or {})
        except pydantic.ValidationError as e:
            problems += [f"serveConfigV2 args {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return problems


def app_config_of(rayservice: dict):
    from deployments.config import SpecServeConfig

    doc = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return doc, SpecServeConfig.model_validate(doc["applications"][0]["args"])


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
