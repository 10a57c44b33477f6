"""The early exit a self-speculative draft steps with (engine/proposers/early_exit.py): a step through some of the
static runner's layers only (its first L, or a set that skips middle layers), over its KV cache, recording nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.models.static.runner import StaticRunner
from engine.models.static.steps import bucket

# the layers a self-speculative draft runs: the first L (an early exit), or these layer ids in order (middle layers
# skipped: Draft & Verify, Zhang et al. 2023, arXiv 2309.08168)
LayerSet = int | tuple[int, ...]


@torch.inference_mode()
def early_exit_step(runner: StaticRunner, seq_ids: Sequence[str], tokens: Sequence[int], starts: Sequence[int],
                    num_layers: LayerSet) -> torch.Tensor:  # [B, V] float32
    """Row b's token `tokens[b]` at position `starts[b]` through the first `num_layers` layers (or a LayerSet's ids),
    the final norm and the LM head (LayerSkip's early exit, arXiv 2404.16710): those layers' keys and values are written at that
    position, and nothing is recorded, so the sequence's cached tokens stay as they were; the verify pass that
    follows rewrites those positions through every layer (engine/proposers/early_exit.py). Every row's start must
    be at or past its cached tokens."""
    states = _exit_states(runner, seq_ids, starts)
    if runner.graphs is not None:
        rows = bucket(len(states), runner.batch_buckets)
        out = runner.graphs.step([s.slot for s in states], list(starts), [[t] for t in tokens], rows, 1,
                               layers=num_layers)
        return out[: len(states), 0].float()
    lo = min(s.slot for s in states)
    rows = max(s.slot for s in states) - lo + 1
    ids = torch.zeros(rows, 1, dtype=torch.long)
    first = torch.full((rows,), runner.max_model_len, dtype=torch.long)  # dummy rows: the scratch tail
    for state, token, start in zip(states, tokens, starts):
        ids[state.slot - lo, 0], first[state.slot - lo] = token, start
    logits = runner.model.forward(ids.to(runner.device), first.to(runner.device), lo, runner._kv_len(max(starts) + 1),
                                num_layers=num_layers)
    picked = torch.tensor([s.slot - lo for s in states], device=logits.device)
    return logits[picked, 0]


@torch.inference_mode()
def early_exit_step_fed(runner: StaticRunner, seq_ids: Sequence[str],
                        tokens: torch.Tensor,  # [B] int64 on the device: each row's token (the last step's pick)
                        starts: Sequence[int], num_layers: LayerSet) -> torch.Tensor:  # [B, V] float32 on the device
    """`early_exit_step` on the CUDA-graph path with the tokens on the device: copied into the step's staging buffer
    in the stream's order (GraphSteps.step_fed), so the host queues the step without reading the last step's pick.
    Its output is the graph's buffer, valid until the next step."""
    states = _exit_states(runner, seq_ids, starts)
    rows = bucket(len(states), runner.batch_buckets)
    out = runner.graphs.step_fed([s.slot for s in states], list(starts), tokens, rows, layers=num_layers)
    return out[: len(states), 0]


def _exit_states(runner: StaticRunner, seq_ids: Sequence[str], starts: Sequence[int]) -> list:
    """The rows' sequence states, each start checked to be at or past its cached tokens and inside the window."""
    states = [runner._seqs[s] for s in seq_ids]
    for state, start in zip(states, starts):
        if not len(state.tokens) <= start < runner.max_model_len:
            raise ValueError(f"early exit at position {start} of a sequence of {len(state.tokens)} cached tokens")
    return states
