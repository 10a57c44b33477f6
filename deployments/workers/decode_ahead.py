"""Decoding ahead: a target worker decodes the next token of plain rows while the router handles this round's reply.

A plain round (no drafts) for row b ends with the token t the target sampled; the router's next round for b sends
exactly t back (b's committed tokens plus t) and asks for the token after it. Everything that round needs is on
the target already, so the target need not wait: right after replying it runs that step itself (`DecodeAhead.plan`
queues it behind the reply on the model thread), and when the router's call arrives with what was guessed, the row's
verdict is already there. The router's hop (its reply handling, the next round's planning, the channel's two
messages) then overlaps the device's step instead of adding to it: on a GPU, where a step takes a few milliseconds,
that hop is a large share of a round. This is the host/device overlap of vLLM's asynchronous scheduling, where the
next step's inputs are prepared before the current step's tokens reach the host.

Exactness: the step made ahead is the step the call would have made: the same committed tokens, the same sampling
settings (the sequence's, kept since its first call), and a sampling scheme numbered by the row's absolute position
(engine/spec/randomness.py), so a seeded row draws the same token; an unseeded row draws a fresh one either way. A call that differs in any way (the row now
drafts, its request ended, another call came first) finds no match: the entry is dropped and the row is computed
as before (its KV cache rolls back the guessed token on sync, as after a rejected draft).

Only rows the router marks (`VerifyCall.ahead`: a row that will not draft next round and has no grammar or prompt
logprobs to score) are decoded ahead, and only when every row of the call is marked, so a round is never split into
two forwards. Every rank of a tensor-parallel target runs the step (rank 0 forwards it, in order) and keeps the same
entries, so all ranks agree on which rows a later call takes from them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from deployments.transport.messages import VerifyCall, VerifyResult
from engine.request.delta import SeqDelta


@dataclass(frozen=True)
class AheadRow:
    """A row decoded ahead: the delta it assumed and what it gave (rank 0's verdict; None on the other ranks)."""

    start: int
    tokens: tuple[int, ...]
    verdict: object  # engine.spec.accept.Verdict | None
    batch: int  # which ahead step computed it (its seconds are counted once per step)
    seconds: float  # that step's compute


@dataclass
class AheadStats:
    steps: int = 0  # ahead steps run
    rows: int = 0  # rows decoded ahead
    used: int = 0  # of those, rows a call took
    dropped: int = 0  # rows whose call differed (or never came)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "used": self.used, "dropped": self.dropped}


def next_calls(calls: list[VerifyCall], result: VerifyResult) -> list[VerifyCall] | None:
    """The calls of the round after `calls` if every row's guess holds (each row sends the tokens it was given),
    or None when the round is not one to decode ahead: a row unmarked, failed, or scoring prompt tokens."""
    if not calls or not all(call.ahead and not call.draft for call in calls):
        return None
    if result.failed or result.prompt_logprobs or any(v is None for v in result.verdicts):
        return None
    return [VerifyCall(SeqDelta(call.seq.seq_id, call.seq.start + len(call.seq.tokens), list(verdict.tokens)), [],
                       None, True)
            for call, verdict in zip(calls, result.verdicts)]


@dataclass
class DecodeAhead:
    """A target worker's rows decoded ahead, by sequence id."""

    rows: dict[str, AheadRow] = field(default_factory=dict)
    stats: AheadStats = field(default_factory=AheadStats)
    _batches: itertools.count = field(default_factory=itertools.count)

    def current(self, calls: list[VerifyCall], known: dict[str, list[int]]) -> list[VerifyCall]:
        """Those of an ahead step's `calls` whose sequences are still where the step assumed (none was released
        or moved on by another call meanwhile)."""
        return [call for call in calls if len(known.get(call.seq.seq_id, ())) == call.seq.start]

    def keep(self, calls: list[VerifyCall], result: VerifyResult | None, seconds: float) -> None:
        """An ahead step's rows (`result` None on ranks other than 0)."""
        batch = next(self._batches)
        self.stats.steps += 1
        self.stats.rows += len(calls)
        for b, call in enumerate(calls):
            verdict = None if result is None else result.verdicts[b]
            self.rows[call.seq.seq_id] = AheadRow(call.seq.start, tuple(call.seq.tokens), verdict, batch, seconds)

    def take(self, calls: list[VerifyCall]) -> dict[int, AheadRow]:
        """The rows of `calls` (by index) decoded ahead exactly as asked; every other entry of theirs is dropped."""
        served = {}
        for b, call in enumerate(calls):
            row = self.rows.pop(call.seq.seq_id, None)
            if row is None:
                continue
            # a sequence's settings are fixed for its life (sent once); a call that re-sends them starts it afresh
            if (not call.draft and not call.target_k and call.seq.settings is None and call.seq.start == row.start
                    and tuple(call.seq.tokens) == row.tokens):
                served[b] = row
            else:
                self.stats.dropped += 1
        self.stats.used += len(served)
        return served

    def forget(self, seq_id: str) -> None:
        if self.rows.pop(seq_id, None) is not None:
            self.stats.dropped += 1


def merged(calls: int, served: dict[int, AheadRow], rest: list[int], computed: VerifyResult | None,
           rank: int) -> VerifyResult | None:
    """One call's result from its rows decoded ahead and those it computed (`computed`, for the `rest` rows in
    order; None when there were none). Its seconds: each ahead step's compute once, plus the call's own; the
    ahead rows are counted in `ahead_rows` (the router keeps such rounds out of its cost observations)."""
    if rank != 0:
        return None
    verdicts = [None] * calls
    for b, row in served.items():
        verdicts[b] = row.verdict
    seconds = sum({row.batch: row.seconds for row in served.values()}.values())
    if computed is None:
        return VerifyResult(verdicts, seconds, ahead_rows=len(served))
    for i, b in enumerate(rest):
        verdicts[b] = computed.verdicts[i]
    return VerifyResult(verdicts, seconds + computed.seconds,
                        prompt_logprobs={rest[i]: run for i, run in computed.prompt_logprobs.items()},
                        failed={rest[i]: f for i, f in computed.failed.items()},
                        cached_tokens={rest[i]: n for i, n in computed.cached_tokens.items()}, ahead_rows=len(served),
                        target_drafts={rest[i]: d for i, d in computed.target_drafts.items()},
                        target_draft_seconds=computed.target_draft_seconds)
