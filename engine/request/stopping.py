"""Stop conditions checked per accepted token, and incremental text for streaming.

A speculative round can emit several tokens at once; EOS, a stop string or max_tokens anywhere inside that
chunk must end the sequence exactly there, as plain decoding would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


@dataclass(frozen=True)
class Cut:
    keep: int  # how many of the offered tokens to keep
    finish_reason: str | None  # "stop" | "length" | None (still running)
    stop_token: bool = False  # the last kept token is EOS or a stop_token_id (it ended the sequence)


class OutputText:
    """The decoded output of one sequence, the stop-string search, and what may be streamed yet.

    Decoding is incremental: each token's text comes from the tokenizer's own streaming decoder
    (`tokenizers.decoders.DecodeStream`, what vLLM's fast detokenizer uses), a constant cost per token, where
    decoding the whole output every round cost O(length) per round, much of a round at long outputs and many rows
    (bench/RESULTS.md). Text ending inside a multi-byte character waits for the token that completes it;
    a finished sequence's text is decoded whole once (a sequence that ends inside a character ends with the
    replacement character, as the full decoding does). Tokenizers without a Rust backend decode the whole output
    each round, as before.

    Without stop strings the round loop needs no text: `extend` then only appends the ids, and their text is decoded
    when an output's text is asked for (`take_delta(upto=...)`, by the request's consumer, between rounds), as vLLM
    detokenizes in its front end apart from the engine core's steps. With stop strings every round's text is decoded
    in `extend`, since a stop string must end the sequence in the round that produced it.

    vLLM's meanings (its v1 detokenizer): `skip_special_tokens` leaves special tokens out of the text; a sequence
    ended by a stop token (EOS or a stop_token_id) keeps the token's id but not its text, and a stop string is cut
    from the text, unless `include_stop_str`; a stop string counts only where it ends in the text of a token after
    the first `min_tokens` ones.
    """

    def __init__(self, tokenizer, stop: Sequence[str], skip_special_tokens: bool = True,
                 include_stop_str: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.min_tokens = min_tokens
        self._min_text: int | None = 0 if min_tokens == 0 else None  # text length of the first min_tokens tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.deferred = not self.stop  # text decoded on demand (take_delta), not in extend
        self._texted = 0  # deferred decoding: leading token_ids whose text is in `text`
        self.streamed = 0  # characters of `text` already handed out
        self._stopped = False  # cut at a stop string: the text ends before it
        self._untexted = 0  # trailing token ids without text (a stop token's, left out)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if backend is not None else None
        self._backend = backend

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _pieces(self, held: int, new_ids: list[int]) -> str:
        """The text `new_ids` complete after token_ids[:held], whose text is self.text (held back while a character
        is incomplete)."""
        if not new_ids:
            return ""
        if self._stream is not None:
            return self._stream.step(self._backend, new_ids) or ""
        return self._decode(self.token_ids[:held] + new_ids).rstrip("\ufffd")[len(self.text):]

    def extend(self, new_ids: Sequence[int], ends_with_stop_token: bool = False) -> int | None:
        """Append tokens; if a stop string appears, keep only the tokens up to it and return how many were kept
        (the fewest whose text contains it). `ends_with_stop_token`: the last one ended the sequence (EOS, a
        stop_token_id): its text is left out unless include_stop_str."""
        new = [int(t) for t in new_ids]
        textual = new[:-1] if ends_with_stop_token and not self.include_stop_str else new
        if self.deferred:  # no stop string to look for: the text waits until it is asked for
            self.token_ids.extend(new)
            self._untexted = len(new) - len(textual)
            return None
        old_len = len(self.text)
        self.text += self._pieces(len(self.token_ids), textual)
        if self._min_text is None and len(self.token_ids) + len(textual) >= self.min_tokens:
            self._min_text = len(self._decode((self.token_ids + textual)[: self.min_tokens]))
        hit = self._find_stop(self.text, old_len)
        if hit is None:
            self.token_ids.extend(new)
            self._untexted = len(new) - len(textual)
            return None
        # the round's tokens hold a stop string (once per sequence): the fewest of them whose text contains it
        for keep in range(1, len(textual) + 1):
            if self._find_stop(self._decode(self.token_ids + textual[:keep]), old_len) is not None:
                break
        self.token_ids.extend(textual[:keep])
        self.text = self.text[: hit[0] + (hit[1] if self.include_stop_str else 0)]
        self._stopped = True
        return keep

    def finish(self) -> None:
        """The sequence has ended: its text is the full decoding of its tokens (which differs from the streamed
        pieces only when it ended inside a character), or the text before the stop string that ended it."""
        if not self._stopped:
            self.text = self._decode(self.token_ids[: len(self.token_ids) - self._untexted])

    def _find_stop(self, text: str, old_len: int) -> tuple[int, int] | None:
        """The earliest stop string ending past `old_len` and past the first min_tokens tokens' text: (index,
        length)."""
        if not self.stop or self._min_text is None:
            return None
        found = [(i, len(s)) for s in self.stop
                 if (i := text.find(s, max(0, old_len - len(s) + 1, self._min_text - len(s) + 1))) != -1]
        return min(found, key=lambda hit: hit[0]) if found else None

    def _catch_up(self, upto: int) -> None:
        """Deferred decoding: the text of token_ids[:upto], fed to the streaming decoder from where it stopped."""
        if upto > self._texted:
            self.text += self._pieces(self._texted, self.token_ids[self._texted : upto])
            self._texted = upto

    def take_delta(self, final: bool, upto: int | None = None) -> str:
        """Text not yet streamed, of the first `upto` tokens (all: None). Holds back an incomplete UTF-8 character
        and a possible stop-string prefix."""
        if self.deferred and not final:
            self._catch_up(len(self.token_ids) if upto is None else upto)
        if final:
            self.finish()
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
    eos_ids: frozenset[int],  # the ids that end a sequence: EOS and stop_token_ids
    remaining: int,  # tokens the sequence may still emit (max_tokens and context window)
    min_left: int = 0,  # tokens still owed to min_tokens: a stop id among the first min_left does not stop
) -> Cut:
    """Keep tokens up to and including the first EOS or stop token, and never more than `remaining`."""
    for i, tok in enumerate(tokens):
        if i >= remaining:
            return Cut(keep=i, finish_reason="length")
        if tok in eos_ids and i >= min_left:
            return Cut(keep=i + 1, finish_reason="stop", stop_token=True)
    if len(tokens) >= remaining:
        return Cut(keep=len(tokens), finish_reason="length")
    return Cut(keep=len(tokens), finish_reason=None)
