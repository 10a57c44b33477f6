"""layer_ops.cpp's token-tree step: `cache_attention(..., ancestors)` scores each node over the committed keys and its
own path's, the same bits plain decoding of that path computes (the contiguous keys, one query at its depth), for fp32
and bf16 caches; `rope_to_cache(..., rope_positions)` rotates each node at its depth while writing it at its own
slot; malformed ancestors are refused."""

import random

import pytest
import torch

from engine.models.cpu import extension as cpu_extension
from tests.engine.models.cpu.test_extension import rope_inputs
from tests.engine.models.cpu.test_pool import on_threads


@pytest.fixture(scope="module")
def ops():
    attention, rope = cpu_extension.op("cache_attention"), cpu_extension.op("rope_to_cache")
    if attention is None or rope is None:
        pytest.skip(f"the CPU operators are unavailable: {cpu_extension.why_unavailable()}")
    return attention, rope


def chain(width):
    return [-1] + list(range(width - 1))


def star(width):
    return [-1] + [0] * (width - 1)


def random_tree(width, seed):
    rng = random.Random(seed)
    return [-1] + [rng.randrange(w) for w in range(1, width)]


def ancestors_of(parents):
    """parents (topological: parents[w] < w, the root -1) -> each node's ancestors-or-self bitmask."""
    masks = []
    for w, parent in enumerate(parents):
        masks.append((masks[parent] if parent >= 0 else 0) | (1 << w))
    return masks


def path_of(mask):
    return [j for j in range(63) if mask >> j & 1]


def depths_of(parents):
    depths = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths


