"""The static runner's chunked prefill (engine/models/static/runner.py): which tokens of a row are prefilled before
the batched step, which prompt rows share a prefill forward, which rows' prompts are computed once and copied, and
the loop that feeds the chunks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def split_heads(new_tokens: Sequence[list[int]], num_logits: Sequence[int], max_width: int
                ) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's head and tail: a row of more than `max_width` new tokens prefills everything but its last
    num_logits tokens first (its head, in chunks); the tail joins the batched step, at most `max_width` wide."""
    heads, tails = [], []
    for toks, k in zip(new_tokens, num_logits):
        head = len(toks) - max(k, 1) if len(toks) > max_width else 0
        if k > max_width:
            raise ValueError(f"at most {max_width} logits per row, asked for {k}")
        heads.append(list(toks[:head]))
        tails.append(list(toks[head:]))
    return heads, tails


def prefill_heads(states: list[SeqSlot], heads: list[list[int]], chunk: int,
                  feed: Callable[[list[SeqSlot], list[list[int]]], None],
                  copy_slot: Callable[[int, int, int], None]) -> None:
    """Feed each row's head (prompt tokens whose logits are not needed) in chunks of at most `chunk` tokens:
    `feed(rows, chunks)` runs one forward of rows in consecutive slots and records their tokens. Rows in neighbouring
    slots share a forward (`prefill_groups`): 8 new prompts cost one pass over the weights per chunk instead of 8, the
    projections run as larger matrix products, and each layer's fixed costs are paid once (measured in
    bench/RESULTS.md). Rows whose cached tokens and head are the same (the `n` choices of one request, one prompt sent
    twice) are computed once: the others copy its keys and values (`copy_slot(src, dst, length)`)."""
    heads, copies = shared_heads(states, heads)
    fed = [0] * len(states)
    while True:
        chunks = {b: heads[b][fed[b] : fed[b] + chunk] for b in range(len(states)) if fed[b] < len(heads[b])}
        if not chunks:
            break
        order = sorted(chunks, key=lambda b: states[b].slot)
        for group in prefill_groups([states[b].slot for b in order], [len(chunks[b]) for b in order],
                                    PREFILL_TOKENS_PER_FORWARD * chunk):
            members = [order[i] for i in group]
            feed([states[b] for b in members], [chunks[b] for b in members])
            for b in members:
                fed[b] += len(chunks[b])
    for leader, follower, head in copies:
        copy_slot(states[leader].slot, states[follower].slot, len(states[leader].tokens))
        states[follower].tokens.extend(head)
