"""Automatic prefix caching for the static runner: the keys and values of finished sequences stay in the KV cache's
free slots, and a new sequence whose tokens start the same way copies them instead of computing them again.

vLLM and SGLang do the same with hashed blocks (vLLM's "automatic prefix caching", SGLang's RadixAttention): a chat
template's system prompt, a conversation's earlier turns and a prompt sent again are read from the cache. Here the
unit is a whole slot (engine/models/static/runner.py keeps live sequences in slots 0..live-1 and never gathers): an
entry is a slot past the live ones holding the keys and values of one finished sequence's first `len(tokens)` positions.
Entries live only in slots no live sequence needs: a new sequence that needs an entry's slot moves the entry to an empty
slot if there is one, else the entry is dropped; when every free slot holds an entry, the least recently used one makes
room for the next.

A hit is exact only where the forward is *layout-invariant*: a token's keys and values are the same bits whether its
sequence was fed whole, in chunks or after a copied prefix (`why_layout_variant`). The runner turns the
cache on only there, so a greedy text with the cache is the text without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.models.cpu import extension as cpu_extension
from engine.models.runner import SeqSlot, common_prefix
from engine.models.static.forward import StaticLlama
from engine.models.static.layer_ops import FUSED_OPS

MIN_PREFIX_TOKENS = 16  # shorter matches are not copied (vLLM's default block size)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens that were looked up (a new sequence's first feed, and its later chunks)
    hit_tokens: int = 0  # of those, the ones copied from an entry instead of computed
    stored: int = 0  # finished sequences kept as entries
    evicted: int = 0  # entries dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens, "stored": self.stored,
                "evicted": self.evicted, "hit_rate": round(self.hit_rate, 4)}


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # the token ids whose keys/values the slot holds, from position 0
    last_used: int


@dataclass
class PrefixCache:
    """Which free slots hold which token prefixes (the bookkeeping only; the runner copies the keys and values)."""

    min_tokens: int = MIN_PREFIX_TOKENS
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _entries: dict[int, _Entry] = field(default_factory=dict)  # by slot
    _clock: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def slots(self) -> list[int]:
        return sorted(self._entries)

    def tokens_at(self, slot: int) -> tuple[int, ...] | None:
        entry = self._entries.get(slot)
        return None if entry is None else entry.tokens

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup ---------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int, have: int = 0) -> tuple[int, int] | None:
        """(slot, length) of the entry sharing the longest prefix with `tokens`, at most `limit` tokens, if at least
        `min_tokens` and more than the `have` tokens the sequence holds already; counts the lookup of the tokens past
        `have` in the stats (the caller copies positions `have`..`length` from `slot`)."""
        self.stats.queried_tokens += len(tokens) - have
        best: tuple[int, int] | None = None
        for slot, entry in self._entries.items():
            length = common_prefix(entry.tokens, tokens, limit)
            if length >= self.min_tokens and length > have and (best is None or length > best[1]):
                best = (slot, length)
        if best is not None:
            self._entries[best[0]].last_used = self._tick()
            self.stats.hit_tokens += best[1] - have
        return best

    # ---- entries --------------------------------------------------------------------------------------------
    def worth_keeping(self, tokens: Sequence[int]) -> bool:
        """Whether a finished sequence's tokens add anything: long enough, and not a prefix of an entry's (that
        entry is marked used instead)."""
        if len(tokens) < self.min_tokens:
            return False
        for entry in self._entries.values():
            if common_prefix(entry.tokens, tokens, len(tokens)) == len(tokens):
                entry.last_used = self._tick()
                return False
        return True

    def put(self, slot: int, tokens: Sequence[int]) -> list[int]:
        """Record that `slot` holds `tokens`; entries whose tokens are a prefix of these are dropped (returned: their
        slots are empty now)."""
        tokens = tuple(tokens)
        covered = [s for s, e in self._entries.items()
                   if s != slot and common_prefix(e.tokens, tokens, len(e.tokens)) == len(e.tokens)]
        for s in covered:
            del self._entries[s]
        self._entries[slot] = _Entry(tokens, self._tick())
        self.stats.stored += 1
        return covered

    def drop(self, slot: int) -> None:
        if self._entries.pop(slot, None) is not None:
            self.stats.evicted += 1

    def moved(self, src: int, dst: int) -> None:
        self._entries[dst] = self._entries.pop(src)

    def least_recently_used(self) -> int | None:
        if not self._entries:
            return None
        return min(self._entries, key=lambda s: self._entries[s].last_used)


class SlotPrefixCache:
    """The static runner's side: entries in the KV cache's free slots (slots `live`.. past the live sequences, which
    stay compact in 0..live-1), copied with the model's `move_slot(src, dst, length[, start])`."""

    def __init__(self, num_slots: int, move_slot: Callable[..., None], min_tokens: int = MIN_PREFIX_TOKENS) -> None:
        self.num_slots = num_slots
        self.index = PrefixCache(min_tokens)
        self._move = move_slot  # (src, dst, length, start=0): positions [start, length) of src into dst

    def __len__(self) -> int:
        return len(self.index)

    def _empty_slot(self, above: int, live: int) -> int | None:
        """A slot past `above` that neither a live sequence nor an entry holds."""
        taken = set(self.index.slots())
        return next((s for s in range(max(above + 1, live), self.num_slots) if s not in taken), None)

    def vacate(self, slot: int, live: int) -> None:
        """A new live sequence needs `slot`: its entry moves to an empty slot, else into the least recently used
        entry's (which is dropped), unless it is that entry itself: then it is dropped. (Dropping it whenever no slot
        was empty lost the most recent entry, the one the next request is likeliest to share, whenever the cache
        was full: at one stream every request's predecessor.)"""
        tokens = self.index.tokens_at(slot)
        if tokens is None:
            return
        empty = self._empty_slot(slot, live)
        if empty is None:
            victim = self.index.least_recently_used()
            if victim is None or victim == slot:
                self.index.drop(slot)
                return
            self.index.drop(victim)
            empty = victim
        self._move(slot, empty, len(tokens))
        self.index.moved(slot, empty)

    def keep(self, state: SeqSlot, live: int) -> None:
        """Before `state`'s slot is released (`live` sequences, it included): copy its keys and values into a free
        slot as an entry (in place when it is the last live slot, which the release leaves where it is); the least
        recently used entry makes room when no slot is empty; nothing is kept when every slot is live."""
        if not self.index.worth_keeping(state.tokens):
            return
        last = live - 1
        if state.slot == last:
            self.index.put(last, state.tokens)
            return
        target = self._empty_slot(last, live)
        if target is None:
            target = self.index.least_recently_used()
            if target is None:
                return
            self.index.drop(target)
        self._move(state.slot, target, len(state.tokens))
        self.index.put(target, state.tokens)

    def reuse(self, states: Sequence[SeqSlot], new_tokens: list[list[int]],
              num_logits: Sequence[int]) -> dict[int, int]:
        """Rows feeding a prompt (a new sequence's first tokens, or a later chunk of its prompt: the router sends a
        long prompt `prefill_chunk` tokens a round) whose tokens so far an entry holds further copy those keys and
        values and feed only the rest (`new_tokens` is changed in place); at least their last `num_logits` tokens
        are computed. Any entry that shares the prefix will do, not only the one an earlier chunk copied from: with
        a layout-invariant forward every copy of a prefix holds the same bits. Returns the rows that copied: tokens
        copied."""
        hits: dict[int, int] = {}
        for b, (state, toks, k) in enumerate(zip(states, new_tokens, num_logits)):
            have = len(state.tokens)
            if len(toks) - max(k, 1) <= 0 or have + len(toks) <= self.index.min_tokens:
                continue  # decode and verify rows: every token they feed is computed
            hit = self.index.match([*state.tokens, *toks], have + len(toks) - max(k, 1), have)
            if hit is None:
                continue
            src, length = hit
            self._move(src, state.slot, length, have)
            state.tokens.extend(toks[: length - have])
            new_tokens[b] = toks[length - have :]
            hits[b] = length - have
        return hits


