"""vLLM's request-level logits processors, per scored position: min_tokens, logit_bias, and the repetition,
frequency and presence penalties (engine/request/logits_processing.py is the seam they plug into).

Meanings and order are vLLM's (vllm/sampling_params.py; its v1 Sampler applies the processors that can change the
argmax first, min_tokens then logit_bias, then the penalties, then temperature, min-p, top-k/top-p):
- min_tokens: the stop ids (EOS, even with ignore_eos, and stop_token_ids) get logit -inf while fewer than
  min_tokens output tokens precede the position, except where no other token is left (a grammar that can only
  end there: the grammar wins, as in vLLM; `MinTokens`).
- logit_bias: the bias (clamped to [-100, 100] by SamplingParams) is added to the token's logit.
- repetition_penalty r (over prompt and output tokens; CTRL, Keskar et al. 2019, arXiv 1909.05858): a seen token's
  logit is divided by r when positive, multiplied by r otherwise.
- frequency_penalty f and presence_penalty p (over output tokens only; OpenAI's definition): a token's logit
  loses f x its count in the output and p once if it appears there at all.
"Output" at a scored position is the committed output plus the speculative tokens before it (RowContext), so a
penalty at verify position j is the one plain decoding would apply after committing drafts[:j].

Each processor works on the rows' few distinct history tokens, gathered out of [B, T, V] and scattered back, all
rows of a call at once (`apply_batch`): the cost grows with the context, not the vocabulary. What remains per row is
counting its history (numpy, O(context) per call: small beside a forward pass at a few thousand tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.request.logits_processing import BatchItem, LogitsProcessor, RowContext, apply_one
from engine.request.sampling import SamplingParams

LOGIT_LIMIT = 1e20  # what a penalty may make of a finite logit, at most


def _ids(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _rows(items: Sequence[BatchItem], device: torch.device) -> torch.Tensor:  # [R] int64
    return torch.tensor([item.row for item in items], device=device)


@dataclass(frozen=True)
class MinTokens:
    """-inf on the stop ids at the positions preceded by fewer than `min_tokens` output tokens, except where nothing
    else is left: a position whose other tokens are all -inf already (a grammar that can only end there, its mask
    applied first) keeps its stop ids, so the row ends there, short of min_tokens, rather than sample from nothing.
    vLLM's rule for min_tokens with structured outputs (vllm-project/vllm#54218: the grammar is authoritative; the
    stop check then accepts the stop token below min_tokens: engine/request/sequence.py)."""

    min_tokens: int
    token_ids: tuple[int, ...]  # EOS ids and stop_token_ids

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        return apply_one(self, logits, context)

    @staticmethod
    def apply_batch(logits: torch.Tensor, items: Sequence[BatchItem]) -> None:  # [B, T, V], in place
        rows, positions, stops = [], [], []
        for item in items:
            masked = min(item.width, max(0, item.processor.min_tokens - item.context.outputs_before(0)))
            stop = [t for t in item.processor.token_ids if t < logits.shape[-1]]
            if stop:
                rows += [item.row] * masked  # a few positions per row
                positions += list(range(masked))
                stops += [stop] * masked
        if not rows:
            return
        device = logits.device
        width = max(len(stop) for stop in stops)  # a row with fewer stop ids repeats its first one
        ids = torch.tensor([stop + stop[:1] * (width - len(stop)) for stop in stops], device=device)  # [N, S]
        rows_t, positions_t = torch.tensor(rows, device=device), torch.tensor(positions, device=device)  # [N]
        alive = logits[rows_t, positions_t] > float("-inf")  # [N, V]
        alive.scatter_(1, ids, False)
        others = alive.any(dim=-1, keepdim=True)  # [N, 1]: another token remains, so the stop ids are masked here
        index = (rows_t[:, None], positions_t[:, None], ids)  # [N, S] each (broadcast)
        logits[index] = torch.where(others, float("-inf"), logits[index])  # no host sync (a GPU's logits)


@dataclass(frozen=True)
class LogitBias:
    """A fixed bias added to some tokens' logits at every position."""

    token_ids: tuple[int, ...]
    biases: tuple[float, ...]

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        return apply_one(self, logits, context)

    @staticmethod
    def apply_batch(logits: torch.Tensor, items: Sequence[BatchItem]) -> None:  # [B, T, V], in place
        rows, ids, biases = [], [], []
        for item in items:
            for t, b in zip(item.processor.token_ids, item.processor.biases):
                if t < logits.shape[-1]:
                    rows.append(item.row)
                    ids.append(t)
                    biases.append(b)
        if rows:  # (row, id) pairs are distinct: one bias per token and row; every position of the row
            logits[rows, :, ids] += torch.tensor(biases, device=logits.device)[:, None]


