"""deployments/app.py: the one builder of Serve options, checked against Ray's own deployment config (no cluster)."""

from ray import serve

from deployments.app import CONSTRUCTOR_RETRIES, deployment_options
from deployments.config import SpecServeConfig
from deployments.router.router import RETRY_AFTER_S


class _Stand:
    pass


def test_every_deployment_sheds_with_503_and_retry_after_and_ray_accepts_the_options():
    cfg = SpecServeConfig.model_validate({"model": {"draft": "smollm2"}, "router": {"max_queued_requests": 3}})
    options = deployment_options(cfg)
    assert set(options) == {"Router", "Draft", "Target"}
    for name, opts in options.items():
        deployment = serve.deployment(_Stand, name=name).options(**opts)
        config = deployment._deployment_config
        assert config.backpressure_config.status_code == 503
        assert config.backpressure_config.retry_after_s == RETRY_AFTER_S
        # a replica that cannot start is not restarted for minutes: the application fails with its error
        assert config.max_constructor_retry_count == CONSTRUCTOR_RETRIES <= 3
    router = serve.deployment(_Stand, name="Router").options(**options["Router"])._deployment_config
    assert router.max_queued_requests == 3 and router.max_ongoing_requests == cfg.router.max_ongoing_requests


def test_model_workers_spin_briefly_unless_the_operator_says_otherwise(monkeypatch):
    from deployments.workers import replicas

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    options = replicas._actor_options({"num_cpus": 1, "num_gpus": 0, "resources": {}}, 1, "w")
    assert options["runtime_env"]["env_vars"]["GOMP_SPINCOUNT"] == replicas.DEFAULT_GOMP_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert replicas.worker_env()["GOMP_SPINCOUNT"] == "300000"


def test_autoscaling_windows_must_outlast_the_load_reports():
    import pytest
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    from deployments.config import RAY_METRICS_INTERVAL_S

    assert AutoscalingConfig().metrics_interval_s == RAY_METRICS_INTERVAL_S  # the default the check assumes is Ray's
    # Ray reports load every 10 s unless told otherwise: a shorter window sometimes holds no report (read as idle)
    with pytest.raises(ValidationError, match="must exceed the autoscaling metrics interval"):
        SpecServeConfig.model_validate({"target": {"look_back_period_s": 5}})
    with pytest.raises(ValidationError, match="must exceed"):
        SpecServeConfig.model_validate({"target": {"look_back_period_s": 1, "metrics_interval_s": 1}})
    cfg = SpecServeConfig.model_validate({"target": {"look_back_period_s": 1, "metrics_interval_s": 0.25}})
    autoscaling = deployment_options(cfg)["Target"]["autoscaling_config"]
    assert autoscaling["metrics_interval_s"] == 0.25
    assert AutoscalingConfig(**autoscaling).metrics_interval_s == 0.25  # Ray takes it
    assert "metrics_interval_s" not in deployment_options(SpecServeConfig())["Target"]["autoscaling_config"]


def test_model_workers_run_at_niceness_0_unless_the_config_sets_one_and_it_is_bounded():
    import pydantic
    import pytest

    from deployments.app import worker_spec
    from deployments.config import SpecServeConfig

    cfg = SpecServeConfig.model_validate({"model": {"draft": "smollm2"}, "draft": {"niceness": 5}})
    assert worker_spec(cfg, "target")["niceness"] == 0 and worker_spec(cfg, "draft")["niceness"] == 5
    assert worker_spec(SpecServeConfig.model_validate({"target": {"niceness": None}}), "target")["niceness"] is None
    with pytest.raises(pydantic.ValidationError, match="niceness"):
        SpecServeConfig.model_validate({"target": {"niceness": 20}})


def test_a_thread_s_niceness_is_its_own_and_a_refusal_is_a_warning(monkeypatch, caplog):
    import os
    import threading

    from deployments.workers import base

    def in_thread(fn, *args):
        out = []
        thread = threading.Thread(target=lambda: out.append(fn(*args)))
        thread.start()
        thread.join()
        return out[0]

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    higher = min(mine + 1, 19)  # raising it needs no privilege
    assert in_thread(base.set_thread_niceness, higher) == higher
    assert in_thread(base.set_thread_niceness, None) == mine  # a new thread inherits this one's; None keeps it
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the calling thread's alone

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(base.os, "setpriority", refuse)
    assert in_thread(base.set_thread_niceness, -5) == mine
    assert "cannot set niceness -5" in caplog.text and "CAP_SYS_NICE" in caplog.text


def test_prefix_caching_takes_yaml_on_and_off_and_reaches_the_engine_config():
    import pydantic
    import pytest
    import yaml

    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto")):
        runner = yaml.safe_load(f"prefix_caching: {text}")  # PyYAML reads bare on/off as booleans
        cfg = SpecServeConfig.model_validate({"runner": runner})
        assert cfg.runner.prefix_caching == want and cfg.engine_config().prefix_caching == want
    with pytest.raises(pydantic.ValidationError, match="prefix_caching"):
        SpecServeConfig.model_validate({"runner": {"prefix_caching": "sometimes"}})


def test_runner_compile_is_auto_on_or_off_reads_yaml_booleans_and_tp_is_refused_only_for_cpu_inductor():
    import pydantic
    import pytest
    import yaml

    assert SpecServeConfig().runner.compile == "auto" == SpecServeConfig().engine_config().compile
    for text, want in (("on", "on"), ("off", "off"), ("true", "on"), ("false", "off"), ("auto", "auto")):
        runner = yaml.safe_load(f"compile: {text}")
        cfg = SpecServeConfig.model_validate({"runner": runner})
        assert cfg.runner.compile == want and cfg.engine_config().compile == want
    with pytest.raises(pydantic.ValidationError, match="compile"):
        SpecServeConfig.model_validate({"runner": {"compile": "graphs"}})
    for device in ("cpu", "cuda"):  # CUDA graphs (auto) serve tensor-parallel targets
        SpecServeConfig.model_validate({"tp_size": 2, "model": {"device": device}, "runner": {"compile": "auto"}})
    SpecServeConfig.model_validate({"tp_size": 2, "model": {"device": "cuda"}, "runner": {"compile": "on"}})
    with pytest.raises(pydantic.ValidationError, match="tp_size 2 on CPU"):
        SpecServeConfig.model_validate({"tp_size": 2, "runner": {"compile": "on"}})
