"""Prompt logprobs (vLLM's `prompt_logprobs`, and what OpenAI's `echo` with `logprobs` reports): each prompt token's
log-probability under the target model given the tokens before it, its rank, and the top n at its position.

The distribution is the model's own: log_softmax of the raw logits, before temperature, penalties, logit_bias or a
grammar. That is vLLM's (v1 `gpu_model_runner._get_prompt_logprobs_dict` scores the prompt with
`compute_logprobs(logits)` on the model's logits, whatever the request's sampling settings), and the only one that
means something for a prompt (the sampling settings say how to draw the *output*). A rank is vLLM's too: 1 + the
tokens strictly more likely, ties counted with the token (`(logprobs >= logprob).sum()`).

The prompt's logits cost an LM head over every prompt position, which a plain prefill never computes (the runners
compute logits at the last position of a prompt only): so this runs only for rows that ask, through the runner's
`prompt_logits`, a piece at a time (`PIECE` positions: their [N, V] float32 logits are reduced to a few numbers
each at once, so memory stays bounded for long prompts and large vocabularies). It runs where the target's prefill
runs: the target worker (rank 0 reduces, the other ranks only take part in the forward's collectives) and the
in-process engine, chunk by chunk when the prompt arrives in chunks (`score_prefill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

PIECE = 64  # prompt positions scored per runner call (their logits are [PIECE, V] float32 at most)


class PromptLogprob(NamedTuple):
    """One prompt token's log-probability given the tokens before it, its rank, and the top n at its position."""

    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class PromptLogprobs:
    """Consecutive prompt positions' logprobs: entries[i] scores the prompt token at position first + i (>= 1: the
    first prompt token has no logprob)."""

    first: int
    entries: list[PromptLogprob]

    def wire(self) -> tuple:
        return (self.first, [tuple(e) for e in self.entries])

    @staticmethod
    def from_wire(wire: tuple) -> "PromptLogprobs":
        first, entries = wire
        return PromptLogprobs(first, [PromptLogprob(lp, rank, tuple(map(tuple, top))) for lp, rank, top in entries])


def score_tokens(
    logits: torch.Tensor,  # [N, V] raw logits at N positions
    targets: Sequence[int],  # N tokens, targets[i] the token after position i
    n: int,
) -> list[PromptLogprob]:
    """Each target's log-probability under log_softmax(logits), its rank and the top n."""
    assert logits.dim() == 2 and logits.shape[0] == len(targets), (tuple(logits.shape), len(targets))
    logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
    index = torch.as_tensor(list(targets), dtype=torch.long, device=logprobs.device)[:, None]  # [N, 1]
    chosen = logprobs.gather(1, index)  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [N]
    top_values, top_ids = logprobs.topk(n, dim=-1) if n > 0 else (logprobs[:, :0], index[:, :0])
    return [PromptLogprob(lp, rank, tuple(zip(ids, values)))
            for lp, rank, ids, values in zip(chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                             top_values.tolist())]


def verify_feed(runner, seq_id: str, known: Sequence[int], prompt_len: int, prompt_logprobs: int | None,
                reduce: bool = True) -> tuple[list[int], PromptLogprobs | None]:
    """A verify row's input to the target: the committed tokens its cache lacks (`runner.sync`), with the prompt
    positions that score prompt tokens fed first when the request asked for `prompt_logprobs` (`score_prefill`).
    The one place both round loops build it: the in-process engine's and the target worker's."""
    feed = runner.sync(seq_id, known)
    if prompt_logprobs is None:
        return feed, None
    return score_prefill(runner, seq_id, known, feed, prompt_len, prompt_logprobs, reduce=reduce)


def score_prefill(runner, seq_id: str, known: Sequence[int], feed: list[int], prompt_len: int, n: int,
                  reduce: bool = True) -> tuple[list[int], PromptLogprobs | None]:
    """Feed the prompt positions of `feed` whose logits score a prompt token, through `runner.prompt_logits`.

    `known` are the sequence's committed tokens, `feed` the last of them, not cached yet (`runner.sync`'s answer).
    Positions p in [len(known) - len(feed), min(prompt_len, len(known)) - 1) score known[p + 1]: they are fed here,
    PIECE at a time, and reduced to logprobs (only with `reduce`: tensor-parallel ranks other than 0 only compute).
    Returns the rest of `feed` (at least its last token: the batched forward's, whose logits score the first output
    token, or the next prompt chunk's first token) and the logprobs, or None when none were scored here.
    """
    start = len(known) - len(feed)  # the absolute position of feed[0]
    end = max(start, min(prompt_len, len(known)) - 1)
    scored = []
    for lo in range(start, end, PIECE):
        hi = min(end, lo + PIECE)
        logits = runner.prompt_logits(seq_id, list(known[lo:hi]))  # [hi - lo, V]
        if reduce:
            scored += score_tokens(logits, known[lo + 1 : hi + 1], n)
    rest = feed[end - start :]
    return rest, (PromptLogprobs(start + 1, scored) if scored else None)