def why_layout_variant(model: StaticLlama) -> str | None:
    """None if the eager forward is layout-invariant: a token's keys, values and logits are the same bits whether
    its row was fed whole, in chunks, in any batch or after a prefix copied from another slot (every product on
    the row-by-row bf16 kernel, attention by `cache_attention`, the fused elementwise operators); else why not.
    Exact prefix caching needs it."""
    if model.device.type != "cpu":
        return f"on {model.device.type} the products and attention kernels depend on the batch shape"
    if model.shard is not None:
        return "tensor-parallel shards are not checked for it"
    if model.dtype != torch.float32:
        return f"activations in {model.dtype}: specserve's fused CPU operators run fp32 only"
    if model.k_cache_0.dtype not in (torch.float32, torch.bfloat16):
        return f"a {model.k_cache_0.dtype} KV cache: specserve's fused CPU operators read fp32 or bf16 ones"
    if not all(cpu_extension.op(name) for name in FUSED_OPS):
        return "specserve's fused CPU operators are not built here"
    if model.layer_shape.head_dim % 8:
        return f"head_dim {model.layer_shape.head_dim} is not a multiple of 8 (cache_attention)"
    projections = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.gate_up, layer.o,
                                                                         layer.down)]
    if any(p.packed is None for p in projections):
        return (f"{model.weight_dtype} weights: prompt chunks and steps take different matrix kernels (only bf16 "
                f"weights on a CPU with AVX512_BF16 run every product on one kernel)")
    return None


def runner_prefix_cache(mode: str, model: StaticLlama, compiled: bool) -> SlotPrefixCache | None:
    """`auto`: on where the forward is layout-invariant (exact hits); `on`: on, or an error; `off`."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"prefix_caching must be auto, on or off, got {mode!r}")
    if mode == "off":
        return None
    why = "compiled steps choose kernels by shape" if compiled else why_layout_variant(model)
    if why is None:
        return SlotPrefixCache(model.num_slots, model.move_slot)
    if mode == "on":
        raise ValueError(f"prefix_caching: on needs a layout-invariant forward (hits must give the bits a "
                         f"computed prefix gives) and this one is not: {why}; use auto or off")
    return None
