"""cluster/aws.yaml (`ray up`): valid for the Ray installed here, and the production app fits its node types.
Offline: no cloud call, only Ray's schema and its own default-filling (`prepare_config`)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.app import deployment_options
from k8s.overlay import app_config, load_overlay
from tests import REPO
from tests.k8s.fit import Node

LAUNCHER = REPO / "cluster" / "aws.yaml"
PROD = REPO / "k8s" / "overlays" / "prod.yaml"


def _config() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def _schema_problems(config: dict) -> list[str]:
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(config)]


def test_launcher_config_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _config()
    assert _schema_problems(config) == []
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` does before it launches anything


@pytest.mark.parametrize("edit", [
    lambda c: c["available_node_types"]["draft_gpu"].update(min_worker=1),
    lambda c: c["available_node_types"]["target_gpu"]["resources"].update(GPU=2.5),
    lambda c: c.update(head_node_typ="head"),
    lambda c: c["provider"].pop("type"),
])
def test_broken_launcher_configs_are_rejected(edit):
    config = _config()
    edit(config)
    assert _schema_problems(config)


def _nodes(config: dict) -> dict[str, dict[str, float]]:
    return {name: {k: float(v) for k, v in t["resources"].items()} for name, t in config["available_node_types"].items()}


def test_prod_app_fits_the_node_types_meant_for_it():
    config = _config()
    overlay = load_overlay(PROD)
    _, cfg = app_config(overlay, REPO / "serve_config.yaml")
    options = deployment_options(cfg)
    types = _nodes(config)
    assert types["head"].get("CPU", 0) == 0 and types["head"].get("GPU", 0) == 0
    for deployment, home in (("Target", "target_gpu"), ("Draft", "draft_gpu")):
        bundles = options[deployment]["placement_group_bundles"]
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
        for name, res in types.items():  # all of a replica's bundles fit one node of its type, and no other type
            assert Node(name, 0, dict(res)).fits(total) == (name == home), (deployment, name, total)
            assert Node(name, 0, dict(res)).fits(bundles[1]) == (name == home), (deployment, name, bundles[1])
        per_node = min(math.floor(types[home].get(k, 0) / v + 1e-9) for k, v in total.items() if v > 0)
        max_nodes = config["available_node_types"][home]["max_workers"]
        scaling = options[deployment]["autoscaling_config"]
        assert per_node * max_nodes >= scaling["max_replicas"], (deployment, per_node, max_nodes)
        assert config["available_node_types"][home]["min_workers"] * per_node >= scaling["min_replicas"]
    assert config["max_workers"] >= sum(t.get("max_workers", 0) for t in config["available_node_types"].values())


def test_launcher_runs_the_image_and_volume_layout_of_the_prod_overlay():
    config = _config()
    overlay = load_overlay(PROD)
    _, cfg = app_config(overlay, REPO / "serve_config.yaml")
    assert config["docker"]["image"] == overlay.image
    run = " ".join(config["docker"]["run_options"])
    assert f":{overlay.models.mount_path}:ro" in run and f"HF_HOME={overlay.models.hf_home}" in run
    # the key reaches the container as the app's variable from a file each VM fetches, never written here
    assert "--env-file /etc/specserve/env" in run
    assert any(f"'s/^/{cfg.api_key_env}=/'" in c and "/etc/specserve/env" in c for c in config["initialization_commands"])
    assert "--metrics-export-port=8080" in " ".join(config["head_start_ray_commands"])