def plain_path_attention(attention, q_node, k_cache, v_cache, slot, scratch, start, path, scale):
    """What plain decoding of the path computes for its last node: the committed keys [0, start) and the path's keys
    copied contiguously into `scratch`, one query at position start + len(path) - 1, the op without ancestors."""
    for cache in (k_cache, v_cache):
        cache[scratch, :, :start] = cache[slot, :, :start]
        cache[scratch, :, start : start + len(path)] = cache[slot, :, [start + j for j in path]]
    position = start + len(path) - 1
    return attention(q_node, k_cache, v_cache, scratch, torch.tensor([[position]]), position + 1, scale)[0, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("dim", [8, 16, 64])
def test_a_tree_node_is_the_same_bits_as_plain_decoding_of_its_path(ops, dtype, group, dim):
    attention, _ = ops
    width, kv_heads = 16, 2
    heads = kv_heads * group
    trees = [chain(width), star(width), random_tree(width, dim + group), random_tree(width, 99)]
    starts = [0, 5, 100, 37]
    batch, first_slot, capacity = len(trees) + 1, 1, 160  # the last row: a padding row
    scratch = first_slot + batch  # the slot the references' contiguous keys go to
    generator = torch.Generator().manual_seed(dim * 10 + group)
    k_cache = torch.randn(scratch + 1, kv_heads, capacity, dim, generator=generator).to(dtype)
    v_cache = torch.randn(scratch + 1, kv_heads, capacity, dim, generator=generator).to(dtype)
    q = torch.randn(batch, heads, width, dim, generator=generator)
    kv_len = max(starts) + width
    positions = torch.tensor([[start] for start in starts] + [[0]]) + torch.arange(width)
    positions[-1] = capacity - 1  # a padding row: every position past every real key
    masks = [ancestors_of(parents) for parents in trees] + [[(2 << w) - 1 for w in range(width)]]
    ancestors = torch.tensor(masks)
    scale = dim ** -0.5

    got = on_threads(2, lambda: attention(q, k_cache, v_cache, first_slot, positions, kv_len, scale, ancestors))
    alone = on_threads(1, lambda: attention(q, k_cache, v_cache, first_slot, positions, kv_len, scale, ancestors))
    assert torch.equal(got, alone), "the threads' split changes nothing"
    assert got[-1].isfinite().all()  # the padding row reads kv_len committed keys, its output unused
    for b, (start, row_masks) in enumerate(zip(starts, masks)):
        for w, mask in enumerate(row_masks):
            want = plain_path_attention(attention, q[b : b + 1, :, w : w + 1].contiguous(), k_cache, v_cache,
                                        first_slot + b, scratch, start, path_of(mask), scale)
            assert torch.equal(got[b, :, w], want), (b, w, path_of(mask))
    row = attention(q[2:3].contiguous(), k_cache, v_cache, first_slot + 2, positions[2:3].contiguous(), kv_len, scale,
                    ancestors[2:3].contiguous())
    assert torch.equal(row[0], got[2]), "a row's nodes do not depend on the rows beside it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "width", "dim"), [(9, 3, 1, 64), (4, 2, 5, 16), (6, 2, 13, 8)])
def test_a_causal_mask_gives_the_plain_operator_s_bits(ops, dtype, heads, kv_heads, width, dim):
    attention, _ = ops
    batch, first_slot, capacity, kv_len = 3, 1, 64, 48
    k_cache = torch.randn(5, kv_heads, capacity, dim).to(dtype)
    v_cache = torch.randn(5, kv_heads, capacity, dim).to(dtype)
    q = torch.randn(batch, heads, width, dim)
    positions = torch.tensor([[5], [0], [kv_len - width]]) + torch.arange(width)
    positions[1] = 60  # a padding row: reads kv_len keys either way
    causal = torch.tensor([[(2 << w) - 1 for w in range(width)]] * batch)
    for threads in (1, 2):
        plain = on_threads(threads, lambda: attention(q, k_cache, v_cache, first_slot, positions, kv_len, 0.3))
        tree = on_threads(threads, lambda: attention(q, k_cache, v_cache, first_slot, positions, kv_len, 0.3,
                                                       causal))
        assert torch.equal(tree, plain), threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_positions_rotate_at_the_depth_and_write_at_the_node_s_slot(ops, dtype):
    _, rope = ops
    heads, kv_heads, width, dim, first_slot, capacity = 6, 2, 7, 16, 1, 40
    qkv, cos, sin, positions, (k_cache, v_cache) = rope_inputs(heads, kv_heads, width, dim, 5, capacity, 30)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    trees = [random_tree(width, 3), star(width), chain(width)]
    rope_positions = positions[:, :1] + torch.tensor([depths_of(parents) for parents in trees])
    k_got, v_got = k_cache.clone(), v_cache.clone()

    q = rope(qkv, cos, sin, positions, k_got, v_got, first_slot, heads, kv_heads, rope_positions)

    k_want, v_want = k_cache.clone(), v_cache.clone()
    for w in range(width):  # each node alone, rotated and written at its depth position in fresh caches
        k_node, v_node = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        at = rope_positions[:, w : w + 1].contiguous()
        q_node = rope(qkv[:, w : w + 1].contiguous(), cos, sin, at, k_node, v_node, first_slot, heads, kv_heads)
        assert torch.equal(q[:, :, w : w + 1], q_node), w
        for b in range(3):
            slot = first_slot + b
            k_want[slot, :, positions[b, w]] = k_node[slot, :, at[b, 0]]
            v_want[slot, :, positions[b, w]] = v_node[slot, :, at[b, 0]]
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)  # written at positions, nothing else touched
    k_plain, v_plain = k_cache.clone(), v_cache.clone()
    plain = rope(qkv, cos, sin, positions, k_plain, v_plain, first_slot, heads, kv_heads)
    same = rope(qkv, cos, sin, positions, k_cache, v_cache, first_slot, heads, kv_heads, positions)
    assert torch.equal(same, plain) and torch.equal(k_cache, k_plain) and torch.equal(v_cache, v_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_step_scores_each_node_as_decoding_its_path(ops, dtype):
    """The two together: a tree step's nodes RoPE'd at their depths into the cache and attended over their paths give
    the bits that feeding each path token by token (plain positions, a contiguous slot) gives its last node."""
    attention, rope = ops
    heads, kv_heads, width, dim, capacity, start = 6, 2, 9, 16, 48, 11
    qkv, cos, sin, _, (k_cache, v_cache) = rope_inputs(heads, kv_heads, width, dim, 2, capacity, 0)
    qkv, k_cache, v_cache = qkv[:1].contiguous(), k_cache.to(dtype), v_cache.to(dtype)
    parents = random_tree(width, 5)
    masks = ancestors_of(parents)
    positions = start + torch.arange(width)[None]
    rope_positions = start + torch.tensor([depths_of(parents)])
    q = rope(qkv, cos, sin, positions, k_cache, v_cache, 0, heads, kv_heads, rope_positions)
    got = attention(q, k_cache, v_cache, 0, positions, start + width, dim ** -0.5, torch.tensor([masks]))
    for w, mask in enumerate(masks):
        path = path_of(mask)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()  # slot 1: the committed keys, then the path fed plainly
        k_ref[1, :, :start], v_ref[1, :, :start] = k_cache[0, :, :start], v_cache[0, :, :start]
        at = start + torch.arange(len(path))[None]
        q_path = rope(qkv[:, path].contiguous(), cos, sin, at, k_ref, v_ref, 1, heads, kv_heads)
        want = attention(q_path[:, :, -1:].contiguous(), k_ref, v_ref, 1, at[:, -1:].contiguous(), start + len(path),
                         dim ** -0.5)
        assert torch.equal(got[0, :, w], want[0, :, 0]), (w, path)


@pytest.mark.parametrize(("ancestors", "message"), [
    (torch.tensor([[1, 3, 7 | 8]]), "bit above 2"),
    (torch.tensor([[1, 1, 5]]), r"ancestors\[0, 1\] must hold bit 1"),
    (torch.tensor([[1, 3, -1]]), "bit above 2"),
    (torch.tensor([[1, 3]]), r"\[B, W\]"),
    (torch.tensor([[1, 3, 7]], dtype=torch.int32), "int64"),
    (torch.tensor([[1, 3, 7], [1, 3, 7]]).t().contiguous().t(), "contiguous"),
])
def test_malformed_ancestors_are_refused(ops, ancestors, message):
    attention, _ = ops
    q, cache = torch.randn(1, 2, 3, 8), torch.zeros(1, 1, 16, 8)
    positions = torch.tensor([[4, 5, 6]])
    with pytest.raises(RuntimeError, match=message):
        attention(q, cache, cache.clone(), 0, positions, 7, 0.3, ancestors)


def test_a_tree_step_has_at_most_63_nodes(ops):
    attention, _ = ops
    q, cache = torch.randn(1, 1, 64, 8), torch.zeros(1, 1, 128, 8)
    positions = torch.arange(64)[None]
    causal = torch.tensor([[(2 << w) - 1 for w in range(62)] + [-1, -1]])
    with pytest.raises(RuntimeError, match="at most 63"):
        attention(q, cache, cache.clone(), 0, positions, 64, 0.3, causal)


def test_rope_positions_past_the_tables_are_refused(ops):
    _, rope = ops
    qkv, table = torch.randn(1, 2, 3 * 8), torch.ones(10, 8)
    cache = torch.zeros(2, 1, 16, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        rope(qkv, table, table, torch.tensor([[3, 4]]), cache, cache.clone(), 0, 1, 1, torch.tensor([[3, 10]]))
    with pytest.raises(RuntimeError, match="rope_positions must be"):
        rope(qkv, table, table, torch.tensor([[3, 4]]), cache, cache.clone(), 0, 1, 1, torch.tensor([[3]]))
