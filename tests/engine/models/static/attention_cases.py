"""Random inputs of a decode/verify attention step, shared by the kernel tests (test_attention.py, and with trees
test_tree_kernels.py)."""

import torch

from engine.models.static.attention import RowIndex

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU: Triton's interpreter (tests/conftest.py)


def attention_case(batch, heads, kv_heads, width, dim, slots, capacity, dtype, seed=0):
    """q [B, H, W, D] (as the forward's view), K/V caches [S, KVH, C, D], and rows in distinct random slots at
    random starts, limited to their own step."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, width, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # as the forward's view
    k = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, capacity, dim, generator=gen).to(dtype)
    slot = torch.randperm(slots, generator=gen)[:batch]
    starts = torch.randint(0, capacity - width - 1, (batch,), generator=gen)
    q, k, v, slot, starts = (t.to(DEVICE) for t in (q, k, v, slot, starts))
    return q, k, v, RowIndex(slots=slot, starts=starts, limits=starts + width)
