"""Spawned torch.distributed ranks (gloo) for the tensor-parallel tests: a free port and one runner."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, *args, timeout: float = 120, exitcodes: dict[int, int] | None = None) -> dict:
    """Run `worker(rank, world, port, *args, results)` in `world` spawned processes and wait for all of them (each
    must exit 0, or with its code in `exitcodes`); returns what they stored in the shared `results` dict."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for rank, p in enumerate(procs):
            p.join(timeout=timeout)
            if p.exitcode is None:
                p.kill()
            assert p.exitcode == (exitcodes or {}).get(rank, 0), (rank, p.exitcode)
        return dict(results)
