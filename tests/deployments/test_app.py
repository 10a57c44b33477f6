"""deployments/app.py: the one builder of Serve options, checked against Ray's own deployment config (no cluster)."""

from ray import serve

from deployments.app import deployment_options
from deployments.config import SpecServeConfig
from deployments.router import RETRY_AFTER_S


class _Stand:
    pass


def test_every_deployment_sheds_with_503_and_retry_after_and_ray_accepts_the_options():
    cfg = SpecServeConfig.model_validate({"router": {"max_queued_requests": 3}})
    options = deployment_options(cfg)
    assert set(options) == {"Router", "Draft", "Target"}
    for name, opts in options.items():
        deployment = serve.deployment(_Stand, name=name).options(**opts)
        config = deployment._deployment_config
        assert config.backpressure_config.status_code == 503
        assert config.backpressure_config.retry_after_s == RETRY_AFTER_S
    router = serve.deployment(_Stand, name="Router").options(**options["Router"])._deployment_config
    assert router.max_queued_requests == 3 and router.max_ongoing_requests == cfg.router.max_ongoing_requests


def test_model_workers_spin_briefly_unless_the_operator_says_otherwise(monkeypatch):
    from deployments import model_deployments

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    options = model_deployments._actor_options({"num_cpus": 1, "num_gpus": 0, "resources": {}}, 1, "w")
    assert options["runtime_env"]["env_vars"]["GOMP_SPINCOUNT"] == model_deployments.DEFAULT_GOMP_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert model_deployments.worker_env()["GOMP_SPINCOUNT"] == "300000"
