"""A slotted KV cache for many sequences of different lengths, with O(1) rollback.

Each live sequence owns a slot (a row of every layer's key/value buffer) and a valid length. A forward pass
writes the new tokens' keys/values of row b at positions lengths[b] .. lengths[b] + n - 1 of its slot;
rollback after a rejected draft is only `lengths[slot] = accepted_length` (the accepted prefix is never
recomputed, the rejected tail is overwritten by the next write). The same idea as vLLM's paged cache without
pages: the rows are contiguous per slot, and slots are kept compact so a batch over all live sequences reads a
view, not a copy.

It plugs into transformers' attention layers through the `Cache` interface (`update(key, value, layer_idx)`),
so real Hugging Face models run unchanged; the attention mask that hides other rows' padding is built by
`ModelRunner`, which also owns the slot table.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One layer's key/value buffers: [slots, kv_heads, capacity, head_dim]."""

    def __init__(self, owner: "SlotKVCache") -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        shape = (self.owner.num_slots, heads, self.owner.capacity)
        # zeros, not empty: masked positions get weight 0 in attention, and 0 * NaN would still be NaN
        self.keys = torch.zeros(*shape, key_dim, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(*shape, value_dim, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def resize(self, num_slots: int, capacity: int) -> None:
        if not self.is_initialized:
            return
        old_k, old_v = self.keys, self.values
        slots, cap = min(num_slots, old_k.shape[0]), min(capacity, old_k.shape[2])
        self.keys = old_k.new_zeros(num_slots, old_k.shape[1], capacity, old_k.shape[3])
        self.values = old_v.new_zeros(num_slots, old_v.shape[1], capacity, old_v.shape[3])
        self.keys[:slots, :, :cap] = old_k[:slots, :, :cap]
        self.values[:slots, :, :cap] = old_v[:slots, :, :cap]

    def update(
        self,
        key_states: torch.Tensor,  # [B, kv_heads, N, head_dim]
        value_states: torch.Tensor,  # [B, kv_heads, N, head_dim]
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, kv_heads, kv_len, head_dim] each
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.owner.plan
        if plan.contiguous is not None and plan.shared_start is not None:  # one block: a plain slice copy
            (lo, hi), start = plan.contiguous, plan.shared_start
            self.keys[lo:hi, :, start : start + plan.query_len] = key_states
            self.values[lo:hi, :, start : start + plan.query_len] = value_states
        else:
            slots, positions = plan.slot_index, plan.write_positions  # [B, 1], [B, N]
            self.keys[slots, :, positions] = key_states.transpose(1, 2).to(self.keys.dtype)
            self.values[slots, :, positions] = value_states.transpose(1, 2).to(self.values.dtype)
        if plan.contiguous is not None:
            lo, hi = plan.contiguous
            return self.keys[lo:hi, :, : plan.kv_len], self.values[lo:hi, :, : plan.kv_len]
        rows = plan.slot_index[:, 0]
        return self.keys[rows, :, : plan.kv_len], self.values[rows, :, : plan.kv_len]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.plan.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.plan.kv_len - self.owner.plan.query_len

    def get_max_length(self) -> int:
        return self.owner.capacity


class WritePlan:
    """Where one forward pass writes and what it reads; set by the runner before calling the model."""

    def __init__(
        self,
        slots: list[int],
        start_lengths: list[int],
        query_len: int,
        device: torch.device,
    ) -> None:
        self.query_len = query_len
        self.slot_index = torch.tensor(slots, dtype=torch.long, device=device)[:, None]  # [B, 1]
        starts = torch.tensor(start_lengths, dtype=torch.long, device=device)
        self.write_positions = starts[:, None] + torch.arange(query_len, device=device)[None, :]  # [B, N]
        self.kv_len = max(start_lengths) + query_len
        self.shared_start = start_lengths[0] if len(set(start_lengths)) == 1 else None
        lo = slots[0]
        self.contiguous = (lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None


class SlotKVCache(Cache):
    """transformers `Cache` whose layers are slot buffers; grows its slot count and capacity on demand."""

    def __init__(self, num_layers: int, num_slots: int = 4, capacity: int = 256) -> None:
        self.num_slots = num_slots
        self.capacity = capacity
        self.plan: WritePlan | None = None
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def ensure(self, num_slots: int, capacity: int) -> None:
        """Grow (doubling) so that `num_slots` slots of `capacity` positions fit."""
        if num_slots <= self.num_slots and capacity <= self.capacity:
            return
        new_slots = max(self.num_slots, 1)
        while new_slots < num_slots:
            new_slots *= 2
        new_cap = max(self.capacity, 1)
        while new_cap < capacity:
            new_cap *= 2
        self.num_slots, self.capacity = new_slots, new_cap
        for layer in self.layers:
            layer.resize(new_slots, new_cap)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.move_slot(src, dst, length)

    def nbytes(self) -> int:
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in self.layers
            if layer.is_initialized
        )
