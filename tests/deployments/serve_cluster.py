"""Start the application the way the README does: a local Ray head, then `serve run serve_config.yaml`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deployments.ray_env import SERVE_ENV, reap_orphaned_haproxy

# With HAProxy, a router replica that stops stays open RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (Ray's
# default 30 s) so load balancers can take it out first; these clusters have none but Serve's own HAProxy, which
# retries refused connections, and their tests delete applications and scale replicas down many times.
TEST_SERVE_ENV = {**SERVE_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
BASE = "http://127.0.0.1:8000"


def wait_until(predicate, timeout, what, interval=1.0):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last!r})")


def config_variant(base: Path, overrides: dict, out: Path) -> Path:
    """`base` (a serve config file) with `overrides` deep-merged into its application's args, written to `out`."""
    import yaml

    from k8s.overlay import deep_merge

    doc = yaml.safe_load(Path(base).read_text())
    app = doc["applications"][0]
    app["args"] = deep_merge(app.get("args") or {}, overrides)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


# serve_config.yaml drafts by n-gram lookup (the faster default on this CPU); the tests that exercise Draft replicas
# start it with the embedded model's int8 copy as the draft, every other setting as the README's but two: the dev
# routes (test_serve_e2e pauses the router to kill a worker between two rounds of a request) and one Router replica,
# so that a /pause reaches the replica holding the request
DRAFT_MODEL_PAIR = {"model": {"draft": "smollm2", "draft_dtype": "int8"}, "dev_endpoints": True,
                    "router": {"max_replicas": 1}}


def readme_config_with_draft_model(out_dir: Path) -> str:
    """serve_config.yaml with DRAFT_MODEL_PAIR merged in, written under `out_dir`; its path."""
    return str(config_variant(ROOT / "serve_config.yaml", DRAFT_MODEL_PAIR, Path(out_dir) / "serve_config.yaml"))


def served_target(config: Path = ROOT / "serve_config.yaml"):
    """(runner, tokenizer) of the target exactly as a serve config builds it (its dtype: `auto` is bf16 on CPUs that
    compute bf16), in this process: the reference that served greedy texts must equal."""
    import yaml

    from deployments.config import SpecServeConfig
    from engine.factory import build_target

    args = yaml.safe_load(Path(config).read_text())["applications"][0]["args"]
    return build_target(SpecServeConfig.model_validate(args).engine_config())


@contextlib.contextmanager
def serve_env():
    """This process's environment with the Ray Serve settings specserve ships (deployments/ray_env.py, with a short
    drain: TEST_SERVE_ENV), for a `ray.init` that starts a cluster: Ray's processes read them when they start.
    Restored on exit (after the cluster's shutdown), and any HAProxy the shutdown left holding its port is killed."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        for key, value in TEST_SERVE_ENV.items():
            patch.setenv(key, value)
        try:
            yield
        finally:
            reap_orphaned_haproxy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(log_dir: Path, metrics_port: int | None = None, config: str = "serve_config.yaml"):
    """A local Ray head (8 logical CPUs on this 2-core machine) in the Serve mode `make run` uses (HAProxy, direct
    ingress: deployments/ray_env.py), then `serve run <config>` against it.

    With `metrics_port`, Ray's Prometheus endpoint listens there and application metrics are reported every second.
    """
    env = {**os.environ, **TEST_SERVE_ENV, "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}  # as `make run` starts it
    start = [BIN / "ray", "start", "--head", "--num-cpus", "8", "--disable-usage-stats", "--include-dashboard",
             "false"]
    if metrics_port is not None:
        start += ["--metrics-export-port", str(metrics_port)]
        env["RAY_metrics_report_interval_ms"] = "1000"
    subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
    subprocess.run(start, check=True, capture_output=True, env=env)
    env["RAY_ADDRESS"] = "auto"
    log = open(log_dir / "serve.log", "w")
    proc = subprocess.Popen([BIN / "serve", "run", config], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: httpx.get(f"{BASE}/v1/models", timeout=2).status_code == 200, 300,
                   "serve run to come up")
        yield proc
    finally:
        # the cluster is thrown away: Serve's graceful stop (SIGINT: replicas drain, ~13 s a module) tests nothing
        # here, so `serve run` is killed and `ray stop --force` ends the head's processes
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
        reap_orphaned_haproxy()
        log.close()
