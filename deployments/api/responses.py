"""The HTTP API's response bodies: choices, usage and logprobs in OpenAI's shapes, and the merge of a request's
choices (n > 1, or several prompts) into one response or one event stream.

Logprobs come from the target's processed distribution, computed where it samples (engine/spec/accept.py: each emitted
token's log-probability and the top n); prompt logprobs from its raw distribution over the prompt
(engine/request/prompt_logprobs.py); here they only get their JSON shape. A token's text is its own decoding, as vLLM
reports it (a token that is part of a multi-byte character decodes to U+FFFD; `bytes` are that text's UTF-8 bytes).

Prompt logprobs take two shapes, vLLM's both: `prompt_logprobs` (`prompt_logprobs_json`: None for the first prompt
token, then per token a dict token id -> {logprob, rank, decoded_token}, the prompt token first, then the top n),
and, for a completion with `echo` and `logprobs`, the prompt's tokens before the completion's in its `logprobs`
object (`CompletionLogprobs.add_prompt`: null logprob and top_logprobs for the first, text offsets from 0 on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from engine.request.prompt_logprobs import PromptLogprob
from engine.request.sequence import RequestOutput
from engine.spec.accept import LOGPROB_FLOOR, TokenLogprob
from engine.spec.stats import SpecStats


class TokenPieces:
    """Each token's own text (cached: the vocabulary is fixed)."""

    def __init__(self, tokenizer) -> None:
        self._piece = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._piece(int(token_id))


def _entry(piece: str, logprob: float) -> dict:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def chat_logprobs(pieces: TokenPieces, token_ids: Sequence[int],
                  logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """Chat's `logprobs.content` entries: per token its text, log-probability, bytes and `top_logprobs`."""
    return [dict(_entry(pieces(t), lp.logprob), top_logprobs=[_entry(pieces(i), v) for i, v in lp.top])
            for t, lp in zip(token_ids, logprobs)]


def _floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)  # JSON has no -inf (vLLM's clamp)


def prompt_logprobs_json(pieces: TokenPieces, prompt_ids: Sequence[int],
                         entries: Sequence[PromptLogprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the prompt token itself, then the top n (ranked 1..n)."""
    out: list[dict | None] = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        scored = {token: {"logprob": _floored(entry.logprob), "rank": entry.rank, "decoded_token": pieces(token)}}
        for rank, (i, value) in enumerate(entry.top, 1):
            scored.setdefault(i, {"logprob": _floored(value), "rank": rank, "decoded_token": pieces(i)})
        out.append(scored)
    return out


@dataclass
class CompletionLogprobs:
    """Completions' `logprobs` object (the legacy shape), grown token by token: with `echo`, the prompt's tokens
    first (`add_prompt`)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # the characters before the next token: the tokens' so far (the echoed prompt's among them)

    def add_prompt(self, pieces: TokenPieces, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob | None],
                   n: int) -> "CompletionLogprobs":
        """Append the prompt's tokens (`echo`) with their prompt logprobs: the first has none (null, as vLLM
        answers), the others their logprob and the top n with the token itself; returns just those tokens' object."""
        new = CompletionLogprobs(offset=self.offset)
        for token, entry in zip(prompt_ids, entries):
            piece = pieces(token)
            top = None
            if entry is not None:
                top = {pieces(i): _floored(v) for i, v in entry.top[:n]}
                top.setdefault(piece, _floored(entry.logprob))
            for target in (self, new):
                target._append(piece, None if entry is None else _floored(entry.logprob), top)
        return new

    def add(self, pieces: TokenPieces, token_ids: Sequence[int],
            logprobs: Sequence[TokenLogprob]) -> "CompletionLogprobs":
        """Append tokens; returns just those tokens' object (a stream chunk's)."""
        new = CompletionLogprobs(offset=self.offset)
        for t, lp in zip(token_ids, logprobs):
            piece = pieces(t)
            top = {pieces(i): v for i, v in lp.top}
            top.setdefault(piece, lp.logprob)  # vLLM's shape: the sampled token is always among them
            for target in (self, new):
                target._append(piece, lp.logprob, top)
        return new

    def _append(self, piece: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(piece)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(piece)

    def json(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def usage_json(prompt_tokens: int, completion_tokens: int, stats: SpecStats | None, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # read from the prefix cache (OpenAI's field)
        "speculative": stats.as_dict() if stats is not None else None,
    }


def merged_usage(finals: Sequence[RequestOutput], prompts: int) -> dict:
    """One response's usage over its choices: each prompt counted once (its `n` choices share it), every choice's
    completion tokens, and the speculation statistics summed."""
    stats = SpecStats()
    for out in finals:
        stats.merge(out.stats)
    per_prompt = len(finals) // prompts
    prompt_tokens = sum(out.num_prompt_tokens for out in finals[::per_prompt])
    cached = sum(out.num_cached_tokens for out in finals[::per_prompt])
    return usage_json(prompt_tokens, sum(out.num_output_tokens for out in finals), stats, cached)


async def interleave(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as each arrives, until all have finished. Closing it closes every
    stream (which aborts their requests)."""
    pending: dict[asyncio.Task, int] = {}

    def next_of(index: int) -> None:
        pending[asyncio.ensure_future(streams[index].__anext__())] = index

    try:
        for index in range(len(streams)):
            next_of(index)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield index, out
                if not out.finished:
                    next_of(index)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
