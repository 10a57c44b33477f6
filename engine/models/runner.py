"""The model-runner interface the workers call, and the choice of runner for a model.

Two runners implement it:
- `StaticRunner` (engine/models/static/runner.py), the fast path for the Llama family: a compiled, mask-free forward
over
  a KV cache preallocated once within a byte budget;
- `ModelRunner` (engine/models/transformers_runner.py), the fallback for every other transformers model (and
tensor-parallel
  shards configured with `runner: transformers`; the static runner runs the others, engine/models/static/tp.py): the
  transformers forward over a slotted cache that grows on demand.

Both keep, per sequence, the token ids whose keys/values are cached; `sync` rolls the cache back to the prefix the
caller's committed tokens agree with, which is how rejected draft tokens disappear on both draft and target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class KVCacheFull(RuntimeError):
    """No free KV-cache slot for another sequence."""


class KVBudgetError(ValueError):
    """The KV-cache budget does not hold one sequence of the configured length (a configuration error)."""


class ContextWindowError(ValueError):
    """A sequence would not fit the model's context window."""


def config_context_window(config) -> int:
    """The longest sequence a transformers config allows (within its sliding window, where it has one)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if value:
            window = int(value)
            break
    else:
        raise ValueError("cannot tell the model's context window from its config")
    sliding = getattr(config, "sliding_window", None)
    if sliding and getattr(config, "use_sliding_window", True) is not False:
        # the slotted caches attend to the whole prefix; stay within the window where both agree
        window = min(window, int(sliding))
    return window


@dataclass
class SeqSlot:
    slot: int
    tokens: list[int]  # token ids whose keys/values are in the cache, in order
    seq_id: str = ""


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`.

    Every round syncs each row's cache to its committed tokens with this, on every worker, so it compares slices
    (C loops) instead of stepping through the tokens in Python: the usual case, a cache that is a prefix of the
    committed tokens, is one comparison, and a mismatch is found by bisection (bench/RESULTS.md)."""
    n = min(len(a), len(b), limit)
    if _same_slice(a, b, 0, n):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _same_slice(a, b, lo, mid):
            lo = mid
        else:
            hi = mid
    return lo


def _same_slice(a: Sequence[int], b: Sequence[int], start: int, end: int) -> bool:
    x, y = a[start:end], b[start:end]
    return x == y if type(x) is type(y) else list(x) == list(y)


class SlotTable:
    """The live sequences of a runner: each one's cache slot and the token ids its cache holds.

    Slots stay compact (0..live-1): a released slot takes the last one's keys/values (`move_slot(src, dst,
    length)`, a copy once per release), so a batch over the live sequences is a contiguous range of slots.
    """

    def __init__(self, max_model_len: int, capacity: int | None,
                 move_slot: Callable[[int, int, int], None]) -> None:
        self.max_model_len = max_model_len
        self.capacity = capacity  # None: no limit (the cache grows)
        self._move_slot = move_slot
        self._seqs: dict[str, SeqSlot] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __iter__(self):  # the live sequences' ids
        return iter(self._seqs)

    def __getitem__(self, seq_id: str) -> SeqSlot:
        return self._seqs[seq_id]

    def add(self, seq_id: str) -> int:
        """The new sequence's slot; raises KVCacheFull when every slot is taken."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id!r} already live")
        if self.capacity is not None and len(self._seqs) >= self.capacity:
            raise KVCacheFull(f"all {self.capacity} KV-cache slots are taken")
        slot = len(self._seqs)
        self._seqs[seq_id] = SeqSlot(slot=slot, tokens=[], seq_id=seq_id)
        return slot

    def release(self, seq_id: str) -> None:
        """Free a sequence's slot now; the last slot moves into the hole so slots stay compact."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        last = len(self._seqs)
        if state.slot != last:
            mover = next(s for s in self._seqs.values() if s.slot == last)
            self._move_slot(last, state.slot, len(mover.tokens))
            mover.slot = state.slot

    def sync(self, seq_id: str, committed: Sequence[int]) -> list[int]:
        """Roll the cache back to its longest prefix agreeing with `committed`; return the tokens to feed.

        At least one token is always left to feed, so the next forward yields logits after the last token.
        """
        if not committed:
            raise ValueError("a sequence needs at least one token")
        if len(committed) > self.max_model_len:
            raise ContextWindowError(
                f"sequence of {len(committed)} tokens exceeds the context window of {self.max_model_len}")
        cached = self._seqs[seq_id].tokens
        common = common_prefix(cached, committed, len(committed) - 1)
        del cached[common:]
        return list(committed[common:])


class SlotTableAccess:
    """The sequence-table queries of the Runner protocol, the same for every runner that keeps its live sequences
    in a `SlotTable` at `self._seqs` (both runners do; each adds its own `add`, `release` and `capacity`)."""

    _seqs: SlotTable

    @property
    def num_live(self) -> int:
        return len(self._seqs)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def live_ids(self) -> list[str]:
        """The sequences holding a slot now (for /stats and leak checks)."""
        return list(self._seqs)

    def cached_tokens(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].tokens)

    def sync(self, seq_id: str, committed: Sequence[int]) -> list[int]:
        """Roll the cache back to its longest prefix agreeing with `committed`; return the tokens to feed."""
        return self._seqs.sync(seq_id, committed)


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

    def prompt_logits(self, seq_id: str, new_tokens: Sequence[int]) -> torch.Tensor:  # [N, V] float32
        """Append `new_tokens` to one sequence's cache; logits at every one of their positions (a request's prompt
        logprobs, engine/request/prompt_logprobs.py: the LM head over positions `forward` never computes it at)."""


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
