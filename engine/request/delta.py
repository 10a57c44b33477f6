"""A sequence as a model's side learns it, call by call: the delta one call carries, and the store that keeps what
the deltas taught (the served workers' and the in-process engine's target alike).

A call names a sequence and sends only what is new to its receiver: the position `start` from which the committed
tokens are new there, and those tokens. The sequence's settings (engine/request/settings.SequenceSettings:
sampling parameters, seed, grammar, prompt length) go with its first delta only (start 0, or a re-send from
scratch) and are kept with its tokens; later deltas carry tokens, and while the target still scores prompt tokens,
the prompt-logprob fields. The receiver's runner rolls its cache back to what agrees with the tokens
(`Runner.sync`), so rejected drafts vanish without bookkeeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.request.logits_processing import LogitsProcessor, RowProcessing
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState
from engine.request.settings import SequenceSettings


class UnknownSequenceError(KeyError):
    """A call continued a sequence its receiver does not hold (the sender must re-send it from 0)."""


@dataclass(frozen=True)
class SeqDelta:
    seq_id: str
    start: int  # committed tokens [0, start) were sent to this receiver before
    tokens: list[int]  # committed tokens [start, ...)
    settings: SequenceSettings | None = None  # with a sequence's first delta (start 0) only
    # prompt logprobs (SamplingParams.prompt_logprobs), while the target has prompt tokens to score: the top n, and
    # the prompt token after `tokens` when they end inside the prompt (a chunk: its last position's logits score it)
    prompt_logprobs: int | None = None
    prompt_next: int | None = None

    def wire(self) -> tuple:
        """Plain tuple form (deployments/transport/messages.py says why); `SeqDelta(*wire)` reads it back."""
        return (self.seq_id, self.start, self.tokens, self.settings, self.prompt_logprobs, self.prompt_next)


def seq_delta(seq: SequenceState, start: int, end: int | None = None) -> SeqDelta:
    """The committed tokens [start, end) of `seq` (to the last one without `end`) for a receiver that holds [0, start):
    with the settings when start is 0, and what the target needs to score the prompt while a request's prompt logprobs
    are not all in."""
    tokens = seq.tokens
    end = len(tokens) if end is None else end
    delta = SeqDelta(seq.request_id, start, tokens[start:end], seq.settings if start == 0 else None)
    if not seq.wants_prompt_logprobs():
        return delta
    prompt = seq.prompt_ids
    return SeqDelta(delta.seq_id, start, delta.tokens, delta.settings, seq.params.prompt_logprobs,
                    prompt[end] if end < len(prompt) else None)


def first_delta(seq_id: str, prompt: list[int], params: SamplingParams | None = None, seed: int | None = None,
                eos_ids: tuple[int, ...] = ()) -> SeqDelta:
    """A new sequence's first delta: its whole prompt and its settings (the seed: `params.seed`, else `seed`, else 0;
    a benchmark's or a test's request made without a SequenceState)."""
    params = SamplingParams() if params is None else params
    seed = params.seed if params.seed is not None else (0 if seed is None else seed)
    return SeqDelta(seq_id, 0, list(prompt), SequenceSettings.of(params, seed, len(prompt), eos_ids))


class KnownSequences:
    """The committed tokens each sequence has sent to this side, its settings and its logits processors (built once
    from the settings its first delta carried)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self._settings: dict[str, SequenceSettings] = {}
        self._processors: dict[str, tuple[LogitsProcessor, ...]] = {}
        self.touched: dict[str, float] = {}  # seq -> time.monotonic() of its latest delta

    def apply(self, delta: SeqDelta) -> list[int]:
        """The sequence's committed tokens after `delta`. UnknownSequenceError when it continues a sequence not held
        here, or arrives without the settings a first delta carries."""
        self.touched[delta.seq_id] = time.monotonic()
        known = self.tokens.get(delta.seq_id)
        if delta.start == 0:  # a sequence's first delta (or a re-send from scratch) carries its settings
            if delta.settings is None:
                raise UnknownSequenceError(f"{delta.seq_id}: a first delta without the sequence's settings")
            self._settings[delta.seq_id] = delta.settings
            self._processors[delta.seq_id] = delta.settings.processors()
            known = self.tokens[delta.seq_id] = []
        elif known is None or delta.start > len(known):
            raise UnknownSequenceError(delta.seq_id)
        del known[delta.start :]
        known.extend(delta.tokens)
        return known

    def settings(self, seq_id: str) -> SequenceSettings:
        return self._settings[seq_id]

    def processing(self, seq_id: str) -> RowProcessing | None:
        """The sequence's logits processors over the tokens it has sent (None: none)."""
        processors = self._processors.get(seq_id)
        if not processors:
            return None
        return RowProcessing(processors, self.tokens[seq_id], self._settings[seq_id].prompt_len)

    def pop(self, seq_id: str) -> None:
        self.tokens.pop(seq_id, None)
        self._settings.pop(seq_id, None)
        self._processors.pop(seq_id, None)
        self.touched.pop(seq_id, None)
