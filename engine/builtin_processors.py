"""vLLM's request-level logits processors, per scored position: min_tokens, logit_bias, and the repetition,
frequency and presence penalties (engine/logits_processing.py is the seam they plug into).

Meanings and order are vLLM's (vllm/sampling_params.py; its v1 Sampler applies the processors that can change the
argmax first, min_tokens then logit_bias, then the penalties, then temperature, min-p, top-k/top-p):
- min_tokens: the stop ids (EOS, even with ignore_eos, and stop_token_ids) get logit -inf while fewer than
  min_tokens output tokens precede the position.
- logit_bias: the bias (clamped to [-100, 100] by SamplingParams) is added to the token's logit.
- repetition_penalty r (over prompt and output tokens; CTRL, Keskar et al. 2019, arXiv 1909.05858): a seen token's
  logit is divided by r when positive, multiplied by r otherwise.
- frequency_penalty f and presence_penalty p (over output tokens only; OpenAI's definition): a token's logit
  loses f x its count in the output and p once if it appears there at all.
"Output" at a scored position is the committed output plus the speculative tokens before it (RowContext), so a
penalty at verify position j is the one plain decoding would apply after committing drafts[:j].

Each processor works on the row's few distinct history tokens, gathered out of [T, V] and scattered back: the cost
grows with the context, not the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .logits_processing import LogitsProcessor, RowContext
from .sampling import SamplingParams


def _ids(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class MinTokens:
    """-inf on the stop ids at the positions preceded by fewer than `min_tokens` output tokens."""

    min_tokens: int
    token_ids: tuple[int, ...]  # EOS ids and stop_token_ids

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        masked = min(logits.shape[0], max(0, self.min_tokens - context.outputs_before(0)))
        ids = [t for t in self.token_ids if t < logits.shape[-1]]
        if masked and ids:
            logits[:masked, ids] = float("-inf")
        return logits


@dataclass(frozen=True)
class LogitBias:
    """A fixed bias added to some tokens' logits at every position."""

    token_ids: tuple[int, ...]
    biases: tuple[float, ...]

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        keep = [i for i, t in enumerate(self.token_ids) if t < logits.shape[-1]]
        if keep:
            ids = torch.tensor([self.token_ids[i] for i in keep], device=logits.device)
            logits[:, ids] += torch.tensor([self.biases[i] for i in keep], device=logits.device)
        return logits


@dataclass(frozen=True)
class Penalties:
    """vLLM's repetition, frequency and presence penalties, each position with its own history."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V] -> [T, V]
        positions, vocab = logits.shape
        tokens = _ids(context.tokens)
        prompt, output = tokens[: context.prompt_len], tokens[context.prompt_len:]
        spec = _ids(context.speculative(positions - 1))  # every speculative token any position sees
        ids = np.unique(np.concatenate([prompt, output, spec]))
        ids = ids[(ids >= 0) & (ids < vocab)]
        if not len(ids):
            return logits
        # counts[t, s]: occurrences of ids[s] in the output before position t (committed, then speculative)
        output = output[(output >= 0) & (output < vocab)]
        committed = np.bincount(np.searchsorted(ids, output), minlength=len(ids))
        spec_hits = np.zeros((len(spec) + 1, len(ids)), dtype=np.int64)
        in_vocab = (spec >= 0) & (spec < vocab)
        spec_hits[1:][np.flatnonzero(in_vocab), np.searchsorted(ids, spec[in_vocab])] = 1
        before = context.first + np.arange(positions)  # speculative tokens before each position
        counts = torch.from_numpy(committed[None, :] + spec_hits.cumsum(axis=0)[before]).to(logits.device)
        index = torch.from_numpy(ids).to(logits.device)
        sub = logits[:, index]  # [T, S]
        if self.repetition != 1.0:
            seen = (counts > 0) | torch.from_numpy(np.isin(ids, prompt)).to(logits.device)[None, :]
            sub = torch.where(seen, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        if self.frequency:
            sub = sub - self.frequency * counts.float()
        if self.presence:
            sub = sub - self.presence * (counts > 0).float()
        logits[:, index] = sub
        return logits


@dataclass(frozen=True)
class LogitsSettings:
    """A sequence's built-in processing, fixed for its life: sent to a worker once, with the sequence's first call
    (deployments/messages.SeqDelta.logits), as `wire()`."""

    prompt_len: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # masked until min_tokens: EOS ids and stop_token_ids

    @staticmethod
    def of(params: SamplingParams, prompt_len: int, eos_ids: Iterable[int]) -> "LogitsSettings":
        """The settings of a request; EOS is masked under min_tokens even with ignore_eos (as vLLM does)."""
        stop_ids = tuple(sorted(set(eos_ids) | set(params.stop_token_ids))) if params.min_tokens else ()
        return LogitsSettings(prompt_len, params.presence_penalty, params.frequency_penalty,
                              params.repetition_penalty, params.logit_bias, params.min_tokens, stop_ids)

    def processors(self) -> tuple[LogitsProcessor, ...]:
        """The processors these settings need, in vLLM's order (none for the defaults)."""
        out: list[LogitsProcessor] = []
        if self.min_tokens and self.min_tokens_ids:
            out.append(MinTokens(self.min_tokens, self.min_tokens_ids))
        if self.logit_bias:
            out.append(LogitBias(tuple(t for t, _ in self.logit_bias), tuple(b for _, b in self.logit_bias)))
        if self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty:
            out.append(Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty))
        return tuple(out)

    def wire(self) -> tuple:
        return (self.prompt_len, self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                self.logit_bias, self.min_tokens, self.min_tokens_ids)

    @staticmethod
    def from_wire(wire: tuple) -> "LogitsSettings":
        prompt_len, presence, frequency, repetition, bias, min_tokens, ids = wire
        return LogitsSettings(prompt_len, presence, frequency, repetition, tuple(tuple(p) for p in bias),
                              min_tokens, tuple(ids))
