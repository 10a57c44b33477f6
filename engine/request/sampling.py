"""Sampling parameters and the logits -> probabilities processing shared by draft and target.

The draws themselves use counter-based random numbers (engine/spec/randomness.py) and live with the samplers
(engine/spec/rejection.py, engine/spec/proposal.py): no generator state.

Speculative sampling is lossless only if the draft and the target distributions are processed the same way
before the ratio test (Chen et al. 2023, arXiv 2302.01318, Sec. 2.3: "any modification of the target
distribution, e.g. temperature or top-k, must be applied to both"). `logits_to_probs` is that one processing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.request.grammar import GrammarSpec

MAX_LOGPROBS = 20  # the top-n a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None  # given: drafter-invariant Gumbel-coupled sampling (engine/spec/accept.py)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: not asked; n >= 0: each emitted token's logprob and the top n
    # None: not asked; n >= 0: each prompt token's logprob under the target, its rank and the top n
    # (engine/request/prompt_logprobs.py), with the request's first output
    prompt_logprobs: int | None = None
    # vLLM's meanings (vllm/sampling_params.py); the logits processors are engine/request/builtin_processors.py
    presence_penalty: float = 0.0  # subtracted once from each token already in the output, [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, [-2, 2]
    repetition_penalty: float = 1.0  # > 0: positive logits of tokens in prompt or output divided, negative multiplied
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the top token's probability (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), bias in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    stop_token_ids: tuple[int, ...] = ()  # stop on these ids (the stop token is emitted, like EOS)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # structured outputs (engine/request/grammar.py): every emitted token is one the grammar allows, and the row stops
    # when the grammar completes (EOS stops such a row even with ignore_eos)
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        bias = dict(self.logit_bias)  # one bias per token (the last given wins), clamped as vLLM does
        if any(not isinstance(t, int) or t < 0 for t in bias):
            raise ValueError("logit_bias keys must be token ids (integers >= 0)")
        if any(not math.isfinite(b) for b in bias.values()):
            raise ValueError("logit_bias values must be finite numbers")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, min(100.0, max(-100.0, float(b))))
                                                            for t, b in bias.items())))
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class BatchSampling:
    """The sampling settings of B rows as tensors, so processing is one batched call."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = disabled
    top_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor = field(repr=False)  # [B] bool
    min_p: torch.Tensor | None = None  # [B] float32, 0 = disabled; None: no row uses it

    @staticmethod
    def from_params(params: list[SamplingParams]) -> "BatchSampling":
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        return BatchSampling(
            temperature=temps,
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            greedy=temps == 0.0,
            min_p=(torch.tensor([p.min_p for p in params], dtype=torch.float32)
                   if any(p.min_p > 0.0 for p in params) else None),
        )


def logits_to_probs(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    sampling: BatchSampling,  # B rows
) -> torch.Tensor:  # [B, T, V] float32, rows sum to 1
    """Temperature, then min-p, then top-k, then top-p (nucleus), then softmax: vLLM's order (its Sampler:
    temperature, the argmax-invariant min-p processor, top-k/top-p). Greedy rows become one-hot argmax (min-p,
    top-k and top-p never change the argmax).

    The same function processes draft and target logits, so the rejection sampler compares like with like. The
    logits come in already through the row's logits processors (engine/request/logits_processing.py: penalties, bias,
    min_tokens, ...), applied per position by the caller.
    """
    assert logits.dim() == 3, f"logits must be [B, T, V], got {tuple(logits.shape)}"
    batch, _, vocab = logits.shape
    assert sampling.temperature.shape == (batch,), "one sampling row per batch row"
    logits = logits.float()
    device = logits.device
    # the settings are host tensors: which rows take which path is decided here, never by reading the device (on a
    # GPU each such read waits for the step that made the logits)
    greedy = sampling.greedy
    if bool(greedy.all()):
        return _one_hot_argmax(logits)
    if not bool(greedy.any()):
        return _filtered_softmax(logits, sampling, vocab)
    probs = torch.empty_like(logits)
    at = _to(greedy.nonzero()[:, 0], device)
    probs[at] = _one_hot_argmax(logits[at])
    rows = (~greedy).nonzero()[:, 0]
    at = _to(rows, device)
    probs[at] = _filtered_softmax(logits[at], _rows_of(sampling, rows), vocab)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, T, V] -> [B, T, V]: a greedy row's distribution
    return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, queued behind the stream's work (a blocking copy would wait for it)."""
    return host.to(device, non_blocking=True)


def _rows_of(sampling: BatchSampling, rows: torch.Tensor) -> BatchSampling:  # rows [S] int64 on the host
    return BatchSampling(sampling.temperature[rows], sampling.top_k[rows], sampling.top_p[rows], sampling.greedy[rows],
                         None if sampling.min_p is None else sampling.min_p[rows])


def _filtered_softmax(
    logits: torch.Tensor,  # [S, T, V] float32
    sampling: BatchSampling,  # S sampled rows (host tensors)
    vocab: int,
) -> torch.Tensor:  # [S, T, V]
    device = logits.device
    scaled = logits / _to(sampling.temperature, device)[:, None, None]
    if sampling.min_p is not None and bool((sampling.min_p > 0.0).any()):
        # min-p (Nguyen et al. 2024, arXiv 2407.01082; vLLM's MinPLogitsProcessor): keep the tokens whose probability
        # is at least min_p times the most likely token's, at the temperature-scaled distribution
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _to(sampling.min_p, device)[:, None, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if bool((sampling.top_k > 0).any()) or bool((sampling.top_p < 1.0).any()):
        top_k, top_p = _to(sampling.top_k, device), _to(sampling.top_p, device)
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop = (ranks[None, None, :] >= k[:, None, None]).expand_as(sorted_logits).clone()  # beyond top-k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # nucleus: keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, sorted_idx, sorted_logits)
    return scaled.softmax(dim=-1)
