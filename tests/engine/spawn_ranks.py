"""Spawned torch.distributed ranks (gloo) for the tensor-parallel tests: a free port and one runner."""

from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a test waits for spawned ranks (their start, their rendezvous, their exit) before calling it a hang. Only a
# hang guard: `make test` runs the unit tests at a low priority beside the Ray lane (tests/low_priority.py), where two
# spawned ranks share about a tenth of a core and each takes minutes to import torch; a rendezvous that waited the
# product's 60 s for a peer still importing failed there. Modules that spawn ranks raise pytest's own limit to match.
HANG_GUARD_S = 1200.0
TEST_TIMEOUT_S = int(2 * HANG_GUARD_S)  # pytest-timeout for those modules (setup, fixtures and test together)


def run_ranks(worker, world: int, *args, timeout: float = HANG_GUARD_S,
              exitcodes: dict[int, int] | None = None) -> dict:
    """Run `worker(rank, world, port, *args, results)` in `world` spawned processes and wait for all of them, at most
    `timeout` seconds in all (each must exit 0, or with its code in `exitcodes`); returns what they stored in the
    shared `results` dict."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
            assert p.exitcode == (exitcodes or {}).get(rank, 0), (rank, p.exitcode)
        return dict(results)
