"""cluster/local_cluster.py without Ray: its teardown finds exactly the processes that name its directory and their
descendants, and leaves every other process alone (offline, a second or two)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.cluster.local_cluster_module import lc

SPAWN = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


def _wait_for_children(pid: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(lc._alive(int(p)) for p in _children(pid)):
            return
        time.sleep(0.05)
    raise TimeoutError("child did not start")


def _children(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []


def test_down_stops_its_processes_and_their_children_only(tmp_path):
    ours = tmp_path / "ssmn-ours"
    other = tmp_path / "ssmn-other"
    mine = subprocess.Popen([sys.executable, "-c", SPAWN, str(ours)])
    theirs = subprocess.Popen([sys.executable, "-c", SPAWN, str(other)])
    try:
        _wait_for_children(mine.pid)
        _wait_for_children(theirs.pid)
        my_child = int(_children(mine.pid)[0])
        cluster = lc.LocalCluster(ours, [])
        assert cluster.pids() == {mine.pid, my_child}  # the marker's process and its descendant, nothing else
        cluster.down(timeout_s=30)  # SIGTERM, and SIGKILL for what is left 30 s later: bounds a hang only
        mine.wait(timeout=60)
        deadline = time.time() + 60
        while lc._alive(my_child) and time.time() < deadline:
            time.sleep(0.05)
        assert not lc._alive(my_child)
        assert theirs.poll() is None and all(lc._alive(int(p)) for p in _children(theirs.pid))
    finally:
        for proc in (mine, theirs):
            for child in _children(proc.pid):
                subprocess.run(["kill", child], check=False)
            proc.kill()
            proc.wait()


def test_a_cluster_never_hands_out_one_port_twice():
    from cluster.local_cluster import _free_ports

    taken: set[int] = set()
    first, second = _free_ports(6, taken), _free_ports(3, taken)
    assert len(set(first + second)) == 9 and taken == set(first + second)
