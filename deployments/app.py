"""The application builder: one validated config in, three bound deployments out.

`serve run serve_config.yaml` calls `build_app(args)`; every `serve.deployment` option (placement-group bundles
from `tp_size`, autoscaling, queue limits, resources) is computed here and nowhere else. The args are validated by
`config.config_from_args`, which `specserve-check-config` (deployments/check_config.py) also runs: Serve retries a
builder that raises without end, so a config is best checked before it reaches Serve.
"""

from __future__ import annotations

from ray import serve

from deployments.autoscaling import POLICY
from deployments.config import ScalingSection, SpecServeConfig, config_from_args
from deployments.router.router import RETRY_AFTER_S, build_router_server
from deployments.workers.replicas import DraftServer, TargetServer

REPLICA_CPUS = 0.05  # the replica actor itself only relays; the model work runs in its worker actors
# Replica constructors Serve retries before the deployment is DEPLOY_FAILED (its default is 20, capped at 3 per
# target replica). A replica that cannot start for its configuration (a StartupError: deployments/errors.py) fails
# every try the same way, and each try loads the models again; the failure then shows in `serve status` and in the
# router's /health (deployments/api/readiness.py) instead of a restart loop. A transient failure gets this many tries.
CONSTRUCTOR_RETRIES = 3


def _worker_bundle(s: ScalingSection) -> dict[str, float]:
    bundle = {"CPU": s.num_cpus, **s.resources}
    if s.num_gpus:
        bundle["GPU"] = s.num_gpus
    return bundle


def _autoscaling(s: ScalingSection) -> dict:
    return {
        "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
        "initial_replicas": s.initial_replicas if s.initial_replicas is not None else max(1, s.min_replicas),
        "target_ongoing_requests": s.target_ongoing_requests,
        "upscale_delay_s": s.upscale_delay_s, "downscale_delay_s": s.downscale_delay_s,
        "look_back_period_s": s.look_back_period_s,
        **({"metrics_interval_s": s.metrics_interval_s} if s.metrics_interval_s is not None else {}),
    }


def _model_autoscaling(s: ScalingSection) -> dict:
    """Draft and Target replicas scale by their live sequences, not by Serve's count of open calls
    (deployments/autoscaling.py says why)."""
    return {**_autoscaling(s), "policy": {"policy_function": POLICY}}


def worker_spec(cfg: SpecServeConfig, role: str) -> dict:
    """What a Draft or Target replica needs to start its worker actors."""
    s = cfg.draft if role == "draft" else cfg.target
    spec = cfg.speculation
    # with overlap the draft computes while the target's ranks do; without, they take turns
    concurrent = cfg.tp_size if role == "target" else 1
    if spec.overlap and cfg.draft_source().remote:
        concurrent += 1 if role == "target" else cfg.tp_size
    return {"num_cpus": s.num_cpus, "num_gpus": s.num_gpus, "resources": dict(s.resources),
            "torch_threads": s.torch_threads, "concurrent_workers": concurrent, "niceness": s.niceness,
            "calibrate": spec.adaptive and spec.calibration is None}


def deployment_options(cfg: SpecServeConfig) -> dict[str, dict]:
    """Serve options per deployment name."""
    common = lambda s: {"autoscaling_config": _autoscaling(s), "max_ongoing_requests": s.max_ongoing_requests,
                        "max_queued_requests": s.max_queued_requests,
                        # a request Serve sheds at its queue limit is refused by the proxy itself, with Retry-After
                        "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S},
                        "health_check_period_s": 5,
                        "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": 20,
                        "max_constructor_retry_count": CONSTRUCTOR_RETRIES}
    options = {
        "Router": {**common(cfg.router), "ray_actor_options": {"num_cpus": cfg.router.num_cpus}},
        "Target": {
            **common(cfg.target), "autoscaling_config": _model_autoscaling(cfg.target),
            "ray_actor_options": {"num_cpus": REPLICA_CPUS},
            "placement_group_bundles": [{"CPU": REPLICA_CPUS}] + [_worker_bundle(cfg.target)] * cfg.tp_size,
            "placement_group_strategy": "STRICT_PACK",
        },
    }
    if cfg.draft_source().remote:
        options["Draft"] = {
            **common(cfg.draft), "autoscaling_config": _model_autoscaling(cfg.draft),
            "ray_actor_options": {"num_cpus": REPLICA_CPUS},
            "placement_group_bundles": [{"CPU": REPLICA_CPUS}, _worker_bundle(cfg.draft)],
            "placement_group_strategy": "PACK",
        }
    return options


def build_app(args: dict | None = None):
    cfg = config_from_args(args)  # the same validation `specserve-check-config` runs, without Ray
    options = deployment_options(cfg)
    engine_config = cfg.engine_config()
    target = serve.deployment(TargetServer, name="Target").options(**options["Target"]).bind(
        engine_config, worker_spec(cfg, "target"), cfg.tp_size)
    draft = None
    if "Draft" in options:
        draft = serve.deployment(DraftServer, name="Draft").options(**options["Draft"]).bind(
            engine_config, worker_spec(cfg, "draft"))
    router = serve.deployment(build_router_server(), name="Router").options(**options["Router"])
    return router.bind(cfg.model_dump(), draft, target)
