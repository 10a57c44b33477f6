"""Per-row, per-position logits processing: the step between a model's logits and `sampling.logits_to_probs`.

Speculative sampling is exact only if every modification of the target distribution is applied to the draft's
distribution too, and each at the position it belongs to (Chen et al. 2023, arXiv 2302.01318, Sec. 2.3). A
processor that reads the token history (penalties, min_tokens, a grammar) must therefore see, at every scored
position, the history plain decoding would have had there: the committed tokens plus the drafts before that
position. At verify position j of a round that is committed + drafts[:j]; at the draft model's step j it is the
same (the tokens it drafted so far). Whatever a processor answers for a position after a draft it made impossible
(logit -inf) is never used: that draft is rejected by every scheme (greedy argmax, Gumbel coupling, the ratio test),
so the round emits at or before it.

The seam, for whoever adds a processor (structured outputs' grammar mask, say):
- a `LogitsProcessor` is a callable `(logits [T, V] float32, context: RowContext) -> logits [T, V]` (it may write
  in place): row t of `logits` scores the token after `context.history(t)`. It is per sequence (it may hold
  state, e.g. a grammar matcher advanced over the committed tokens; the drafts are speculative: a processor must
  not commit them, it reads them to compute the later positions and forgets them);
- a processor class may also have a static `apply_batch(logits [B, T, V], items: Sequence[BatchItem])` that
  processes several rows in place at once (each item: the row, its real positions, its context, its processor);
  `process_logits` then calls it once for the rows that have that class at the same place of their tuples, else
  calls each row's processor (`apply_one` turns an `apply_batch` into a `__call__`);
- a row's processors are a tuple in a `RowProcessing`, applied in order; `process_logits` applies every row's to a
  batch of logits: from `engine.spec.accept.verify_rows` (the target, every scored position of the round) and
  `engine.proposers.draft_model.DraftModelProposer.propose` (each draft step), before argmax / `logits_to_probs`. Put
  the built-ins first (SequenceState and the workers do) and new processors after them; a -inf mask commutes with them
  anyway (-inf stays -inf under a bias or a penalty);
- the built-in processors, vLLM's request parameters, are engine/request/builtin_processors.py; a sequence's
  processors are built once from its settings (engine/request/settings.SequenceSettings): the router's and the
  in-process engine's on `SequenceState.processors`, a worker's (and the in-process target's) in its per-sequence
  store (engine/request/delta.KnownSequences), from the settings the sequence's first delta carried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RowContext:
    """What a processor may read of one row: the token history of each scored position."""

    tokens: Sequence[int]  # the committed tokens: the prompt, then the output so far
    prompt_len: int  # how many of `tokens` are the prompt (more than len(tokens) while a long prompt is read)
    drafts: Sequence[int] = ()  # this round's speculative tokens after `tokens`
    first: int = 0  # logits row t scores the token after tokens + drafts[:first + t]

    @property
    def num_output(self) -> int:
        """Committed output tokens."""
        return max(0, len(self.tokens) - self.prompt_len)

    def outputs_before(self, t: int) -> int:
        """Output tokens before scored position t (committed and speculative)."""
        return self.num_output + self.first + t

    def speculative(self, t: int) -> Sequence[int]:
        """The speculative tokens before scored position t."""
        return self.drafts[: self.first + t]

    def history(self, t: int) -> list[int]:
        """Every token before scored position t (a convenience: copies the history)."""
        return list(self.tokens) + list(self.speculative(t))


class LogitsProcessor(Protocol):
    def __call__(
        self,
        logits: torch.Tensor,  # [T, V] float32: one row's logits at its T scored positions
        context: RowContext,
    ) -> torch.Tensor:  # [T, V] (may be `logits` itself, written in place)
        ...


@dataclass(frozen=True)
class BatchItem:
    """One row's share of a batched processor call (`apply_batch`)."""

    row: int  # the row of the [B, T, V] logits
    width: int  # its real scored positions: 0 .. width-1
    context: RowContext
    processor: LogitsProcessor


def apply_one(processor, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
    """`__call__` for a processor class that only writes `apply_batch`: the row as a batch of one."""
    type(processor).apply_batch(logits[None], [BatchItem(0, logits.shape[0], context, processor)])
    return logits


@dataclass(frozen=True)
class RowProcessing:
    """One row's logits processors and the committed tokens they read."""

    processors: tuple[LogitsProcessor, ...]
    tokens: Sequence[int]  # the committed tokens: the prompt, then the output so far
    prompt_len: int

    def context(self, drafts: Sequence[int] = (), first: int = 0) -> RowContext:
        return RowContext(self.tokens, self.prompt_len, drafts, first)


def process_logits(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    rows: Sequence[RowProcessing | None],  # B rows; None (or no processors): the row passes unchanged
    drafts: Sequence[Sequence[int]],  # B rows: each row's speculative tokens after its committed ones
    first: Sequence[int] | None = None,  # B rows: position 0 scores the token after drafts[:first[b]]; None: 0s
) -> torch.Tensor:  # [B, T, V]: `logits` itself when no row has a processor, else a float32 copy
    """Every row's processors, in its order, over its real scored positions, len(drafts[b]) - first[b] + 1 of them
    (the target: each draft's position and the bonus one; a draft step: its one position). What a row's padding
    positions (a batch with uneven K) hold afterwards is unspecified: nothing reads them.

    Batched where cheap: the rows' i-th processors are applied together, one `apply_batch(logits, items)` call per
    class that has one (the built-ins do: the rows' penalties are one gather and scatter), else one call per row.
    Rows whose tuples line up (the built-ins come in one order, engine/request/builtin_processors.py) share every call.
    """
    assert logits.dim() == 3 and logits.shape[0] == len(rows) == len(drafts), "logits must be [B, T, V], B rows"
    busy = [b for b, row in enumerate(rows) if row is not None and row.processors]
    if not busy:
        return logits
    out = logits.float().clone()
    items: dict[int, tuple[int, RowContext]] = {}  # row -> (width, context)
    for b in busy:
        start = 0 if first is None else first[b]
        width = min(out.shape[1], len(drafts[b]) - start + 1)
        assert width >= 1, "a row scores at least one position"
        items[b] = (width, rows[b].context(drafts[b], start))
    for stage in range(max(len(rows[b].processors) for b in busy)):
        by_class: dict[type, list[BatchItem]] = {}
        for b in busy:
            if stage < len(rows[b].processors):
                processor = rows[b].processors[stage]
                by_class.setdefault(type(processor), []).append(BatchItem(b, *items[b], processor))
        for kind, members in by_class.items():
            if hasattr(kind, "apply_batch"):
                kind.apply_batch(out, members)
                continue
            for item in members:
                out[item.row, : item.width] = item.processor(out[item.row, : item.width], item.context)
    return out
