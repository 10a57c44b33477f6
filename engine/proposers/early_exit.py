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
from collections.abc import Callable, Sequence

import torch

from engine.models.static.early_exit import LayerSet, early_exit_step, early_exit_step_fed
from engine.spec.policy import expected_tokens
from engine.spec.target_drafts import DraftFrom, greedy_tokens
from engine.spec.tree import DraftTree, chain_with_siblings, top_candidates


class EarlyExitDrafter:
    """TargetDrafter: K steps of some of the target's layers (its first L, or a set skipping middle layers), batched
    over the rows."""

    def __init__(self, exit_layers: LayerSet) -> None:
        if isinstance(exit_layers, int) and exit_layers < 1:
            raise ValueError("an early exit needs at least one layer")
        self.exit_layers = exit_layers
        self.name = f"self:{layer_set_name(exit_layers)}"
        self.needs_hidden = False  # it reads the KV cache the verify pass wrote
        self.collective = True  # on a shard its steps are the shard's layers: every rank steps with rank 0

    def draft(self, runner, rows: Sequence[DraftFrom], hidden: torch.Tensor | None) -> list[list[int] | DraftTree]:
        if runner.graphs is not None and not any(row.tree for row in rows):
            return self._fed_chains(runner, rows)
        drafts: list[list[int]] = [[] for _ in rows]
        steps: dict[int, list] = {b: [] for b, row in enumerate(rows) if row.tree}  # tree rows' candidates per step
        tokens = {b: row.last for b, row in enumerate(rows)}
        for step in range(max((row.k for row in rows), default=0)):
            active = [b for b, row in enumerate(rows) if row.k > step]
            logits = early_exit_step(runner, [rows[b].seq_id for b in active], [tokens[b] for b in active],
                                     [rows[b].committed - 1 + step for b in active], self.exit_layers)
            for b, token in zip(active, greedy_tokens(logits)):
                drafts[b].append(token)
                tokens[b] = token
            trees = [i for i, b in enumerate(active) if b in steps]
            if trees:
                for i, candidates in zip(trees, top_candidates(logits[trees].float().softmax(dim=-1))):
                    steps[active[i]].append(candidates)
        return [chain_with_siblings(steps[b], row.tree) if b in steps else drafts[b] for b, row in enumerate(rows)]

    def _fed_chains(self, runner, rows: Sequence[DraftFrom]) -> list[list[int]]:
        """Chains on the CUDA-graph path, each step fed the last step's picks on the device: the host queues step
        j + 1 without reading step j's tokens and reads every draft once, at the end (as a draft model's steps,
        engine/proposers/draft_model.py), instead of a sync per step. A row leaves the steps after its k."""
        current = torch.tensor([row.last for row in rows], device=runner.device)  # each row's newest token
        picks: list[tuple[list[int], torch.Tensor]] = []  # per step: its rows, and their picks [len(rows)]
        for step in range(max((row.k for row in rows), default=0)):
            active = [b for b, row in enumerate(rows) if row.k > step]
            index = torch.tensor(active, device=runner.device)
            logits = early_exit_step_fed(runner, [rows[b].seq_id for b in active], current[index],
                                         [rows[b].committed - 1 + step for b in active], self.exit_layers)
            picked = logits.argmax(dim=-1)
            current[index] = picked
            picks.append((active, picked))
        drafts: list[list[int]] = [[] for _ in rows]
        if picks:
            values = torch.cat([p for _, p in picks]).tolist()  # the round's one read of the device
            at = 0
            for active, _ in picks:
                for b in active:
                    drafts[b].append(values[at])
                    at += 1
        return drafts


