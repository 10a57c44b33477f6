"""Token trees: several draft continuations of one row, verified in one target pass, accepted exactly.

A `DraftTree` is what travels and what the target scores: node 0 is the root (the row's last committed token, fed
first), nodes 1..N are drafts, each with a parent of smaller index (so the nodes are in topological order and a path
read by ascending index is in depth order). The target writes node i's keys and values at the row's step position i
and rotates it at its depth; node i attends to the committed tokens and its own ancestors (tree attention:
SpecInfer, Miao et al. 2024, arXiv 2305.09781, section 4; Medusa's tree mask, arXiv 2401.10774).

Acceptance (`walk`) follows the target's own choice down the tree: at each node the token the target emits there
(greedy: its argmax; seeded: its Gumbel-coupled sample at the node's absolute position; unseeded: its inverse-CDF
draw from the counter uniform of that position, engine/spec/randomness.py), then the child holding that token, until a
node has none; the last choice is the recovered (or bonus) token. Every emitted token is the target's draw from its
own distribution given the tokens before it, with the randomness plain decoding would use at that position, so
the text is the same as plain decoding's for greedy, seeded and unseeded rows alike, whatever the tree: the tree
only decides how many of the target's draws one pass yields. For drafts that are not sampled (a tree's nodes are
the drafter's top candidates, not draws) this is SpecInfer's multi-step speculative sampling with one-hot proposals
(its Theorem 4.2): each candidate child is accepted with the probability the target gives it, the residual draw
excludes the rejected ones.

Trees are built from a pool of scored candidates (`best_tree`): EAGLE-2's reranking (Li et al. 2024,
arXiv 2406.16858, section 4.2), the best N nodes by path score (the product of the drafter's probabilities along
the path), which keeps the tree closed under parents because a child's score never exceeds its parent's.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

MAX_TREE_NODES = 15  # draft nodes a row's tree may hold: with its root, the runner's widest step (MAX_WIDTH = 16)


@dataclass(frozen=True)
class DraftTree:
    """One row's drafts as a tree: draft node i (1..N) holds tokens[i - 1] and hangs under parents[i - 1] (0: the
    root, the row's last committed token). Siblings hold different tokens."""

    tokens: tuple[int, ...]  # N draft tokens
    parents: tuple[int, ...]  # N parents, parents[i - 1] < i

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents), start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} is not an earlier node")
            if (parent, token) in seen:
                raise ValueError(f"node {parent} has two children holding token {token}")
            seen.add((parent, token))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(int(t) for t in tokens), tuple(range(len(tokens))))

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], budget: int = MAX_TREE_NODES) -> DraftTree:
        """The paths merged on their common prefixes (n-gram matches), first paths first, at most `budget` nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for token in path:
                nxt = child.get((node, int(token)))
                if nxt is None:
                    if len(tokens) >= budget:
                        break
                    tokens.append(int(token))
                    parents.append(node)
                    nxt = child[(node, int(token))] = len(tokens)
                node = nxt
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:  # draft nodes
        return len(self.tokens)

    @property
    def width(self) -> int:  # scored positions: the root and the drafts
        return len(self.tokens) + 1

    @cached_property
    def depths(self) -> tuple[int, ...]:  # [N + 1]: the root's 0, each draft's its parent's + 1
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:  # the longest path's drafts
        return max(self.depths)

    @cached_property
    def ancestors(self) -> tuple[int, ...]:  # [N + 1] bitmasks: bit j of node i's set iff j is i or an ancestor
        masks = [1]
        for i, parent in enumerate(self.parents, start=1):
            masks.append(masks[parent] | (1 << i))
        return tuple(masks)

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == i for i, parent in enumerate(self.parents))

    @cached_property
    def _children(self) -> dict[tuple[int, int], int]:  # (node, token) -> child
        return {(parent, token): i for i, (token, parent) in enumerate(zip(self.tokens, self.parents), start=1)}

    def child(self, node: int, token: int) -> int | None:
        return self._children.get((node, int(token)))

    def path(self, node: int) -> list[int]:
        """The draft nodes from the root's child down to `node` (empty for the root)."""
        out = []
        while node:
            out.append(node)
            node = self.parents[node - 1]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i - 1] for i in self.path(node)]

    def pruned(self, budget: int) -> DraftTree:
        """The first `budget` draft nodes (closed under parents: a parent precedes its children)."""
        return self if budget >= len(self) else DraftTree(self.tokens[:budget], self.parents[:budget])

    def wire(self) -> tuple[list[int], list[int]]:
        """The compact form that travels: tokens and parents."""
        return list(self.tokens), list(self.parents)


