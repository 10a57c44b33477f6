"""Token trees in the graph step's kernels (Triton; on a CPU in its interpreter) and inputs: attention over each node's
own path (`RowIndex.ancestors`) against the reference, the reference against attention over the path's keys copied
contiguously, chain masks against the causal kernel; RoPE at each node's depth with its key written at its step
index (`RowIndex.depths`); the graphs' staging buffer with and without trees."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from engine.models.static import attention, fused_ops
from engine.models.static.attention import RowIndex, cache_attention, reference_attention
from engine.models.static.cuda_graphs import GraphSteps, Staging, chain_ancestors, chain_depths
from tests.engine.models.static.attention_cases import DEVICE, attention_case

FP32 = {"atol": 2e-6, "rtol": 2e-5}  # test_attention.py's tolerances
BF16 = {"atol": 2e-2, "rtol": 1e-2}


@pytest.fixture
def interpreted():
    """The Triton kernels run here: on a GPU, or on the CPU in Triton's interpreter."""
    pytest.importorskip("triton")
    if not attention.available():
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET unset)")


def random_tree(width: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(depths, ancestor bitmasks) of a random tree of `width` nodes in topological order (node 0 the root)."""
    depths, masks = [0], [1]
    for w in range(1, width):
        parent = rng.randrange(w)
        depths.append(depths[parent] + 1)
        masks.append(masks[parent] | (1 << w))
    return depths, masks


def chain(width: int) -> tuple[list[int], list[int]]:
    return chain_depths(width), chain_ancestors(width)


def _trees(batch: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # depths, ancestors [B, W]
    """Row 0 a chain, the others random trees (different per row)."""
    rng = random.Random(seed)
    shapes = [chain(width)] + [random_tree(width, rng) for _ in range(batch - 1)]
    depths = torch.tensor([d for d, _ in shapes], dtype=torch.long, device=DEVICE)
    return depths, torch.tensor([m for _, m in shapes], dtype=torch.long, device=DEVICE)


def _case(batch, heads, kv_heads, width, dim, slots, capacity, dtype, seed=0):
    """test_attention.py's case, its rows given trees."""
    q, k, v, rows = attention_case(batch, heads, kv_heads, width, dim, slots, capacity, dtype, seed)
    depths, ancestors = _trees(batch, width, seed)
    return q, k, v, dataclasses.replace(rows, depths=depths, ancestors=ancestors)


def _chain_rows(rows: RowIndex) -> RowIndex:
    return RowIndex(slots=rows.slots, starts=rows.starts, limits=rows.limits)


@pytest.mark.parametrize("shape, splits", [
    ((3, 4, 2, 5, 16, 4, 200), 2),  # groups of 2
    ((3, 6, 2, 8, 32, 3, 300), 3),  # groups of 3, a head size below a power of two
    ((4, 8, 2, 16, 64, 4, 400), 4),  # the widest step: 4 x 16 queries per program
    ((2, 4, 4, 16, 24, 2, 130), 1),  # no GQA, one split
    ((2, 4, 2, 2, 8, 2, 100), 2),  # a root and one draft node, the tiny models' head size
])
def test_tree_kernel_matches_the_reference(interpreted, shape, splits):
    q, k, v, rows = _case(*shape, dtype=torch.float32, seed=shape[3])
    got = cache_attention(q, k, v, rows, 0.3, splits=splits)
    torch.testing.assert_close(got, reference_attention(q, k, v, rows, 0.3), **FP32)


def test_tree_kernel_with_bf16_inputs_within_bf16_precision(interpreted):
    q, k, v, rows = _case(3, 8, 2, 7, 64, 4, 256, torch.bfloat16, seed=5)
    got = cache_attention(q, k, v, rows, 0.125, splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_attention(q, k, v, rows, 0.125).float(), **BF16)


def test_tree_kernel_reads_transposed_masks_limits_and_padding_rows(interpreted):
    """Masks as a graph's staging view ([rows, width] of a [width, rows] buffer), a limit inside the step (it cuts
    the step's last keys), and a padding row (limit 0: zeros); every key a row may not read is NaN."""
    q, k, v, rows = _case(3, 4, 2, 6, 32, 5, 260, torch.float32, seed=3)
    limits = torch.stack([rows.starts[0] + 4, torch.zeros_like(rows.starts[1]), rows.limits[2]])
    staged = rows.ancestors.t().contiguous().t()
    assert staged.stride() == (1, 3)
    rows = RowIndex(slots=rows.slots, starts=rows.starts, limits=limits, ancestors=staged)
    want = reference_attention(q, k, v, rows, 0.2)
    poisoned_k, poisoned_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for b in range(3):
        s, limit = int(rows.slots[b]), int(rows.limits[b])
        poisoned_k[s, :, :limit], poisoned_v[s, :, :limit] = k[s, :, :limit], v[s, :, :limit]
    got = cache_attention(q, poisoned_k, poisoned_v, rows, 0.2, splits=3)
    torch.testing.assert_close(got, want, **FP32)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert not torch.equal(want[0], reference_attention(q, k, v, RowIndex(
        slots=rows.slots, starts=rows.starts, limits=rows.starts + 6, ancestors=staged), 0.2)[0])  # the limit cut


def test_a_node_sees_exactly_its_path_among_the_steps_keys(interpreted):
    """Changing the key and value at step index j changes the nodes with bit j (j's descendants and j itself), and
    leaves every other node's output bit for bit."""
    q, k, v, rows = _case(2, 4, 2, 12, 16, 2, 150, torch.float32, seed=11)
    before = cache_attention(q, k, v, rows, 0.4, splits=2)
    for j in (0, 3, 11):
        k2, v2 = k.clone(), v.clone()
        for b in range(2):
            s, start = int(rows.slots[b]), int(rows.starts[b])
            k2[s, :, start + j] += 3.0
            v2[s, :, start + j] -= 5.0
        after = cache_attention(q, k2, v2, rows, 0.4, splits=2)
        for b in range(2):
            for w in range(12):
                sees = bool((int(rows.ancestors[b, w]) >> j) & 1)
                assert torch.equal(after[b, :, w], before[b, :, w]) != sees, (b, w, j)


def test_chain_masks_give_the_causal_kernels_output(interpreted):
    q, k, v, rows = _case(3, 6, 3, 9, 32, 3, 300, torch.float32, seed=2)
    chained = RowIndex(slots=rows.slots, starts=rows.starts, limits=rows.limits,
                       ancestors=torch.tensor([chain_ancestors(9)] * 3, device=DEVICE))
    causal = _chain_rows(rows)
    want = cache_attention(q, k, v, causal, 0.3, splits=2)
    torch.testing.assert_close(cache_attention(q, k, v, chained, 0.3, splits=2), want, atol=0, rtol=0)
    torch.testing.assert_close(reference_attention(q, k, v, chained, 0.3), reference_attention(q, k, v, causal, 0.3),
                               atol=0, rtol=0)
    torch.testing.assert_close(want, reference_attention(q, k, v, causal, 0.3), **FP32)


def test_the_tree_reference_is_attention_over_each_nodes_path_copied_contiguously():
    """Node w of a tree row attends as the last token of a chain whose keys are the row's committed keys then its
    path's (the ancestors' in order, itself last)."""
    q, k, v, rows = _case(3, 4, 2, 10, 16, 3, 64, torch.float32, seed=7)
    got = reference_attention(q, k, v, rows, 0.25)
    for b in range(3):
        s, start = int(rows.slots[b]), int(rows.starts[b])
        for w in range(10):
            path = [j for j in range(10) if (int(rows.ancestors[b, w]) >> j) & 1]
            assert path[-1] == w and len(path) == int(rows.depths[b, w]) + 1
            keep = list(range(start)) + [start + j for j in path]
            length = len(keep)
            k_path, v_path = k[s : s + 1, :, keep], v[s : s + 1, :, keep]  # [1, KVH, L, D]
            one = RowIndex(slots=torch.tensor([0], device=DEVICE), starts=torch.tensor([length - 1], device=DEVICE),
                           limits=torch.tensor([length], device=DEVICE))
            want = reference_attention(q[b : b + 1, :, w : w + 1], k_path, v_path, one, 0.25)
            torch.testing.assert_close(got[b, :, w], want[0, :, 0], atol=1e-5, rtol=1e-5)


def test_without_triton_the_tree_reference_runs(monkeypatch):
    monkeypatch.setattr(attention, "triton", None)
    q, k, v, rows = _case(2, 4, 2, 5, 16, 2, 100, torch.float32)
    assert not attention.available()
    torch.testing.assert_close(cache_attention(q, k, v, rows, 0.5), reference_attention(q, k, v, rows, 0.5))


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (6, 6, 24)])
def test_rope_rotates_each_node_at_its_depth_and_writes_it_at_its_step_index(interpreted, heads, kv_heads, dim):
    """q: the chain kernel's q at positions starts + depths (each node fed alone at that position); the cache: node
    w's key at starts + w, holding the chain kernel's key at starts + depths; values at starts + w; nothing else."""
    batch, width, slots, capacity = 3, 7, 5, 40
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, width, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE)
    cos, sin = (torch.randn(capacity, dim, generator=gen).to(DEVICE) for _ in range(2))
    depths, ancestors = _trees(batch, width, seed=4)
    staged = depths.t().contiguous().t()  # as a graph's staging view
    starts = torch.tensor([0, 7, 30], device=DEVICE)
    rows = RowIndex(slots=torch.tensor([4, 0, 2], device=DEVICE), starts=starts, limits=starts + width,
                    depths=staged, ancestors=ancestors)
    k_cache = torch.full((slots, kv_heads, capacity, dim), 7.0, device=DEVICE)
    v_cache = torch.full_like(k_cache, 9.0)
    q = fused_ops.rope_to_cache(qkv, cos, sin, rows, k_cache, v_cache, heads, kv_heads)

    # the chain kernel, each node its own row of width 1 at position starts + depth, in its own scratch slot
    nodes = batch * width
    rotate_at = (starts[:, None] + depths).reshape(nodes)
    alone = RowIndex(slots=torch.arange(nodes, device=DEVICE), starts=rotate_at, limits=rotate_at + 1)
    k_alone = torch.zeros(nodes, kv_heads, capacity, dim, device=DEVICE)
    v_alone = torch.zeros_like(k_alone)
    q_alone = fused_ops.rope_to_cache(qkv.reshape(nodes, 1, -1), cos, sin, alone, k_alone, v_alone, heads, kv_heads)
    assert q.shape == (batch, heads, width, dim)
    torch.testing.assert_close(q, q_alone.reshape(batch, width, heads, dim).transpose(1, 2), atol=0, rtol=0)
    written = torch.zeros(slots, capacity, dtype=torch.bool, device=DEVICE)
    for b in range(batch):
        slot, start = int(rows.slots[b]), int(starts[b])
        for w in range(width):
            node, at = b * width + w, int(rotate_at[b * width + w])
            written[slot, start + w] = True
            assert torch.equal(k_cache[slot, :, start + w], k_alone[node, :, at])
            assert torch.equal(v_cache[slot, :, start + w], v_alone[node, :, at])
    assert bool((k_cache.permute(0, 2, 1, 3)[~written] == 7.0).all())  # nothing else in the cache changed
    assert bool((v_cache.permute(0, 2, 1, 3)[~written] == 9.0).all())

    chained = fused_ops.rope_to_cache(qkv, cos, sin, RowIndex(slots=rows.slots, starts=starts, limits=rows.limits,
                                                              depths=torch.tensor([chain_depths(width)] * batch,
                                                                                  device=DEVICE)),
                                      k_cache.clone(), v_cache.clone(), heads, kv_heads)
    causal = fused_ops.rope_to_cache(qkv, cos, sin, _chain_rows(rows), k_cache.clone(), v_cache.clone(), heads,
                                     kv_heads)
    torch.testing.assert_close(chained, causal, atol=0, rtol=0)  # a chain's depths: the chain kernel


