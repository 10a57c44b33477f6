"""Start-up cost measurements kept on disk, so a restarted replica does not measure again.

A Draft or Target replica whose round plan needs costs measures them at start (engine/calibration/measure.py): much
of a SmolLM2 Target worker's start on this project's 2-core VM (bench/RESULTS.md). The figures depend only on the model,
the runner's settings, the threads and the hardware, so they are kept as JSON under a key of all of these (as inductor
keeps compiled graphs), and a restart on the same machine with the same settings reads them back. Costs only steer the
choice of K (engine/spec/plan.py), never what is sampled, so a reused measurement can cost speed but never
correctness. Delete the directory to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models.cpu import bf16_products
from engine.models.cpu import extension as cpu_extension

log = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/specserve/costs"
FORMAT = 1  # bump when what is measured, or how, changes


def hardware_key(device: torch.device) -> dict:
    """What the measurement ran on: the processor (or GPU), the threads torch computes with, torch's version."""
    key = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
           "cpus": len(os.sched_getaffinity(0)), "cpu": _cpu_model()}
    if device.type == "cpu":  # specserve's CPU operators, which version, or none (ATen's): a step's cost changes
        key["cpu_ops"] = cpu_extension.identity()
        products = bf16_products.stats()  # which operator computes bf16 products changes a step's cost too
        key["bf16_products"] = products["by_class"] if products else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key["gpu"] = {"name": props.name, "capability": [props.major, props.minor], "memory": props.total_memory}
    return key


def model_key(directory: str | os.PathLike) -> dict:
    """A model directory by its path and its files' sizes and modification times (a changed file is a new key)."""
    path = Path(directory)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return {"path": str(path.resolve()), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def costs_key(role: str, model_dir: str | os.PathLike, dtype_setting: str, runner, **settings) -> dict:
    """The key of a worker's start-up costs: its role, model, dtype setting, runner and the runner's settings that
    change a step's cost, and the hardware."""
    return {"role": role, "model": model_key(model_dir), "dtype": dtype_setting, "runner": type(runner).__name__,
            "compute_dtype": str(runner.dtype), "kv_cache_dtype": str(getattr(runner, "kv_cache_dtype", runner.dtype)),
            "compiled": bool(getattr(runner, "compiled", False)),
            "capacity": runner.capacity, "max_model_len": runner.max_model_len, **settings,
            "hardware": hardware_key(runner.device)}


def cached_costs(cache_dir: str | None, key: dict, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result for `key`: read from `cache_dir` when it holds one for exactly this key, else measured
    and written there (atomically; a directory that cannot be written only costs the next start its measurement).
    `cache_dir` None: always measure."""
    if cache_dir is None:
        return measure()
    text = json.dumps({"format": FORMAT, **key}, sort_keys=True)
    key = json.loads(text)  # as it reads back from the file (tuples become lists)
    path = Path(cache_dir).expanduser() / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            log.info("start-up costs read from %s (delete it to measure again)", path)
            return saved["costs"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure
    costs = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "costs": costs}))
        tmp.replace(path)
    except OSError as exc:
        log.warning("start-up costs not kept (%s): the next start measures them again", exc)
    return costs


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
