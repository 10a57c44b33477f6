"""Measuring the costs the round plan decides with (engine/spec/plan.py): verify passes and draft steps, by batch size.

The measurement is a plain timing of `ModelRunner.forward` at each batch size and width on synthetic sequences
of `context` tokens (the cache is rolled back between repetitions, so every repetition sees the same context);
the minimum over repetitions is kept, which filters out the machine's other work. Every rank of a
tensor-parallel target runs the same calls, so its collectives line up.

Only batch sizes the runner's KV cache holds are measured (`measurable_batch_sizes`): a runner of few slots
(`runner.max_num_seqs: 1`) measures fewer sizes, never more sequences than it can hold, and the profile extrapolates
beyond the largest (engine/spec/policy.py, `cost_at`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from engine.models.runner import KVCacheFull
from engine.models.transformers_runner import ModelRunner
from engine.spec.policy import CostProfile, cost_at

BATCH_SIZES = (1, 2, 4, 8, 16)
CONTEXT = 64  # tokens of context per synthetic sequence (a short prompt plus some output)


def free_slots(runner: ModelRunner) -> int | None:
    """Sequences the runner can take now (None: no limit, its cache grows); KVCacheFull, saying what to change,
    when it can take none: a measurement needs at least one."""
    capacity = runner.capacity
    if capacity is None:
        return None
    free = capacity - runner.num_live
    if free < 1:
        raise KVCacheFull(f"the cost measurement needs a free KV-cache slot and all {capacity} are taken: raise "
                          f"runner.max_num_seqs or the KV-cache budget (kv_cache_gib / kv_cache_fraction)")
    return free


def measurable_batch_sizes(runner: ModelRunner, sizes: Sequence[int] = BATCH_SIZES) -> list[int]:
    """The sizes of `sizes` the runner holds at once, and its free slot count itself when that falls between two of
    them (a runner of 12 slots runs batches of 12: the static runner's batch buckets end at its slot count)."""
    free = free_slots(runner)
    if free is None or free >= max(sizes):
        return list(sizes)
    return [s for s in sizes if s < free] + [free]


def measure_forward(runner: ModelRunner, batch_sizes: Sequence[int], widths: Sequence[int], reps: int = 3,
                    context: int = CONTEXT) -> list[list[float]]:
    """[batch][width] minimum seconds of one forward over `width` new tokens for each of `batch` sequences.

    `batch_sizes` must fit the runner's free slots (`measurable_batch_sizes`): KVCacheFull before any sequence is
    added otherwise; `context` shrinks to what the runner's longest sequence leaves room for."""
    free = free_slots(runner)
    if free is not None and max(batch_sizes) > free:
        raise KVCacheFull(f"cannot measure a batch of {max(batch_sizes)} sequences with {free} free KV-cache "
                          f"slot(s): measure the sizes engine.calibration.measure.measurable_batch_sizes gives")
    context = max(min(context, runner.max_model_len - max(widths)), 1)
    vocab = min(runner.vocab_size, 1000)
    extra = [(11 * t) % (vocab - 1) + 1 for t in range(max(widths))]
    with synthetic_sequences(runner, max(batch_sizes), context) as (ids, prompts):
        table = []
        for batch in batch_sizes:
            row = []
            for width in widths:
                best = float("inf")
                for _ in range(reps + 1):  # the first repetition warms up this shape
                    for s, prompt in zip(ids[:batch], prompts):
                        runner.sync(s, prompt + [0])  # roll the cache back to exactly the context
                    start = time.perf_counter()
                    finished(runner.forward(ids[:batch], [extra[:width]] * batch, [width] * batch))
                    best = min(best, time.perf_counter() - start)
                row.append(best)
            table.append(row)
        return table


@contextlib.contextmanager
def synthetic_sequences(runner, count: int, context: int) -> Iterator[tuple[list[str], list[list[int]]]]:
    """`count` live sequences of `context` synthetic tokens each, prefilled (ids, prompts); released after."""
    ids = [f"calibrate-{i}" for i in range(count)]
    vocab = min(runner.vocab_size, 1000)
    prompts = [[(7 * i + 3 * t) % (vocab - 1) + 1 for t in range(context)] for i in range(count)]
    try:
        for seq_id, prompt in zip(ids, prompts):
            runner.add(seq_id)
            runner.forward([seq_id], [runner.sync(seq_id, prompt)], [1])
        yield ids, prompts
    finally:
        for seq_id in ids:
            runner.release(seq_id)


def finished(logits) -> None:
    """Wait for a forward's device work: on CUDA a forward returns once its kernels are queued (a graph's replay
    in microseconds), so a clock stopped then would time the launch, not the step."""
    device = getattr(logits, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_prefill(runner: ModelRunner, tokens: int = 2 * CONTEXT, reps: int = 3) -> float:
    """Seconds per token of a prompt's prefill (one sequence of `tokens` tokens, at most the runner's longest; it
    needs one free slot)."""
    free_slots(runner)
    tokens = min(tokens, runner.max_model_len)
    vocab = min(runner.vocab_size, 1000)
    prompt = [(5 * t) % (vocab - 1) + 1 for t in range(tokens)]
    best = float("inf")
    for _ in range(reps + 1):
        runner.add("calibrate-prefill")
        try:
            start = time.perf_counter()
            finished(runner.forward(["calibrate-prefill"], [prompt], [1]))
            best = min(best, time.perf_counter() - start)
        finally:
            runner.release("calibrate-prefill")
    return best / tokens


def measure_verify(runner: ModelRunner, max_k: int, batch_sizes: Sequence[int] | None = None,
                   reps: int = 3) -> list[list[float]]:
    """[batch][k] seconds of a verify pass with k drafts (k + 1 tokens) per sequence, k = 0..max_k (default batch
    sizes: those the runner holds)."""
    sizes = measurable_batch_sizes(runner) if batch_sizes is None else batch_sizes
    return measure_forward(runner, sizes, list(range(1, max_k + 2)), reps)


def measure_draft_step(runner: ModelRunner, batch_sizes: Sequence[int] | None = None, reps: int = 3) -> list[float]:
    """[batch] seconds of one draft step (one new token per sequence; default batch sizes: those the runner
    holds)."""
    sizes = measurable_batch_sizes(runner) if batch_sizes is None else batch_sizes
    return [row[0] for row in measure_forward(runner, sizes, [1], reps)]


def measure_target_costs(runner: ModelRunner, max_k: int, reps: int = 3, drafter=None,
                         widest: int | None = None, tree_nodes: int = 0) -> dict:
    """A target's side of a cost profile (what a Target replica reports with its leases), at the batch sizes its
    KV cache holds, verify passes of up to `widest` drafts (default max_k; a token tree's nodes where trees are on);
    with a drafter inside the target, its draft costs too ("drafter": `measure_drafter_costs`, K = max_k; its
    trees' too where `tree_nodes`)."""
    sizes = measurable_batch_sizes(runner)
    costs = {"batch_sizes": sizes, "verify_seconds": measure_verify(runner, max(max_k, widest or 0), sizes, reps)}
    if drafter is not None and max_k > 0:
        costs["drafter"] = measure_drafter_costs(runner, drafter, max_k, sizes, reps, tree_nodes=tree_nodes)
    return costs


def measure_drafter_costs(runner, drafter, max_k: int, batch_sizes: Sequence[int] | None = None, reps: int = 3,
                          context: int = CONTEXT, tree_nodes: int = 0) -> dict:
    """A drafter inside the target (engine/spec/target_drafts.py), measured as a Draft replica's steps are: at each
    batch size, seconds per draft token of its `max_k` drafts for every row right after a one-token pass of theirs
    (its hidden states at hand). A round's draft cost is then K times that (engine/spec/policy.CostProfile.draft):
    exact for an early exit's K steps, an average over K for heads that draft K tokens in one pass. Reported inside
    the target's costs (`measure_target_costs`), as "drafter". With `tree_nodes`, also a round's drafting of trees of
    that many nodes (engine/spec/tree.py: an EAGLE-2 expansion costs more than the chain), "tree_draft_seconds"."""
    from engine.spec.target_drafts import DraftFrom

    sizes = measurable_batch_sizes(runner) if batch_sizes is None else batch_sizes
    context = max(min(context, runner.max_model_len - max_k - 3), 1)
    with synthetic_sequences(runner, max(sizes), context) as (ids, prompts):
        def round_seconds(batch: int, tree: int) -> float:
            best = float("inf")
            for _ in range(reps + 1):  # the first repetition warms up this shape
                for s, prompt in zip(ids[:batch], prompts):
                    runner.sync(s, prompt + [0])  # roll the cache back to exactly the context
                runner.forward(ids[:batch], [[5]] * batch, [1] * batch)
                rows = [DraftFrom(s, b, 0, context + 2, 9, max_k, tree) for b, s in enumerate(ids[:batch])]
                start = time.perf_counter()
                drafter.draft(runner, rows, getattr(runner, "last_hidden", None))
                best = min(best, time.perf_counter() - start)
            return best

        costs = {"batch_sizes": list(sizes), "draft_step_seconds": [round_seconds(b, 0) / max_k for b in sizes],
                 "name": drafter.name}
        if tree_nodes:
            costs["tree_draft_seconds"] = [round_seconds(b, tree_nodes) for b in sizes]
        return costs


def measure_draft_costs(runner: ModelRunner, reps: int = 3) -> dict:
    """A draft model's side of a cost profile (what a Draft replica reports with its leases), at the batch sizes
    its KV cache holds."""
    sizes = measurable_batch_sizes(runner)
    return {"batch_sizes": sizes, "draft_step_seconds": measure_draft_step(runner, sizes, reps),
            "draft_prefill_seconds_per_token": measure_prefill(runner, reps=reps)}


def measure_profile(target: ModelRunner, draft: ModelRunner | None, max_k: int, reps: int = 3) -> CostProfile:
    """An in-process engine's cost profile (engine/speculative.py's `profile`), measured as the served replicas
    measure theirs at start: the target's verify passes, and the draft model's steps and prefill (`draft` None: a
    proposer without a model, n-gram lookup)."""
    return profile_from_costs(measure_target_costs(target, max_k, reps),
                              None if draft is None else measure_draft_costs(draft, reps))


def profile_from_costs(target: dict, draft: dict | None) -> CostProfile:
    """The profile from a target's and a draft's measured costs (`draft` None: a proposer without a model), at the
    target's batch sizes.

    The two may have measured different sizes (each as many as its own KV cache holds: a draft of 2 slots beside a
    target of 16). A round's batch is at most the target's capacity, so the target's sizes are the profile's; the
    draft's step costs are taken at those sizes, extrapolated (engine/spec/policy.cost_at) beyond the largest it could
    measure. Its sizes beyond the target's are left out: no round is that large."""
    sizes = list(target["batch_sizes"])
    steps = None
    if draft is not None:
        measured = monotone([[t] for t in draft["draft_step_seconds"]])
        steps = [cost_at(draft["batch_sizes"], [row[0] for row in measured], b) for b in sizes]
    trees = None
    if draft is not None and draft.get("tree_draft_seconds"):
        trees = [cost_at(draft["batch_sizes"], draft["tree_draft_seconds"], b) for b in sizes]
    return profile_from(sizes, target["verify_seconds"], steps,
                        draft.get("draft_prefill_seconds_per_token", 0.0) if draft else 0.0, trees)


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
                 draft_prefill_per_token: float = 0.0, tree_draft: list[float] | None = None) -> CostProfile:
    """A profile from measured tables (made monotone first)."""
    steps = [row[0] for row in monotone([[t] for t in draft_step])] if draft_step else [0.0] * len(batch_sizes)
    trees = tuple(row[0] for row in monotone([[t] for t in tree_draft])) if tree_draft else None
    return CostProfile(batch_sizes=tuple(batch_sizes), verify_seconds=tuple(tuple(r) for r in monotone(verify)),
                       draft_step_seconds=tuple(steps), draft_prefill_seconds_per_token=draft_prefill_per_token,
                       tree_draft_seconds=trees)
