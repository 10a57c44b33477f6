"""Sampling parameters and the logits -> probabilities processing shared by draft and target.

The draws themselves use counter-based random numbers (engine/randomness.py) and live with the samplers
(engine/rejection.py, engine/proposal.py): no generator state.

Speculative sampling is lossless only if the draft and the target distributions are processed the same way
before the ratio test (Chen et al. 2023, arXiv 2302.01318, Sec. 2.3: "any modification of the target
distribution, e.g. temperature or top-k, must be applied to both"). `logits_to_probs` is that one processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grammar import GrammarSpec


MAX_LOGPROBS = 20  # the top-n a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None  # given: drafter-invariant Gumbel-coupled sampling (engine/accept.py)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: not asked; n >= 0: each emitted token's logprob and the top n
    # structured outputs (engine/grammar.py): every emitted token is one the grammar allows, and the row stops when
    # the grammar completes (EOS stops such a row even with ignore_eos)
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

    @staticmethod
    def from_params(params: list[SamplingParams]) -> "BatchSampling":
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        return BatchSampling(
            temperature=temps,
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            greedy=temps == 0.0,
        )


def logits_to_probs(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    sampling: BatchSampling,  # B rows
) -> torch.Tensor:  # [B, T, V] float32, rows sum to 1
    """Temperature, then top-k, then top-p (nucleus), then softmax. Greedy rows become one-hot argmax.

    The same function processes draft and target logits, so the rejection sampler compares like with like.
    """
    assert logits.dim() == 3, f"logits must be [B, T, V], got {tuple(logits.shape)}"
    batch, _, vocab = logits.shape
    assert sampling.temperature.shape == (batch,), "one sampling row per batch row"
    logits = logits.float()
    greedy = sampling.greedy.to(logits.device)
    probs = torch.empty_like(logits)
    if greedy.any():
        idx = logits[greedy].argmax(dim=-1, keepdim=True)
        probs[greedy] = torch.zeros_like(logits[greedy]).scatter_(-1, idx, 1.0)
    sampled = ~greedy
    if sampled.any():
        probs[sampled] = _filtered_softmax(
            logits[sampled],
            sampling.temperature[sampled.cpu()].to(logits.device),
            sampling.top_k[sampled.cpu()].to(logits.device),
            sampling.top_p[sampled.cpu()].to(logits.device),
            vocab,
        )
    return probs


def _filtered_softmax(
    logits: torch.Tensor,  # [S, T, V] float32
    temperature: torch.Tensor,  # [S]
    top_k: torch.Tensor,  # [S] int64, 0 = disabled
    top_p: torch.Tensor,  # [S]
    vocab: int,
) -> torch.Tensor:  # [S, T, V]
    scaled = logits / temperature[:, None, None]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop = (ranks[None, None, :] >= k[:, None, None]).expand_as(sorted_logits).clone()  # beyond top-k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # nucleus: keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, sorted_idx, sorted_logits)
    return scaled.softmax(dim=-1)