def exit_agreement(runner, token_ids: Sequence[int], candidates: Sequence[LayerSet],
                    first: int = 0) -> dict[LayerSet, float]:
    """For each candidate exit L (or layer set), how often its greedy next token equals the whole model's over the
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


def choose_exit_layer(agreement: dict[LayerSet, float], step_seconds: dict[LayerSet, float],
                      verify_seconds: Sequence[float], max_k: int) -> tuple[LayerSet, int]:
    """(L, K) with the most expected tokens per second at one stream: E(a_L, K) (Leviathan et al. 2022, Sec. 3.4)
    over K early-exit steps of L layers (or a layer set's) plus a verify pass of width K + 1 (`verify_seconds[k]`,
    measured)."""
    best, choice = 0.0, (next(iter(agreement)), 1)
    for layers, accept in agreement.items():
        for k in range(1, max_k + 1):
            rate = expected_tokens(accept, k) / (k * step_seconds[layers] + verify_seconds[k])
            if rate > best:
                best, choice = rate, (layers, k)
    return choice


def time_exit_step(runner, num_layers: LayerSet, reps: int = 5) -> float:
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


def skip_block(total: int, first: int, last: int) -> tuple[int, ...]:
    """Every layer of `total` but first..last (inclusive): a middle block skipped."""
    if not 1 <= first <= last < total - 1:
        raise ValueError(f"a skipped block of {total} layers keeps the first and the last: 1 <= A <= B <= {total - 2}, "
                         f"got {first}-{last}")
    return tuple(i for i in range(total) if not first <= i <= last)


def layer_set_name(layers: LayerSet) -> str:
    """`self:`'s argument for a layer set: "L" for an early exit, "skip:A-B" for a skipped middle block."""
    if isinstance(layers, int):
        return str(layers)
    skipped = [i for i in range(layers[0], layers[-1]) if i not in layers]
    if layers[0] != 0 or not skipped or skipped != list(range(skipped[0], skipped[-1] + 1)):
        return "layers:" + ",".join(map(str, layers))
    return f"skip:{skipped[0]}-{skipped[-1]}"


def layer_set_candidates(total: int, skips: bool = False) -> list[LayerSet]:
    """What `draft: self` measures at start: exits after about 1/8 .. 6/8 of the layers; with `skips`, also for each
    such count of 4 or more a set running as many layers with a middle block skipped (the first half of them and the
    last half: on the embedded 135M the middle-skipping layout that agreed most with the whole model, and more than
    the exit with as many layers at 16 and 24 layers: bench/RESULTS.md). `self` measures exits only: chosen with the
    skips, a skip served below plain decoding, whose rounds are cheaper where decoded ahead (bench/RESULTS.md);
    `self:skip:A-B` runs one when asked."""
    exits = sorted({max(1, min(total - 1, round(total * f / 8))) for f in range(1, 7)})
    if not skips:
        return exits
    # an exit count is below `total`, so the block kept // 2 .. total - 1 - (kept - kept // 2) is never empty
    return [*exits, *(skip_block(total, kept // 2, total - 1 - (kept - kept // 2)) for kept in exits if kept >= 4)]


def auto_exit_layer(runner, tokenizer, max_k: int, agree: Callable[[int], int] | None = None) -> LayerSet:
    """`draft: self`'s layers, chosen at start-up (`choose_exit_layer`): each candidate exit's (`layer_set_candidates`)
    agreement with the full model over the target's own answer to a shipped prompt (engine/training/prompts.jsonl),
    against its measured step and the measured verify passes. `agree` maps this process's choice (an index into the
    candidates) to the one to take (tensor parallelism: rank 0's). Logged as a table."""
    import logging

    from engine.calibration.measure import measure_verify
    from engine.training.prompts import encode_prompt, training_prompts

    total = len(runner.model.layers)
    candidates = layer_set_candidates(total)
    prompt = encode_prompt(tokenizer, training_prompts()[0]) if tokenizer is not None else list(range(2, 18))
    text = target_text(runner, prompt)
    agreement = exit_agreement(runner, text, candidates, first=len(prompt) - 1)
    steps = {layers: time_exit_step(runner, layers) for layers in candidates}
    verify = measure_verify(runner, max_k, [1])[0]
    layers, k = choose_exit_layer(agreement, steps, verify, max_k)
    if agree is not None:
        layers = candidates[agree(candidates.index(layers))]
    log = logging.getLogger(__name__)
    for candidate in candidates:
        log.info("draft: self: %s of %d layers: agreement %.3f, step %.2f ms", layer_set_name(candidate), total,
                 agreement[candidate], 1e3 * steps[candidate])
    log.info("draft: self: chose self:%s (best at K = %d; the round plan chooses K per round)", layer_set_name(layers),
             k)
    return layers
