"""What the static runner's forwards leave for a draft source inside the target (engine/spec/target_drafts.py): the
final hidden states where a step's logits are taken (Medusa heads: `keep_hidden`), and the states entering chosen
layers at every position a forward computes, prompt chunks included (EAGLE-3 heads: `keep_aux`).

Aux states are kept per sequence in the order they were computed, each piece with its first position, until the
drafter takes them (`take_aux`); a later piece at the same positions (a verify window rewritten after rejected
drafts) supersedes an earlier one. A sequence keeps at most `max_aux_positions` positions (the oldest go): a row whose
drafts stay off for long (the round plan under load) would otherwise hold a state per token; positions that went
leave the head's cache as it was, which costs acceptance, never a different output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from engine.models.static.steps import pick_logits


class PassStates:
    def __init__(self, model, max_rows: int, max_width: int, max_aux_positions: int = 4096) -> None:
        self.model = model  # StaticLlama
        self.max_rows, self.max_width = max_rows, max_width
        self.max_aux_positions = max_aux_positions
        # with `keep_hidden`: the last forward's final hidden states where its logits were taken, [B, max(n), H]
        self.last_hidden: torch.Tensor | None = None
        self.aux: dict[str, deque[tuple[int, torch.Tensor]]] | None = None  # with `keep_aux`: seq -> pieces
        self._positions: dict[str, int] = {}  # positions held per sequence (the pieces' total length)

    def keep_hidden(self) -> None:
        self.model.keep_hidden(self.max_rows, self.max_width)

    def keep_aux(self, layers: Sequence[int]) -> None:
        self.model.keep_aux(layers, self.max_rows, self.max_width)
        self.aux = {}

    def after_step(self, seq_ids: Sequence[str], starts: Sequence[int], rows: Sequence[int], tails: list[list[int]],
                   num_logits: Sequence[int], width: int, graph: bool) -> None:
        """After a batched step: row b (step row rows[b]) fed tails[b] from position starts[b]."""
        kept = getattr(self.model, "hidden_out", None)
        if kept is not None:
            self.last_hidden = pick_logits(kept[:max(rows) + 1, :width], rows, [len(t) for t in tails], num_logits)
        if self.aux is not None:
            states = self.model.aux_out if graph else self.model.aux_last
            for seq_id, start, row, tail in zip(seq_ids, starts, rows, tails):
                self._record(seq_id, start, states[row, :len(tail)])

    def after_chunk(self, seq_ids: Sequence[str], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """After a prompt chunk (or a one-row eager forward): row r fed lengths[r] tokens from starts[r]."""
        if self.aux is not None:
            for row, (seq_id, start, length) in enumerate(zip(seq_ids, starts, lengths)):
                self._record(seq_id, start, self.model.aux_last[row, :length])

    def _record(self, seq_id: str, start: int, states: torch.Tensor) -> None:  # states [n, A]
        pieces = self.aux.setdefault(seq_id, deque())
        pieces.append((start, states.clone()))
        held = self._positions.get(seq_id, 0) + len(states)
        while held > self.max_aux_positions and len(pieces) > 1:
            held -= len(pieces.popleft()[1])
        self._positions[seq_id] = held

    def keep_path(self, seq_id: str, root: int, path: Sequence[int]) -> None:
        """After a tree step (engine/models/static/runner.keep_path): the latest piece's states at the root and the
        accepted nodes `path` (offsets from the root) become the positions after the root; the other nodes' go."""
        pieces = self.aux.get(seq_id) if self.aux is not None else None
        if not pieces:
            return
        start, states = pieces[-1]
        if not start <= root < start + len(states):
            return
        at = root - start
        index = torch.tensor([*range(at + 1), *(at + i for i in path)], device=states.device)
        pieces[-1] = (start, states[index])
        self._positions[seq_id] -= len(states) - len(index)

    def take_aux(self, seq_id: str, end: int) -> list[tuple[int, torch.Tensor]]:
        """The sequence's aux states at positions below `end`, as (first position, states [n, A]) runs in position
        order, each position's latest; nothing is kept after (positions from `end` on are a rejected window's)."""
        pieces = self.aux.pop(seq_id, ()) if self.aux is not None else ()
        self._positions.pop(seq_id, None)
        pieces = [(start, states[:end - start]) for start, states in pieces if start < end]
        if not pieces:
            return []
        first = min(start for start, _ in pieces)
        merged = pieces[0][1].new_empty(end - first, pieces[0][1].shape[1])
        held = torch.zeros(end - first, dtype=torch.bool)
        for start, states in pieces:  # in the order computed: a later piece overwrites an earlier one
            merged[start - first:start - first + len(states)] = states
            held[start - first:start - first + len(states)] = True
        at = held.nonzero().squeeze(1)  # held offsets, ascending; a gap (no state) splits the runs
        breaks = ((at[1:] - at[:-1]) > 1).nonzero().squeeze(1).tolist()
        bounds = zip([0] + [b + 1 for b in breaks], breaks + [len(at) - 1])
        return [(first + int(at[a]), merged[int(at[a]):int(at[b]) + 1]) for a, b in bounds]

    def forget(self, seq_id: str) -> None:
        if self.aux is not None:
            self.aux.pop(seq_id, None)
            self._positions.pop(seq_id, None)
