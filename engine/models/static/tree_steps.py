"""Token-tree steps of the static runner (the trees of engine/spec/tree.py): each row's depths and ancestor bitmasks
over a step's tokens (what the attention kernels and RoPE read: engine/models/static/attention.py,
engine/models/cpu/csrc/layer_ops.cpp), and, after the accept step, the accepted path's keys and values moved into
place."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.models.runner import SeqSlot
from engine.models.static.cuda_graphs import chain_ancestors, chain_depths

Shape = tuple[list[int], list[int]]  # a row's depths and ancestor bitmasks over its step tokens


def tree_shape(tree, tail: int) -> Shape:
    """A row's depths and ancestor bitmasks over its `tail` step tokens, whose last tree.width are the tree's nodes
    (the tokens before them, already committed, form a chain every node sees)."""
    lead = tail - tree.width
    assert lead >= 0, "a tree's nodes are the row's last fed tokens"
    depths = chain_depths(lead) + [lead + d for d in tree.depths]
    ancestors = chain_ancestors(lead) + [((1 << lead) - 1) | (m << lead) for m in tree.ancestors]
    return depths, ancestors


def row_shapes(trees: Sequence | None, tails: Sequence[Sequence[int]]) -> list[Shape | None] | None:
    """Each row's shape over its step tokens `tails` (None: a chain), or None when no row has a tree."""
    if trees is None or all(tree is None for tree in trees):
        return None
    return [None if tree is None else tree_shape(tree, len(tail)) for tree, tail in zip(trees, tails)]


def step_masks(rows: int, width: int, placed: Iterable[tuple[int, Shape]]
               ) -> dict[str, torch.Tensor]:  # "depths", "ancestors": [rows, width] int64
    """An eager tree step's depths and ancestor bitmasks (StaticLlama.forward's keyword arguments): each placed row
    (step row, its shape) its own, every other row (chains, padding) the chain's."""
    depths = torch.tensor(chain_depths(width)).repeat(rows, 1)
    ancestors = torch.tensor(chain_ancestors(width)).repeat(rows, 1)
    for r, (row_depths, row_ancestors) in placed:
        depths[r, : len(row_depths)] = torch.tensor(row_depths)
        ancestors[r, : len(row_ancestors)] = torch.tensor(row_ancestors)
    return {"depths": depths, "ancestors": ancestors}


def graph_masks(shapes: Sequence[Shape | None] | None) -> dict:
    """A graph step's keyword arguments for its rows' shapes (GraphSteps.step: None rows get the chain's)."""
    if shapes is None:
        return {}
    return {"depths": [None if s is None else s[0] for s in shapes],
            "ancestors": [None if s is None else s[1] for s in shapes]}


def keep_path(model, pass_states, state: SeqSlot, width: int, path: Sequence[int]) -> None:
    """After a tree step whose last `width` tokens were a tree's nodes: keep the root and the accepted draft nodes
    `path` (root's child first), their keys and values moved to the positions after the root (model.move_positions)
    and their kept states with them (pass_states.keep_path); the other nodes are dropped."""
    root = len(state.tokens) - width
    assert root >= 0 and all(0 < i < width for i in path)
    src = [root + i for i in path]
    dst = list(range(root + 1, root + 1 + len(path)))
    if src != dst:
        model.move_positions(state.slot, src, dst)
    kept = [state.tokens[i] for i in src]
    del state.tokens[root + 1:]
    state.tokens.extend(kept)
    pass_states.keep_path(state.seq_id, root, path)