def _history(context: RowContext, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's distinct history tokens ids [S], their output counts before each position [width, S], and whether
    they are in the prompt [S]."""
    tokens = _ids(context.tokens)
    prompt, output = tokens[: context.prompt_len], tokens[context.prompt_len:]
    spec = _ids(context.speculative(width - 1))  # every speculative token any position sees
    ids = np.unique(np.concatenate([prompt, output, spec]))
    ids = ids[(ids >= 0) & (ids < vocab)]

    def columns(values: np.ndarray) -> np.ndarray:  # the columns of `values` in ids, values outside dropped
        return np.searchsorted(ids, values[(values >= 0) & (values < vocab)])

    committed = np.bincount(columns(output), minlength=len(ids))
    spec_hits = np.zeros((len(spec) + 1, len(ids)), dtype=np.int64)  # row e: the e-th speculative token
    in_vocab = (spec >= 0) & (spec < vocab)
    spec_hits[1 + np.flatnonzero(in_vocab), columns(spec)] = 1
    before = np.minimum(context.first + np.arange(width), len(spec))  # speculative tokens before each position
    in_prompt = np.zeros(len(ids), dtype=bool)
    in_prompt[columns(prompt)] = True
    return ids, committed[None, :] + spec_hits.cumsum(axis=0)[before], in_prompt


@dataclass(frozen=True)
class Penalties:
    """vLLM's repetition, frequency and presence penalties, each position with its own history."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        return apply_one(self, logits, context)

    @staticmethod
    def apply_batch(logits: torch.Tensor, items: Sequence[BatchItem]) -> None:  # [B, T, V], in place
        """All rows in one gather and scatter over [R, T, S], S the most distinct history tokens of a row (a row
        with fewer repeats its first token's column: the same value written twice)."""
        _, positions, vocab = logits.shape
        histories = [(item, *_history(item.context, item.width, vocab)) for item in items]
        histories = [h for h in histories if len(h[1])]
        if not histories:
            return
        width = max(len(h[1]) for h in histories)
        ids = np.empty((len(histories), width), dtype=np.int64)
        counts = np.zeros((len(histories), positions, width), dtype=np.int64)
        in_prompt = np.zeros((len(histories), width), dtype=bool)
        for r, (item, row_ids, row_counts, row_prompt) in enumerate(histories):
            n, w = len(row_ids), item.width
            ids[r, :n], ids[r, n:] = row_ids, row_ids[0]
            counts[r, :w, :n], counts[r, :w, n:] = row_counts, row_counts[:, :1]
            in_prompt[r, :n], in_prompt[r, n:] = row_prompt, row_prompt[0]
        device = logits.device
        items = [h[0] for h in histories]
        setting = torch.tensor([[i.processor.repetition, i.processor.frequency, i.processor.presence]
                                for i in items], device=device)[:, :, None, None]  # [R, 3, 1, 1]
        index = (_rows(items, device)[:, None, None], torch.arange(positions, device=device)[None, :, None],
                 torch.from_numpy(ids).to(device)[:, None, :])
        sub = logits[index]  # [R, T, S]
        count = torch.from_numpy(counts).to(device)
        seen = (count > 0) | torch.from_numpy(in_prompt).to(device)[:, None, :]
        repetition = setting[:, 0]
        new = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        # an extreme repetition penalty (vLLM allows any > 0) must not make a finite logit infinite: +inf gives NaN
        # probabilities, -inf everywhere leaves nothing to sample; |logit| <= 1e20 changes no real distribution
        new = torch.where(sub.isinf(), sub, new.clamp(-LOGIT_LIMIT, LOGIT_LIMIT))
        new = new - setting[:, 1] * count.float() - setting[:, 2] * (count > 0).float()
        live = index[1] < torch.tensor([i.width for i in items], device=device)[:, None, None]
        logits[index] = torch.where(live, new, sub)


def builtin_processors(params: SamplingParams, min_tokens_ids: Sequence[int] = ()) -> tuple[LogitsProcessor, ...]:
    """The processors a request's parameters need, in vLLM's order (none for the defaults); `min_tokens_ids` are the
    stop ids min_tokens masks (engine/request/settings.SequenceSettings holds them)."""
    out: list[LogitsProcessor] = []
    if params.min_tokens and min_tokens_ids:
        out.append(MinTokens(params.min_tokens, tuple(min_tokens_ids)))
    if params.logit_bias:
        out.append(LogitBias(tuple(t for t, _ in params.logit_bias), tuple(b for _, b in params.logit_bias)))
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        out.append(Penalties(params.repetition_penalty, params.frequency_penalty, params.presence_penalty))
    return tuple(out)