def test_staging_fills_chains_and_trees():
    staging = Staging(max_rows=4, max_width=5, device=torch.device("cpu"))
    assert staging.device_buffer.shape == (3 + 3 * 5, 4)
    staging.fill(3, 4, [2, 0], [10, 20], [[5, 6, 7], [8]], scratch_start=100,
                 depths=[[0, 1, 1], None], ancestors=[[1, 3, 5], None])
    tokens, rows = staging.views(3, 4)
    assert tokens.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]]
    assert rows.slots.tolist() == [2, 0, 0] and rows.starts.tolist() == [10, 20, 100]
    assert rows.limits.tolist() == [14, 24, 0]
    # the tree's unlisted last position, the chain row and the padding row: a chain's depths and masks
    assert rows.depths.shape == rows.ancestors.shape == (3, 4)
    assert rows.depths.tolist() == [[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert rows.ancestors.tolist() == [[1, 3, 5, 15], [1, 3, 7, 15], [1, 3, 7, 15]]
    buf = staging.device_buffer  # the layout: tokens, then max_width depth rows, then max_width mask rows
    assert buf[3 + 5 : 3 + 5 + 4, 0].tolist() == [0, 1, 1, 3] and buf[3 + 10 : 3 + 10 + 4, 0].tolist() == [1, 3, 5, 15]

    staging.fill(2, 5, [1], [7], [[4, 4, 4, 4, 4]], scratch_start=100)  # a chain step after a tree step
    tokens, rows = staging.views(2, 5)
    assert tokens.tolist() == [[4] * 5, [0] * 5] and rows.limits.tolist() == [12, 0]
    assert rows.depths.tolist() == [chain_depths(5)] * 2
    assert rows.ancestors.tolist() == [chain_ancestors(5)] * 2 == [[1, 3, 7, 15, 31]] * 2

    staging.fill(4, 5, [], [], [], scratch_start=100)  # a capture's padding rows only
    _, rows = staging.views(4, 5)
    assert rows.limits.tolist() == [0] * 4 and rows.depths.tolist() == [chain_depths(5)] * 4


def test_graph_steps_pass_trees_to_the_staging_buffer():
    """An uncaptured shape runs forward_rows eagerly on the staging views: the tree's depths and masks reach it."""
    seen = []
    model = SimpleNamespace(device=torch.device("cpu"),
                            forward_rows=lambda tokens, rows, layers: seen.append((tokens.clone(), rows)) or "out")
    steps = GraphSteps(model, max_rows=2, max_width=4, scratch_start=50)
    assert steps.step([1], [3], [[9, 8, 7]], 2, 4, depths=[[0, 1, 1]], ancestors=[[1, 3, 5]]) == "out"
    tokens, rows = seen[-1]
    assert tokens.tolist() == [[9, 8, 7, 0], [0, 0, 0, 0]]
    assert rows.depths.tolist() == [[0, 1, 1, 3], [0, 1, 2, 3]]
    assert rows.ancestors.tolist() == [[1, 3, 5, 15], [1, 3, 7, 15]]
    steps.step([1], [3], [[9, 8]], 2, 2)
    assert seen[-1][1].ancestors.tolist() == [[1, 3]] * 2


def test_a_graph_steps_tree_gives_each_node_its_paths_logits(interpreted):
    """forward_rows over the staging buffer's views (what a captured graph runs: Triton RoPE and attention reading
    the tree from the RowIndex) gives each node the logits of decoding its path as a chain, as the eager tree step
    does; a chain row beside it gives the chain step's."""
    from engine.models.static.forward import StaticLlama
    from tests.conftest import make_tiny_model

    model = StaticLlama(make_tiny_model("llama", seed=1).to(DEVICE), num_slots=4, capacity=48, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompt, nodes = torch.randint(2, 64, (1, 9), generator=gen), torch.randint(2, 64, (2, 6), generator=gen)
    depths, masks = random_tree(6, random.Random(3))
    staging = Staging(max_rows=3, max_width=8, device=torch.device(DEVICE))
    with torch.inference_mode():
        for slot in range(4):
            model.forward(prompt.to(DEVICE), torch.tensor([0], device=DEVICE), slot, 16)
        staging.fill(3, 8, [1, 2], [9, 9], nodes.tolist(), scratch_start=32, depths=[depths, None],
                     ancestors=[masks, None])
        got = model.forward_rows(*staging.views(3, 8))  # [3, 8, V]
        chain_step = model.forward(nodes[1:].to(DEVICE), torch.tensor([9], device=DEVICE), 0, 32)
        torch.testing.assert_close(got[1, :6], chain_step[0], atol=1e-4, rtol=1e-4)
        for w in range(6):
            path = [j for j in range(6) if masks[w] >> j & 1]
            decoded = model.forward(nodes[:1, path].to(DEVICE), torch.tensor([9], device=DEVICE), 3, 32)
            torch.testing.assert_close(got[0, w], decoded[0, -1], atol=1e-4, rtol=1e-4)
