"""A multi-node Ray cluster on one machine, laid out like the production one.

    python cluster/local_cluster.py up   --dir /tmp/specserve-mn   # prints JSON: GCS address, dashboard URL, nodes
    python cluster/local_cluster.py down --dir /tmp/specserve-mn

Three raylets: a head that offers no CPUs (nothing but Ray's and Serve's control actors runs there, like the
`num-cpus: 0` head pod), a "draft GPU" node and a "target GPU" node whose custom resources are the ones the
production overlay gives GPU pods (`specserve_draft_gpu`, `specserve_target_gpu`), so the app's placement groups
land where they would on GPUs. Every port is chosen free and every process gets `--dir` as its temp dir, so this
cluster neither collides with nor touches another Ray on the machine: `down` signals only the processes whose
command line names that directory, and their descendants (never `ray stop`, which stops every Ray here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DRAFT_RESOURCE, TARGET_RESOURCE = "specserve_draft_gpu", "specserve_target_gpu"


@dataclass(frozen=True)
class NodeSpec:
    role: str
    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)


def default_nodes(tp_size: int = 2) -> list[NodeSpec]:
    return [NodeSpec("head", 0),
            NodeSpec("draft", 1, {DRAFT_RESOURCE: 1}),
            NodeSpec("target", 2, {TARGET_RESOURCE: tp_size})]


def node_env() -> dict[str, str]:
    """Environment for this cluster's processes and its drivers: Ray's token authentication on every node (a
    `ray start --head` turns it on; joining nodes and drivers must say so too; the token is Ray's default file)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    return env


def use_token_auth_in_this_process() -> None:
    """Make this (driver) process speak token auth to the cluster, as Ray itself does when it turns token mode on
    for a process whose Ray is already imported: set the variable, then re-read Ray's config."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_ADDRESS", None)
    from ray._raylet import Config

    Config.initialize("")


def _free_ports(n: int, taken: set[int]) -> list[int]:
    """`n` ports free now, distinct, and none of `taken` (which they join): the ports of a cluster are chosen before
    its processes bind them, so a port closed here could otherwise be handed out twice (one CI run saw `ray start`
    fail with the runtime-env agent and the client server given the same port)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in taken:
                ports.append(port)
                taken.add(port)
        return ports
    finally:
        for s in socks:
            s.close()


def _ray_bin() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


@dataclass
class LocalCluster:
    dir: Path
    nodes: list[NodeSpec] = field(default_factory=default_nodes)
    object_store_bytes: int = 100 * 1024 * 1024
    gcs_address: str = ""
    dashboard_url: str = ""
    ports: set[int] = field(default_factory=set)  # every port handed to this cluster's processes

    def _start(self, spec: NodeSpec, head: bool) -> None:
        node_manager, object_manager, agent_listen, agent_grpc, metrics, runtime_env = _free_ports(6, self.ports)
        args = [_ray_bin(), "start", f"--num-cpus={spec.num_cpus:g}", "--num-gpus=0",
                f"--resources={json.dumps(spec.resources)}", f"--temp-dir={self.dir}",
                "--node-ip-address=127.0.0.1", f"--object-store-memory={self.object_store_bytes}",
                f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
                f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
                "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"]
        if head:
            gcs, dashboard, client = _free_ports(3, self.ports)
            args += ["--head", f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
            self.gcs_address, self.dashboard_url = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        else:
            args += [f"--address={self.gcs_address}"]
        env = node_env()
        log = (self.dir / f"start-{spec.role}.log").open("w")
        subprocess.run(args, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=120)

    def up(self, timeout_s: float = 90) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        use_token_auth_in_this_process()  # to ask the dashboard whether the nodes are up
        try:
            for i, spec in enumerate(self.nodes):
                self._start(spec, head=i == 0)
            self._wait_for_nodes(timeout_s)
        except BaseException:
            self.down()
            raise
        info = self.info()
        (self.dir / "cluster.json").write_text(json.dumps(info, indent=2))
        return info

    def alive_nodes(self) -> int:
        from ray.util.state import list_nodes

        return len(list_nodes(address=self.dashboard_url, filters=[("state", "=", "ALIVE")], timeout=10))

    def _wait_for_nodes(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if self.alive_nodes() >= len(self.nodes):
                    return
            except Exception:  # noqa: BLE001, S110 - the dashboard answers errors of several kinds while it starts
                pass
            time.sleep(1)
        raise TimeoutError(f"{len(self.nodes)} nodes did not come up within {timeout_s} s (logs in {self.dir})")

    def info(self) -> dict:
        return {"dir": str(self.dir), "gcs_address": self.gcs_address, "dashboard_url": self.dashboard_url,
                "nodes": [asdict(n) for n in self.nodes]}

    # ---- teardown: only this cluster's processes ------------------------------------------------------------
    def pids(self) -> set[int]:
        """Processes whose command line names this cluster's directory, and all their descendants."""
        marker = str(self.dir)
        roots, children = set(), {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            pid = int(proc.name)
            children.setdefault(ppid, set()).add(pid)
            if marker in cmdline and pid != os.getpid():
                roots.add(pid)
        found, stack = set(), list(roots)
        while stack:
            pid = stack.pop()
            if pid not in found:
                found.add(pid)
                stack += children.get(pid, ())
        found.discard(os.getpid())
        return found

    def down(self, timeout_s: float = 20) -> None:
        pids = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + timeout_s
            while time.time() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)
            pids = {p for p in pids | self.pids() if _alive(p)}
            if not pids:
                break


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/specserve-multinode"),
                        help="this cluster's temp dir (keep it short: Unix socket paths live under it)")
    parser.add_argument("--tp-size", type=int, default=2, help="target GPUs per target node")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.dir.resolve(), default_nodes(args.tp_size))
    if args.command == "up":
        print(json.dumps(cluster.up(), indent=2))
    else:
        cluster.down()
        print(f"stopped; {len(cluster.pids())} processes left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
