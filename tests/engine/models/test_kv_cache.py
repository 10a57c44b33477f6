"""engine/models/kv_cache.py directly: the slotted cache writes each row's keys/values at its own positions, reads a
view of contiguous slots, moves slots, grows without losing contents, and answers transformers' Cache queries."""

from __future__ import annotations

import torch

from engine.models.kv_cache import SlotKVCache, WritePlan

HEADS, DIM = 2, 4
CPU = torch.device("cpu")


def states(batch: int, n: int, seed: int) -> torch.Tensor:  # [B, kv_heads, N, head_dim]
    return torch.randn(batch, HEADS, n, DIM, generator=torch.Generator().manual_seed(seed))


def write(cache: SlotKVCache, slots: list[int], starts: list[int], keys: torch.Tensor, layer: int = 0):
    cache.plan = WritePlan(slots, starts, keys.shape[2], CPU)
    return cache.layers[layer].update(keys, -keys)  # values = -keys, so a swap of the two would show


def test_write_plan_describes_the_pass():
    plan = WritePlan([1, 2, 3], [5, 5, 5], 2, CPU)
    assert plan.contiguous == (1, 4) and plan.shared_start == 5 and plan.kv_len == 7
    assert plan.write_positions.tolist() == [[5, 6]] * 3
    plan = WritePlan([3, 0], [2, 6], 1, CPU)
    assert plan.contiguous is None and plan.shared_start is None and plan.kv_len == 7
    assert plan.slot_index.tolist() == [[3], [0]] and plan.write_positions.tolist() == [[2], [6]]


def test_contiguous_rows_write_a_block_and_read_a_view():
    cache = SlotKVCache(num_layers=1, num_slots=4, capacity=8)
    new = states(2, 3, seed=0)
    keys, values = write(cache, [0, 1], [0, 0], new)
    assert keys.shape == (2, HEADS, 3, DIM)
    torch.testing.assert_close(keys, new)
    torch.testing.assert_close(values, -new)
    assert keys.data_ptr() == cache.layers[0].keys.data_ptr()  # a view of the buffer, not a copy


def test_rows_at_different_lengths_write_at_their_own_positions():
    cache = SlotKVCache(num_layers=1, num_slots=4, capacity=8)
    prefix = states(1, 3, seed=1)
    write(cache, [0], [0], prefix)  # slot 0 holds 3 positions
    new = states(2, 1, seed=2)
    keys, _ = write(cache, [2, 0], [0, 3], new)  # slot 2 starts, slot 0 goes on at position 3
    buffer = cache.layers[0].keys
    torch.testing.assert_close(buffer[2, :, 0], new[0, :, 0])
    torch.testing.assert_close(buffer[0, :, 3], new[1, :, 0])
    torch.testing.assert_close(buffer[0, :, :3], prefix[0])  # the prefix is untouched
    assert keys.shape == (2, HEADS, 4, DIM)  # rows in the pass's order, up to the longest row
    torch.testing.assert_close(keys[1, :, :3], prefix[0])


def test_rollback_is_an_overwrite_of_the_rejected_tail():
    cache = SlotKVCache(num_layers=1, num_slots=1, capacity=8)
    write(cache, [0], [0], states(1, 5, seed=3))  # 2 prompt tokens + 3 drafts
    accepted = cache.layers[0].keys[0, :, :3].clone()
    correction = states(1, 1, seed=4)
    write(cache, [0], [3], correction)  # drafts 2 and 3 rejected: the next token goes where draft 2 was
    torch.testing.assert_close(cache.layers[0].keys[0, :, :3], accepted)
    torch.testing.assert_close(cache.layers[0].keys[0, :, 3], correction[0, :, 0])


def test_move_slot_copies_a_prefix_on_every_layer():
    cache = SlotKVCache(num_layers=2, num_slots=4, capacity=8)
    for layer in range(2):
        write(cache, [0, 1, 2, 3], [0, 0, 0, 0], states(4, 5, seed=10 + layer), layer=layer)
    before = [cache.layers[layer].keys[3, :, :4].clone() for layer in range(2)]
    cache.move_slot(3, 1, 4)
    for layer in range(2):
        torch.testing.assert_close(cache.layers[layer].keys[1, :, :4], before[layer])
        torch.testing.assert_close(cache.layers[layer].values[1, :, :4], -before[layer])


def test_the_cache_grows_by_doubling_and_keeps_its_contents():
    cache = SlotKVCache(num_layers=1, num_slots=2, capacity=4)
    new = states(2, 4, seed=5)
    write(cache, [0, 1], [0, 0], new)
    small = cache.nbytes()
    assert small == 2 * (2 * HEADS * 4 * DIM) * 4  # keys and values, float32
    cache.ensure(3, 9)
    assert (cache.num_slots, cache.capacity) == (4, 16)
    assert cache.layers[0].keys.shape == (4, HEADS, 16, DIM) and cache.nbytes() == small * 8
    torch.testing.assert_close(cache.layers[0].keys[:2, :, :4], new)
    cache.ensure(2, 4)  # already big enough: nothing changes
    assert (cache.num_slots, cache.capacity) == (4, 16)


def test_transformers_cache_queries_follow_the_plan():
    cache = SlotKVCache(num_layers=1, num_slots=2, capacity=8)
    write(cache, [0, 1], [3, 1], states(2, 2, seed=6))
    layer = cache.layers[0]
    assert layer.get_mask_sizes(2) == (5, 0)  # keys the pass attends over
    assert layer.get_seq_length() == 3  # positions before the new tokens (the longest row's)
    assert layer.get_max_length() == 8
