"""Starting, readying and fully stopping the servers that bench/peer_serve.py compares (ours and `vllm serve`),
and the run's parameters (commit, machine, vLLM version).

One server at a time: each runs in its own session (`start_new_session`), so the server and everything it starts
(Ray's GCS, raylet, workers, Serve replicas; vLLM's engine-core process) can be found by session id and stopped
together. Stopping sends SIGINT to the leader (`serve run` shuts Serve and its local Ray down; `vllm serve`
shuts its engine down), then SIGTERM and SIGKILL to whatever is left in the session or below the leader, and
reports any survivor. `ray stop` is not used: it would also kill other people's Ray clusters on the machine.

Ready means a real completion succeeded, not just `/health`: our `/health` answers 200 well before the first
completion can run (issue 16: by tens of seconds on a small CPU machine).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "bench" / ".vllm-venv" / "bin" / "python"
VLLM_CLI = ROOT / "bench" / "vllm_cli.py"
HEALTH_POLL_S = 0.5  # the resolution of the start-up times a server records
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# ---- pure helpers (unit-tested) ------------------------------------------------------------------------------

def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree["a"]["b"] = value for dotted "a.b", making missing sections (a typo then fails our config's validation,
    which forbids unknown keys); a key whose value is not a section cannot hold one."""
    *parents, last = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise KeyError(f"{dotted!r}: {key!r} is a value, not a section")
    node[last] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["model.draft=none", "speculation.num_speculative_tokens=2"] -> {dotted: YAML-parsed value}."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        out[key.strip()] = yaml.safe_load(raw)
    return out


def derive_ours_config(base: dict, overrides: dict[str, Any], port: int) -> dict:
    """A copy of a `serve run` config (serve_config.yaml's shape) with the first application's args overridden
    (dotted keys relative to `args`) and the HTTP port set."""
    cfg = copy.deepcopy(base)
    cfg.setdefault("http_options", {})["port"] = port
    args = cfg["applications"][0]["args"]
    for dotted, value in overrides.items():
        set_dotted(args, dotted, value)
    return cfg


SERVE_CLI_CODE = "from ray.serve.scripts import cli; cli()"


def serve_run_argv(config: str | Path, python_cli: bool | None = None) -> list[str]:
    """`serve run` of a serve config file on a new local Ray cluster, from this environment's Ray: its `serve`
    console script, or (python_cli, or None and no such script: an environment installed without console scripts,
    as on the GPU machines) the same command through `python -c`."""
    script = Path(sys.executable).parent / "serve"
    if python_cli is None:
        python_cli = not script.is_file()
    head = [sys.executable, "-c", SERVE_CLI_CODE] if python_cli else [str(script)]
    return head + ["run", str(config), "--address", "local"]


def vllm_serve_argv(model_dir: str, dtype: str, served_name: str, port: int, max_model_len: int,
                    speculative_config: dict | None, extra: Sequence[str] = ()) -> list[str]:
    argv = [str(VLLM_PYTHON), str(VLLM_CLI), "serve", model_dir, "--dtype", dtype,
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--seed", "0"]
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    return argv + list(extra)


def vllm_env(kv_cache_gib: float) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    return env


VLLM_NOTES = ("core ids", "reserved_cpus", "torch threads", "kv cache", "compil", "dtype")


def log_notes(log: str, limit: int = 12) -> list[str]:
    """vLLM's start-up lines about its threads and cores, KV cache, compile and dtype (the message part)."""
    notes = []
    for line in log.splitlines():
        message = line.split("] ", 1)[-1].strip()
        if any(key in message.lower() for key in VLLM_NOTES) and "shared memory" not in message \
                and message not in notes:
            notes.append(message[:240])
    return notes[:limit]


def machine_params() -> dict:
    """The run's commit (and whether the tree had local changes), UTC date, CPU model (lscpu), cores, ISA flags."""

    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    lscpu = dict(line.split(":", 1) for line in sh("lscpu").splitlines() if ":" in line)
    flags = set(lscpu.get("Flags", "").split())
    return {"commit": sh("git", "rev-parse", "HEAD"), "dirty_tree": bool(sh("git", "status", "--porcelain",
                                                                                "--untracked-files=no")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": lscpu.get("Model name", "").strip(), "cpus": os.cpu_count(),
            "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})}


def vllm_version() -> str:
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    try:
        return subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---- processes ---------------------------------------------------------------------------------------------

def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] == "Z":
            continue  # a zombie holds nothing; its parent reaps it
        table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def family(leader: int) -> set[int]:
    """Live processes in the leader's session or below it (it was started with start_new_session)."""
    table = _proc_table()
    found = {pid for pid, (_, sid) in table.items() if sid == leader}
    frontier = [leader]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in table.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def sigint_reaches_children() -> None:
    """Let the servers this process starts stop on SIGINT (`stop`'s first, graceful signal).

    A process started with SIGINT ignored (a job a non-interactive shell put in the background, `nohup`) passes the
    ignoring on to every child it execs, and Python then installs no KeyboardInterrupt handler in them: `serve run`
    would sit out each stop's full grace period before SIGTERM. A handled signal is reset to its default on exec,
    so this process handling SIGINT again (as Python does by default) is enough. Main thread only (Python's rule)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class ManagedServer:
    """One server process (and its session), with a log file; `start`, `wait_ready`, `stop`."""

    name: str
    argv: list[str]
    base_url: str
    model_name: str
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    timings: dict = field(default_factory=dict)
    cwd: Path = ROOT  # where it runs (Ray's workers put the driver's working directory first on sys.path)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sigint_reaches_children()
        log = open(self.log_path, "w")
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health answers 200 (polled every HEALTH_POLL_S), then until a greedy 2-token completion
        succeeds; raises with the log's tail when the process dies or the time runs out. Records seconds to the
        first /health 200 and to the first completion."""
        deadline = time.perf_counter() + timeout_s
        body = {"model": self.model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n"
                                       + self.log_tail())
                try:
                    if "health_s" not in self.timings:
                        if client.get("/health", timeout=10).status_code != 200:
                            time.sleep(HEALTH_POLL_S)
                            continue
                        self.timings["health_s"] = round(time.perf_counter() - self._t0, 1)
                    # the first completion may wait for replicas or a compile: let it, within the deadline
                    r = client.post("/v1/completions", json=body, timeout=max(10.0, deadline - time.perf_counter()))
                    if r.status_code == 200 and r.json()["choices"][0].get("text") is not None:
                        self.timings["ready_s"] = round(time.perf_counter() - self._t0, 1)
                        return
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                time.sleep(HEALTH_POLL_S if "health_s" not in self.timings else 2)
        raise TimeoutError(f"{self.name} gave no completion within {timeout_s:g} s:\n" + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 60.0) -> list[str]:
        """SIGINT the leader, wait; SIGTERM then SIGKILL the rest of its session. Returns survivors (none)."""
        if self.proc is None:
            return []
        leader = self.proc.pid
        seen = family(leader)
        if self.proc.poll() is None:
            os.kill(leader, signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            left = (seen | family(leader)) & set(_proc_table())
            if not left:
                break
            _signal_all(left, sig)
            deadline = time.perf_counter() + wait_s
            while time.perf_counter() < deadline and (left & set(_proc_table())):
                time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.wait(10)
        survivors = (seen | family(leader)) & set(_proc_table())
        self.timings["stopped_s"] = round(time.perf_counter() - self._t0, 1)
        return [f"{pid} {_cmdline(pid)}" for pid in sorted(survivors)]
