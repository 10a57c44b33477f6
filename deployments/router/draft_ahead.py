"""Overlapped drafting: the draft worker drafts round r+1 while the target verifies round r.

The ahead draft starts from the committed tokens plus round r's drafts, i.e. it assumes they are all accepted, and
is one token longer than K: its first token is the guess for round r's bonus token. When round r accepts every
draft and its bonus token equals the guess, the rest is round r+1's draft and round r+1 skips its draft call;
otherwise it is discarded (cancelled as soon as a rejection makes it hopeless) and the draft worker's cache
rolls back on its next call. The ahead draft never changes what round r emits, and when it is used it is a draft
from the draft model for exactly the committed prefix, with the compact proposal it was drawn from: the rejection
sampler's guarantee (output distributed as the target's) holds unchanged. The draft worker numbers its random draws
by absolute position, so a draft made ahead is the draft a draft call would have made (seeded rows: the same
tokens; their output never depends on the drafts anyway).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from deployments.errors import ReplicaGone
from deployments.transport.messages import DraftCall, head

logger = logging.getLogger("ray.serve")


@dataclass
class AheadDraft:
    lease: object  # the draft lease drafting ahead (live.DraftLease)
    ahead_id: int
    members: list[int]  # the round's rows it drafts for
    task: asyncio.Future  # the lease's propose call


class AheadDrafts:
    """Starts a round's ahead drafts and settles them once the round's acceptance is known.

    Rows are the scheduler's live sequences: `overlap`, `draft` (lease), `seq`, `draft_delta(extra)`, and `ready`,
    where a usable ahead draft is left as (tokens, its compact proposal or None), the proposal unread.
    """

    def __init__(self, stats, replace_drafts: Callable[[list], Awaitable[None]]) -> None:
        self.stats = stats  # scheduler.SchedulerStats: ahead_drafts, ahead_cancelled
        self._replace_drafts = replace_drafts  # new draft leases for rows whose draft worker died
        self._ids = itertools.count()

    def start(self, rows: list, drafts: list[list[int]]) -> list[AheadDraft]:
        """Draft the next round now, for rows whose round may accept everything: one call per draft lease."""
        by_lease: dict[str, list[int]] = {}
        for b, live in enumerate(rows):
            # a row that ends this round even if all is accepted needs no next round
            if (live.overlap and drafts[b] and live.draft is not None
                    and live.seq.remaining() > len(drafts[b]) + 1):
                by_lease.setdefault(live.draft.key, []).append(b)
        aheads = []
        for members in by_lease.values():
            lease, ahead_id = rows[members[0]].draft, next(self._ids)
            calls = [DraftCall(rows[b].draft_delta(drafts[b]), len(drafts[b]) + 1) for b in members]
            self.stats.ahead_drafts += len(members)
            aheads.append(AheadDraft(lease, ahead_id, members, asyncio.ensure_future(lease.propose(calls, ahead_id))))
        return aheads

    async def settle(self, aheads: list[AheadDraft], rows: list, drafts: list[list[int]],
                     accepted: list[int] | None, finished: list[bool] | None) -> None:
        """Keep the ahead drafts whose guess came true as the rows' next drafts; stop hopeless ones early.

        `accepted` and `finished` are None when the round failed: every ahead draft is then hopeless.
        """
        def usable(b: int) -> bool:  # all drafts accepted, so the last committed token is the bonus token
            return accepted is not None and not finished[b] and accepted[b] == len(drafts[b]) > 0

        for ahead in aheads:
            if not any(usable(b) for b in ahead.members) and not ahead.task.done():
                ahead.lease.cancel(ahead.ahead_id)
            try:
                result = await ahead.task
            except ReplicaGone:
                if accepted is not None:
                    await self._replace_drafts([rows[b] for b in ahead.members])
                continue
            except Exception as exc:
                # an ahead draft is optional: its rows draft normally next round. (One for a request that ended
                # this round can race the lease's release of its draft caches and find the sequence gone.)
                if accepted is not None:
                    logger.warning("an ahead draft failed and was discarded: %r", exc)
                continue
            if result.cancelled:
                self.stats.ahead_cancelled += 1
                continue
            for i, b in enumerate(ahead.members):
                guess = result.drafts[i]
                if usable(b) and guess and rows[b].seq.text.token_ids[-1] == guess[0]:
                    rows[b].ready = (guess[1:], head(result.proposals.get(i), 1))
