"""Measuring the costs `engine.policy.choose_k` decides with: verify passes and draft steps, by batch size.

The measurement is a plain timing of `ModelRunner.forward` at each batch size and width on synthetic sequences
of `context` tokens (the cache is rolled back between repetitions, so every repetition sees the same context);
the minimum over repetitions is kept, which filters out the machine's other work. Every rank of a
tensor-parallel target runs the same calls, so its collectives line up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .model_runner import ModelRunner
from .policy import CostProfile

BATCH_SIZES = (1, 2, 4, 8, 16)
CONTEXT = 64  # tokens of context per synthetic sequence (a short prompt plus some output)


def measure_forward(runner: ModelRunner, batch_sizes: Sequence[int], widths: Sequence[int], reps: int = 3,
                    context: int = CONTEXT) -> list[list[float]]:
    """[batch][width] minimum seconds of one forward over `width` new tokens for each of `batch` sequences."""
    ids = [f"calibrate-{i}" for i in range(max(batch_sizes))]
    vocab = min(runner.vocab_size, 1000)
    prompts = [[(7 * i + 3 * t) % (vocab - 1) + 1 for t in range(context)] for i in range(len(ids))]
    extra = [(11 * t) % (vocab - 1) + 1 for t in range(max(widths))]
    try:
        for seq_id, prompt in zip(ids, prompts):
            runner.add(seq_id)
            runner.forward([seq_id], [runner.sync(seq_id, prompt)], [1])
        table = []
        for batch in batch_sizes:
            row = []
            for width in widths:
                best = float("inf")
                for _ in range(reps + 1):  # the first repetition warms up this shape
                    for s, prompt in zip(ids[:batch], prompts):
                        runner.sync(s, prompt + [0])  # roll the cache back to exactly the context
                    start = time.perf_counter()
                    runner.forward(ids[:batch], [extra[:width]] * batch, [width] * batch)
                    best = min(best, time.perf_counter() - start)
                row.append(best)
            table.append(row)
        return table
    finally:
        for seq_id in ids:
            runner.release(seq_id)


def measure_prefill(runner: ModelRunner, tokens: int = 2 * CONTEXT, reps: int = 3) -> float:
    """Seconds per token of a prompt's prefill (one sequence of `tokens` tokens)."""
    vocab = min(runner.vocab_size, 1000)
    prompt = [(5 * t) % (vocab - 1) + 1 for t in range(tokens)]
    best = float("inf")
    for _ in range(reps + 1):
        runner.add("calibrate-prefill")
        try:
            start = time.perf_counter()
            runner.forward(["calibrate-prefill"], [prompt], [1])
            best = min(best, time.perf_counter() - start)
        finally:
            runner.release("calibrate-prefill")
    return best / tokens


def measure_verify(runner: ModelRunner, max_k: int, batch_sizes: Sequence[int] = BATCH_SIZES,
                   reps: int = 3) -> list[list[float]]:
    """[batch][k] seconds of a verify pass with k drafts (k + 1 tokens) per sequence, k = 0..max_k."""
    return measure_forward(runner, batch_sizes, list(range(1, max_k + 2)), reps)


def measure_draft_step(runner: ModelRunner, batch_sizes: Sequence[int] = BATCH_SIZES, reps: int = 3) -> list[float]:
    """[batch] seconds of one draft step (one new token per sequence)."""
    return [row[0] for row in measure_forward(runner, batch_sizes, [1], reps)]


def measure_target_costs(runner: ModelRunner, max_k: int, reps: int = 3) -> dict:
    """A target's side of a cost profile (what a Target replica reports with its leases)."""
    return {"batch_sizes": list(BATCH_SIZES), "verify_seconds": measure_verify(runner, max_k, BATCH_SIZES, reps)}


def measure_draft_costs(runner: ModelRunner, reps: int = 3) -> dict:
    """A draft model's side of a cost profile (what a Draft replica reports with its leases)."""
    return {"batch_sizes": list(BATCH_SIZES), "draft_step_seconds": measure_draft_step(runner, BATCH_SIZES, reps),
            "draft_prefill_seconds_per_token": measure_prefill(runner, reps=reps)}


def measure_profile(target: ModelRunner, draft: ModelRunner | None, max_k: int, reps: int = 3) -> CostProfile | None:
    """An in-process engine's cost profile (engine/speculative.py's `profile`), measured as the served replicas
    measure theirs at start: the target's verify passes, and the draft model's steps and prefill (`draft` None: a
    proposer without a model, n-gram lookup)."""
    return profile_from_costs(measure_target_costs(target, max_k, reps),
                              None if draft is None else measure_draft_costs(draft, reps))


def profile_from_costs(target: dict, draft: dict | None) -> CostProfile | None:
    """The profile from a target's and a draft's measured costs (`draft` None: a proposer without a model);
    None when the two were measured at different batch sizes."""
    if draft is not None and draft["batch_sizes"] != target["batch_sizes"]:
        return None
    return profile_from(target["batch_sizes"], target["verify_seconds"],
                        draft["draft_step_seconds"] if draft else None,
                        draft.get("draft_prefill_seconds_per_token", 0.0) if draft else 0.0)


def monotone(table: list[list[float]]) -> list[list[float]]:
    """[batch][width] costs where a pass over fewer sequences or tokens never costs more than a bigger one: each
    entry becomes the minimum over the entries at least as large. A timing inflated by the machine's other work
    (a burst of another process) is replaced by the cheaper measurement of a bigger pass."""
    out = [list(row) for row in table]
    for i in reversed(range(len(out))):
        for j in reversed(range(len(out[i]))):
            if i + 1 < len(out):
                out[i][j] = min(out[i][j], out[i + 1][j])
            if j + 1 < len(out[i]):
                out[i][j] = min(out[i][j], out[i][j + 1])
    return out


def profile_from(batch_sizes: Sequence[int], verify: list[list[float]], draft_step: list[float] | None,
                 draft_prefill_per_token: float = 0.0) -> CostProfile:
    """A profile from measured tables (made monotone first)."""
    steps = [row[0] for row in monotone([[t] for t in draft_step])] if draft_step else [0.0] * len(batch_sizes)
    return CostProfile(batch_sizes=tuple(batch_sizes), verify_seconds=tuple(tuple(r) for r in monotone(verify)),
                       draft_step_seconds=tuple(steps), draft_prefill_seconds_per_token=draft_prefill_per_token)
