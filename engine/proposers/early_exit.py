"""Self-speculative drafting: the target's own first L layers, its final norm and its LM head draft (LayerSkip's
early exit, Elhoushi et al. 2024, arXiv 2404.16710; the seeds' self-speculative decoding).

The draft shares the target's KV cache of those L layers: the verify pass writes every layer's keys and values for
the committed tokens, so the draft reads them and nothing is prefilled twice. Its own steps write the first L
layers' keys and values at the positions past the committed tokens (engine/models/static/early_exit.py), which the
next verify pass rewrites through every layer; the runner never records them as cached.

A model not trained for early exit (LayerSkip trains with layer dropout and an early-exit loss) agrees little with
itself from its first layers: the acceptance this measures on such models is low (README, bench/RESULTS.md), which
the round plan sees, turning drafts off where they do not pay. `choose_exit_layer` picks L at start-up from the
target's own text: the agreement of each candidate exit with the full model, measured in one forward, against the
measured cost of each exit's step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.models.static.early_exit import early_exit_step
from engine.spec.policy import expected_tokens
from engine.spec.target_drafts import DraftFrom, greedy_tokens
from engine.spec.tree import DraftTree, chain_with_siblings, top_candidates


class EarlyExitDrafter:
    """TargetDrafter: K early-exit steps of the first `num_layers` layers, batched over the rows."""

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError("an early exit needs at least one layer")
        self.num_layers = num_layers
        self.name = f"self:{num_layers}"
        self.needs_hidden = False  # it reads the KV cache the verify pass wrote
        self.collective = True  # on a shard its steps are the shard's layers: every rank steps with rank 0

    def draft(self, runner, rows: Sequence[DraftFrom], hidden: torch.Tensor | None) -> list[list[int] | DraftTree]:
        drafts: list[list[int]] = [[] for _ in rows]
        steps: dict[int, list] = {b: [] for b, row in enumerate(rows) if row.tree}  # tree rows' candidates per step
        tokens = {b: row.last for b, row in enumerate(rows)}
        for step in range(max((row.k for row in rows), default=0)):
            active = [b for b, row in enumerate(rows) if row.k > step]
            logits = early_exit_step(runner, [rows[b].seq_id for b in active], [tokens[b] for b in active],
                                     [rows[b].committed - 1 + step for b in active], self.num_layers)
            for b, token in zip(active, greedy_tokens(logits)):
                drafts[b].append(token)
                tokens[b] = token
            trees = [i for i, b in enumerate(active) if b in steps]
            if trees:
                for i, candidates in zip(trees, top_candidates(logits[trees].float().softmax(dim=-1))):
                    steps[active[i]].append(candidates)
        return [chain_with_siblings(steps[b], row.tree) if b in steps else drafts[b] for b, row in enumerate(rows)]


def exit_agreement(runner, token_ids: Sequence[int], candidates: Sequence[int], first: int = 0) -> dict[int, float]:
    """For each candidate exit L, how often the first L layers' greedy next token equals the whole model's over the
    text `token_ids` from position `first` on (static runner: one eager pass of every layer, then one of each exit's
    layers, in a free slot): the per-token acceptance a greedy early-exit draft of L layers would see on such text."""
    seq_id = "calibrate-exit"
    runner.add(seq_id)
    try:
        full = runner.prompt_logits(seq_id, token_ids).argmax(-1)[first:]  # [N - first]
        slot = runner._seqs[seq_id].slot
        ids = torch.tensor([list(token_ids)], device=runner.device)
        starts = torch.zeros(1, dtype=torch.long, device=runner.device)
        agreement = {}
        with torch.inference_mode():
            for layers in candidates:
                logits = runner.model.forward(ids, starts, slot, runner._kv_len(len(token_ids)), num_layers=layers)
                agreement[layers] = (logits[0, first:].argmax(-1) == full).float().mean().item()
        return agreement
    finally:
        runner.release(seq_id)


def choose_exit_layer(agreement: dict[int, float], step_seconds: dict[int, float], verify_seconds: Sequence[float],
                      max_k: int) -> tuple[int, int]:
    """(L, K) with the most expected tokens per second at one stream: E(a_L, K) (Leviathan et al. 2022, Sec. 3.4)
    over K early-exit steps of L layers plus a verify pass of width K + 1 (`verify_seconds[k]`, measured)."""
    best, choice = 0.0, (min(agreement), 1)
    for layers, accept in agreement.items():
        for k in range(1, max_k + 1):
            rate = expected_tokens(accept, k) / (k * step_seconds[layers] + verify_seconds[k])
            if rate > best:
                best, choice = rate, (layers, k)
    return choice


def time_exit_step(runner, num_layers: int, reps: int = 5) -> float:
    """Seconds of one early-exit step of one sequence (a short synthetic context), the minimum of `reps`."""
    seq_id = "calibrate-exit"
    runner.add(seq_id)
    try:
        context = [(7 * t) % (runner.vocab_size - 1) + 1 for t in range(32)]
        runner.forward([seq_id], [runner.sync(seq_id, context)], [1])
        best = float("inf")
        for _ in range(reps + 1):
            start = time.perf_counter()
            early_exit_step(runner, [seq_id], [1], [len(context)], num_layers)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        runner.release(seq_id)


def target_text(runner, prompt: Sequence[int], tokens: int = 96) -> list[int]:
    """The prompt and the target's own greedy continuation of it (plain steps in a free slot)."""
    seq_id = "calibrate-text"
    runner.add(seq_id)
    try:
        text = list(prompt)
        for _ in range(min(tokens, runner.max_model_len - len(text) - 1)):
            logits = runner.forward([seq_id], [runner.sync(seq_id, text)], [1])
            text.append(int(logits[0, -1].argmax()))
        return text
    finally:
        runner.release(seq_id)


def auto_exit_layer(runner, tokenizer, max_k: int) -> int:
    """`draft: self`'s L, chosen at start-up (`choose_exit_layer`): each candidate exit's agreement with the full
    model over the target's own answer to a shipped prompt (engine/training/prompts.jsonl), against its measured step
    and the measured verify passes. Logged as a table."""
    import logging

    from engine.calibration.measure import measure_verify
    from engine.training.prompts import encode_prompt, training_prompts

    total = len(runner.model.layers)
    candidates = sorted({max(1, min(total - 1, round(total * f / 8))) for f in range(1, 7)})
    prompt = encode_prompt(tokenizer, training_prompts()[0]) if tokenizer is not None else list(range(2, 18))
    text = target_text(runner, prompt)
    agreement = exit_agreement(runner, text, candidates, first=len(prompt) - 1)
    steps = {layers: time_exit_step(runner, layers) for layers in candidates}
    verify = measure_verify(runner, max_k, [1])[0]
    layers, k = choose_exit_layer(agreement, steps, verify, max_k)
    log = logging.getLogger(__name__)
    for candidate in candidates:
        log.info("draft: self: exit after %d of %d layers: agreement %.3f, step %.2f ms", candidate, total,
                 agreement[candidate], 1e3 * steps[candidate])
    log.info("draft: self: chose L = %d (best at K = %d; the round plan chooses K per round)", layers, k)
    return layers
