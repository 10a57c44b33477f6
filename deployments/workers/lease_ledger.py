"""A replica's record of the sequences leased to it, and the sweep of sequences that outlive their leases.

Closing a lease releases its sequence on the replica's workers (workers/replicas.py: _LeasedReplica._hold). Should a
worker hold a sequence after that anyway (the README's "Limits" describe such a leak, seen in the autoscaling
test, whose cause is not found yet: a call arriving after the release, or a release that never arrived), its KV
cache slot would stay taken for good. So the replica remembers the sequences it released for a while, and at each
health check asks its workers to release those of them they still hold, if no call has touched them for
STALE_AFTER_S (workers' `release_stale`). A sequence leased to the replica now is never a candidate: a request that
re-leases the same replica under the same id (a draft lease taken again) keeps its sequence.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict

# A released sequence is looked for this long after its release, and at most this many are remembered.
REMEMBER_S = 300.0
REMEMBER_MAX = 4096
# A worker releases a candidate only if no call has touched it for this long (a live sequence is called every round).
STALE_AFTER_S = 5.0


class LeaseLedger:
    """Sequences leased to one replica now, and those released in the last REMEMBER_S."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.held: Counter[str] = Counter()
        self._released: OrderedDict[str, float] = OrderedDict()  # seq -> when its last lease ended, oldest first
        self.swept = 0  # sequences workers still held after their leases ended, released by the sweep

    def leased(self, seq_id: str) -> None:
        self.held[seq_id] += 1
        self._released.pop(seq_id, None)

    def ended(self, seq_id: str) -> None:
        self.held[seq_id] -= 1
        if self.held[seq_id] <= 0:
            del self.held[seq_id]
            self._released[seq_id] = self._clock()
            self._released.move_to_end(seq_id)
            while len(self._released) > REMEMBER_MAX:
                self._released.popitem(last=False)

    def candidates(self) -> list[str]:
        """Released sequences to look for on the workers (none held now); forgets those past REMEMBER_S."""
        now = self._clock()
        while self._released and now - next(iter(self._released.values())) > REMEMBER_S:
            self._released.popitem(last=False)
        return [seq_id for seq_id in self._released if seq_id not in self.held]
