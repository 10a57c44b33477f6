"""Stop conditions checked per accepted token, and incremental text for streaming.

A speculative round can emit several tokens at once; EOS, a stop string or max_tokens anywhere inside that
chunk must end the sequence exactly there, as plain decoding would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    keep: int  # how many of the offered tokens to keep
    finish_reason: str | None  # "stop" | "length" | None (still running)


class OutputText:
    """The decoded output of one sequence, the stop-string search, and what may be streamed yet."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.streamed = 0  # characters of `text` already handed out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def extend(self, new_ids: Sequence[int]) -> int | None:
        """Append tokens; if a stop string appears, keep only the tokens up to it and return how many were kept."""
        if not new_ids:
            return None
        candidate = self._decode(self.token_ids + list(new_ids))
        hit = self._find_stop(candidate, len(self.text))
        if hit is None:
            self.token_ids.extend(new_ids)
            self.text = candidate
            return None
        # the fewest tokens whose text already contains the stop string
        for keep in range(1, len(new_ids) + 1):
            partial = self._decode(self.token_ids + list(new_ids[:keep]))
            if self._find_stop(partial, len(self.text)) is not None:
                break
        self.token_ids.extend(new_ids[:keep])
        self.text = candidate[:hit]
        return keep

    def _find_stop(self, text: str, old_len: int) -> int | None:
        if not self.stop:
            return None
        start = max(0, old_len - self._max_stop + 1)
        found = [i for s in self.stop if (i := text.find(s, start)) != -1]
        return min(found) if found else None

    def take_delta(self, final: bool) -> str:
        """Text not yet streamed. Holds back an incomplete UTF-8 character and a possible stop-string prefix."""
        safe = len(self.text)
        if not final:
            while safe > self.streamed and self.text[safe - 1] == "\ufffd":
                safe -= 1
            for s in self.stop:
                for n in range(min(len(s) - 1, safe - self.streamed), 0, -1):
                    if self.text[safe - n : safe] == s[:n]:
                        safe -= n
                        break
        delta = self.text[self.streamed : safe] if safe > self.streamed else ""
        self.streamed = max(self.streamed, safe)
        return delta


def cut_at_eos_and_length(
    tokens: Sequence[int],
    eos_ids: frozenset[int],
    remaining: int,  # tokens the sequence may still emit (max_tokens and context window)
) -> Cut:
    """Keep tokens up to and including the first EOS, and never more than `remaining`."""
    for i, tok in enumerate(tokens):
        if i >= remaining:
            return Cut(keep=i, finish_reason="length")
        if tok in eos_ids:
            return Cut(keep=i + 1, finish_reason="stop")
    if len(tokens) >= remaining:
        return Cut(keep=len(tokens), finish_reason="length")
    return Cut(keep=len(tokens), finish_reason=None)