@dataclass(frozen=True)
class Walk:
    """A row's verdict down its tree."""

    tokens: list[int]  # the accepted drafts' tokens, then the target's recovered or bonus token
    path: list[int]  # the accepted draft nodes, root's child first

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def walk(tree: DraftTree, choices: Sequence[int]) -> Walk:
    """Follow the target's choices (choices[i]: the token the target emits after node i's path, [N + 1]) from the
    root while a child holds the chosen token."""
    assert len(choices) == tree.width, "one choice per node"
    node, tokens, path = 0, [], []
    while True:
        token = int(choices[node])
        tokens.append(token)
        nxt = tree.child(node, token)
        if nxt is None:
            return Walk(tokens, path)
        path.append(nxt)
        node = nxt


@dataclass(frozen=True)
class Candidate:
    """A node of a drafter's candidate pool: `parent` indexes the pool (-1: the root)."""

    token: int
    parent: int
    score: float  # the path's probability under the drafter (its product down from the root)


def best_tree(pool: Sequence[Candidate], budget: int) -> tuple[DraftTree, list[int]]:
    """EAGLE-2's reranking: the `budget` best candidates by path score (ties: the shallower, then the earlier), as a
    tree in topological order, with each tree node's pool index. A candidate is kept only with its parent."""
    depth = []
    for c in pool:
        depth.append(0 if c.parent < 0 else depth[c.parent] + 1)
    order = sorted(range(len(pool)), key=lambda i: (-pool[i].score, depth[i], i))
    kept: set[int] = set()
    for i in order:
        if len(kept) >= budget:
            break
        if pool[i].parent < 0 or pool[i].parent in kept:
            kept.add(i)
    chosen = sorted(kept, key=lambda i: (depth[i], i))  # parents first
    index = {p: n for n, p in enumerate(chosen, start=1)}
    tokens = tuple(pool[i].token for i in chosen)
    parents = tuple(0 if pool[i].parent < 0 else index[pool[i].parent] for i in chosen)
    return DraftTree(tokens, parents), chosen


TOP_CANDIDATES = 4  # candidates per draft step a tree takes (SGLang's EAGLE-2 default top-k for Llama)


def chain_with_siblings(steps: Sequence[Sequence[tuple[int, float]]], budget: int) -> DraftTree:
    """A drafter's chain (the top candidate of every step) and, hanging beside each chain node, the step's next best
    candidates, reranked to the `budget` best by path score (`best_tree`). `steps[d]`: step d's candidates, best first,
    as (token, the drafter's probability after the chain's first d tokens). What a drafter that runs one state per
    step (a draft model, an EAGLE-3 head, the target's first layers) offers without tree attention of its own."""
    pool: list[Candidate] = []
    parent, score = -1, 1.0
    for candidates in steps:
        if not candidates:
            break
        head = len(pool)
        for token, prob in candidates:
            pool.append(Candidate(int(token), parent, score * float(prob)))
        parent, score = head, pool[head].score
    return best_tree(pool, budget)[0] if pool else DraftTree((), ())


def independent_heads(steps: Sequence[Sequence[tuple[int, float]]], budget: int) -> DraftTree:
    """Medusa's tree: head d proposes the token d + 1 places ahead whatever comes before it, so every path through
    the heads' top candidates is a candidate, scored by the product of its heads' probabilities; the `budget` best,
    expanded best first (a child's score never exceeds its parent's, so the result is closed under parents)."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(-float(p), 0, 0, 0, i) for i, (_, p) in enumerate(steps[0])] if steps else []
    heapq.heapify(frontier)
    while frontier and len(tokens) < budget:
        neg, _, parent, depth, i = heapq.heappop(frontier)
        tokens.append(int(steps[depth][i][0]))
        parents.append(parent)
        node = len(tokens)
        if depth + 1 < len(steps):
            for j, (_, p) in enumerate(steps[depth + 1]):
                heapq.heappush(frontier, (neg * float(p), node, node, depth + 1, j))
    return DraftTree(tuple(tokens), tuple(parents))


def top_candidates(probs, count: int = TOP_CANDIDATES) -> list[list[tuple[int, float]]]:
    """A draft step's best `count` candidates per row, best first: probs [R, V] (a torch tensor) -> R lists."""
    values, ids = probs.topk(min(count, probs.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
