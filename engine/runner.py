"""The model-runner interface the workers call, and the choice of runner for a model.

Two runners implement it:
- `StaticRunner` (engine/static_runner.py), the fast path for the Llama family: a compiled, mask-free forward over
  a KV cache preallocated once within a byte budget;
- `ModelRunner` (engine/model_runner.py), the fallback for every other transformers model (and tensor-parallel
  shards): the transformers forward over a slotted cache that grows on demand.

Both keep, per sequence, the token ids whose keys/values are cached; `sync` rolls the cache back to the prefix the
caller's committed tokens agree with, which is how rejected draft tokens disappear on both draft and target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class KVCacheFull(RuntimeError):
    """No free KV-cache slot for another sequence."""


class Runner(Protocol):
    vocab_size: int  # logits width
    max_model_len: int  # the longest sequence (prompt + output) a slot holds
    device: torch.device
    dtype: torch.dtype  # the compute dtype

    @property
    def capacity(self) -> int | None:
        """The most live sequences the KV cache holds (None: it grows until memory runs out)."""

    @property
    def num_live(self) -> int: ...

    def has(self, seq_id: str) -> bool: ...

    def add(self, seq_id: str) -> None:
        """Give a new sequence a slot; raises KVCacheFull when none is free."""

    def release(self, seq_id: str) -> None: ...

    def sync(self, seq_id: str, committed: Sequence[int]) -> list[int]:
        """Roll the cache back to its longest prefix agreeing with `committed`; return the tokens to feed."""

    def cached_tokens(self, seq_id: str) -> list[int]: ...

    def forward(
        self,
        seq_ids: Sequence[str],
        new_tokens: Sequence[Sequence[int]],
        num_logits: Sequence[int],
    ) -> torch.Tensor:  # [B, max(num_logits), V] float32
        """Append `new_tokens[b]` to sequence b's cache; logits at its last `num_logits[b]` positions."""


def cpu_computes_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX-512 BF16 or AMX), where bf16 beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bf16 where the hardware computes it natively (CUDA; a CPU with avx512_bf16 or AMX), else float32.
    Other names pass through."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_computes_bf16() else "float32"
