"""A static runner's start-up: every step shape the serving loop uses captured (CUDA graphs) or compiled (inductor)
before the first request, so no request waits on it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.static.steps import bucket


def warm_up(runner, max_k: int, progress: Callable[[str], None] | None = None,
            exit_layers: int | tuple[int, ...] | None = None) -> int:
    """Capture (CUDA graphs) or compile (inductor, or load from its cache) every step shape the serving loop
    uses: each batch bucket at width 1 and K+1 (CUDA graphs: every width bucket up to K+1's, as rounds whose
    rows draft fewer tokens are narrower), and under inductor each prefill chunk bucket. Returns the number of
    shapes."""
    if runner.graphs is not None:
        top = bucket(max_k + 1, runner.width_buckets)
        shapes = [(rows, width) for width in runner.width_buckets if width <= top for rows in runner.batch_buckets]
        if runner.device.type == "cuda":
            runner.graphs.capture(shapes, progress)
            if exit_layers is not None:  # an early-exit drafter's steps (engine/proposers/early_exit.py)
                runner.graphs.capture([(rows, 1) for rows in runner.batch_buckets], progress, layers=exit_layers)
        return len(shapes)
    shapes = [(rows, width) for width in sorted({1, bucket(max_k + 1, runner.width_buckets)})
              for rows in runner.batch_buckets]
    if runner._prefill is runner._step:
        shapes += [(1, -chunk) for chunk in runner.chunk_buckets]
    with torch.inference_mode():
        for done, (rows, width) in enumerate(shapes, 1):
            if width < 0:
                ids, last_only = torch.zeros(1, -width, dtype=torch.long), True
            else:
                ids, last_only = torch.zeros(rows, width, dtype=torch.long), False
            starts = torch.full((ids.shape[0],), runner.max_model_len, dtype=torch.long)
            # CUDA: the smallest key-length bucket here; longer ones are captured when first reached
            runner._run(ids, starts, 0, runner._kv_len(ids.shape[1]), last_only)
            if progress is not None:
                progress(f"compiled {done}/{len(shapes)}: batch {ids.shape[0]} width {ids.shape[1]}")
    return len(shapes)
