"""How many draft tokens a round uses under load.

Verifying K drafts for B sequences is a (B*(K+1))-row forward pass. At batch 1 that costs little more than one
decode step (memory-bound), so speculation pays; as B grows the pass becomes compute-bound and the drafts stop
being free (measured here: at 8 sequences, K=3 speculation gave ~48 tok/s against ~67 tok/s for plain batched
decoding). Above `max_batch` live sequences the round drafts nothing, so throughput under load is plain
decoding's. (A calibrated, per-machine curve replaces the fixed threshold later.)
"""

from __future__ import annotations


def load_adjusted_k(k: int, num_live: int, max_batch: int | None) -> int:
    if max_batch is not None and num_live > max_batch:
        return 0
    return k
