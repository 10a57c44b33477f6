"""Which prompt rows share a prefill forward, and which rows' prompts are computed once and copied (the static
runner's chunked prefill, engine/models/static/runner.py)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.models.runner import SeqSlot

PREFILL_TOKENS_PER_FORWARD = 4  # rows' prefill chunks share a forward up to this many chunks' worth of tokens
PREFILL_MAX_PADDING = 1.15  # ... and up to this many padded tokens per real one (prefill_groups)


def shared_heads(states: Sequence[SeqSlot], heads: Sequence[list[int]]
                 ) -> tuple[list[list[int]], list[tuple[int, int, list[int]]]]:
    """The heads to compute (a row repeating an earlier row's cached tokens and head gets none) and the copies to
    make after: (row computed, row that copies its cache, that row's head)."""
    first: dict[tuple, int] = {}
    todo, copies = [], []
    for b, (state, head) in enumerate(zip(states, heads)):
        key = (tuple(state.tokens), tuple(head))
        if head and key in first:
            copies.append((first[key], b, head))
            todo.append([])
        else:
            first.setdefault(key, b)
            todo.append(head)
    return todo, copies


def prefill_groups(slots: Sequence[int], widths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of rows (sorted by slot) that can share one prefill forward: consecutive slots (the forward reads a
    contiguous range of the cache), at most `max_tokens` padded tokens, and at most PREFILL_MAX_PADDING times the
    real tokens. Shorter chunks are padded to the longest, and padding is computed like real tokens, while sharing
    a forward saves little once the products are compute-bound: waves of short SmolLM2 prompts took clearly longer
    with generous padding than with PREFILL_MAX_PADDING's, which took as long as none (measured: bench/RESULTS.md)."""
    groups: list[list[int]] = []
    for i, (slot, width) in enumerate(zip(slots, widths)):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * max(width, max(widths[j] for j in group))
            real = width + sum(widths[j] for j in group)
            if slot == slots[group[-1]] + 1 and padded <= max_tokens and padded <= PREFILL_MAX_PADDING * real:
                group.append(i)
                continue
        groups.append([i])
    return groups
