"""N-gram prompt lookup: drafts copied from earlier in the sequence, no model at all.

Saxena 2023, "Prompt Lookup Decoding" (the method behind HF's `prompt_lookup_num_tokens` and vLLM's `ngram`
speculator).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from engine.proposers.base import DraftRequest, Proposal
from engine.spec.tree import DraftTree

MAX_MATCHES = 4  # continuations a lookup tree merges


class NgramProposer:
    """Prompt lookup: find the last `n` tokens earlier in the sequence and propose what followed them.

    Tries n = max_n down to min_n and takes the most recent earlier match. Stateless, so nothing to release.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def continuations(self, tokens: Sequence[int], k: int) -> Iterator[list[int]]:
        """What followed each earlier occurrence of the sequence's last n tokens (at most k tokens each), n = max_n
        down to min_n, the most recent occurrence first, computed as they are asked for."""
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n :]
            # windows starting at 0 .. length-n-1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            for hit in np.flatnonzero((windows == suffix).all(axis=1))[::-1]:
                yield arr[int(hit) + n : int(hit) + n + k].tolist()

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        return next(self.continuations(tokens, k), [])

    def lookup_tree(self, tokens: Sequence[int], k: int, budget: int, matches: int = MAX_MATCHES) -> DraftTree:
        """Several matches as a tree: the first `matches` distinct `continuations`, merged on their common prefixes,
        at most `budget` nodes (SpecInfer's token trees from several speculators, here several lookups)."""
        paths: list[list[int]] = []
        for path in self.continuations(tokens, k):
            if path and path not in paths:
                paths.append(path)
                if len(paths) >= matches:
                    break
        return DraftTree.from_paths(paths, budget)

    def propose(self, requests: Sequence[DraftRequest], stop: Callable[[], bool] | None = None) -> Proposal:
        batch, k_max = len(requests), max(r.k for r in requests)
        token_ids = torch.full((batch, k_max), -1, dtype=torch.long)
        num = torch.zeros(batch, dtype=torch.long)
        trees: list[DraftTree | None] = [None] * batch
        for b, r in enumerate(requests):
            if r.tree:
                tree = self.lookup_tree(r.tokens, r.k, r.tree)
                trees[b] = tree if len(tree) else None
                continue
            found = self.lookup(r.tokens, r.k)
            if found:
                token_ids[b, : len(found)] = torch.tensor(found)
                num[b] = len(found)
        return Proposal(token_ids=token_ids, num_tokens=num, trees=trees if any(trees) else None)

    def release(self, seq_id: str) -> None:
        return None
