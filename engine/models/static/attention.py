"""Attention of decode and verify steps over the slotted KV cache, reading each row's length from device tensors.

A CUDA graph replays fixed shapes, so the key length cannot be a shape: a graph per key-length bucket (what
`torch.compile(mode="reduce-overhead")` captured) multiplies capture time and reads every row's padding up to the
bucket. Here each row's slot, start position and key limit are device tensors, and the kernel loops over that row's
keys only: one graph per (batch bucket, width) serves every context length up to `max_model_len`, as vLLM's and
SGLang's decode-attention kernels do.

The kernel is flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): a row's keys are cut
into `splits` parts computed by separate programs (so a batch of one still fills the GPU), each keeping the online
softmax of FlashAttention (Dao et al. 2022, arXiv 2205.14135) over its blocks; a second kernel combines the parts
by their log-sum-exp. One program takes a GQA group's queries (its heads x the step's width) against one key/value
head, so each key block is read once for the group, and its products run as matrix products.

Queries see causally: query w of row b sees keys t < min(starts[b] + w + 1, limits[b]). A token tree's step
(engine/spec/tree.py: several draft continuations verified in one pass) gives each row's ancestor bitmasks instead
(`RowIndex.ancestors`): query w sees the committed keys t < starts[b] and the step's keys starts[b] + j for the set bits
j of ancestors[b, w] (its own path), below limits[b]; a chain's masks (2 << w) - 1 are the causal mask. The kernel
takes that branch only where masks are given (`TREE`, a compile-time flag: the chain kernel is unchanged). A padding
row of a graph's bucket has limit 0 (it reads nothing and returns zeros). Triton ships with CUDA builds of torch; on a
CPU its interpreter (`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors, which is how the tests check them
against `reference_attention`. Where Triton is missing the reference runs instead (it reads the whole slot: correct,
slower).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

triton = tl = None  # imported on first use (`_import_triton`): a CPU worker never pays for it


@functools.cache
def _import_triton() -> bool:
    """Import Triton once; False where it is missing (CPU builds of torch come without it: the reference runs)."""
    global triton, tl
    try:
        import triton as triton_module
        import triton.language as language
    except ImportError:
        return False
    triton, tl = triton_module, language
    return True

BLOCK_N = 64  # keys per inner block


@dataclass(frozen=True)
class RowIndex:
    """Where a step's rows live, as device tensors (the static buffers a captured graph reads at replay)."""

    slots: torch.Tensor  # [B] int64: row b's KV-cache slot
    starts: torch.Tensor  # [B] int64: tokens already in row b's slot (the position of its first new token)
    limits: torch.Tensor  # [B] int64: keys row b may attend to at most (start + W; 0 for a bucket's padding row)
    # a token tree's step (engine/spec/tree.py); None: a chain (depths[b, w] = w, ancestors[b, w] = (2 << w) - 1)
    depths: torch.Tensor | None = None  # [B, W] int64: node w's depth below the root (node 0): RoPE at start + depth
    ancestors: torch.Tensor | None = None  # [B, W] int64: bit j set = step token j is node w's ancestor or itself


def reference_attention(
    q: torch.Tensor,  # [B, H, W, D]
    k_cache: torch.Tensor,  # [S, KVH, C, D]
    v_cache: torch.Tensor,  # [S, KVH, C, D]
    rows: RowIndex,
    scale: float,
) -> torch.Tensor:  # [B, H, W, D]
    """The kernel's meaning in torch operators (GQA without repeating keys), computed in float32: causal, or each
    tree node over the committed keys and its own path (`rows.ancestors`)."""
    batch, heads, width, dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    groups = heads // kv_heads
    slots, starts, limits = rows.slots, rows.starts, rows.limits
    keys = k_cache[slots].float()  # [B, KVH, C, D]
    values = v_cache[slots].float()
    t = torch.arange(capacity, device=q.device)
    if rows.ancestors is None:
        positions = starts[:, None] + torch.arange(width, device=q.device)[None, :]  # [B, W]
        seen = t[None, None, :] <= positions[:, :, None]  # [B, W, C]
    else:
        offset = t[None, :] - starts[:, None]  # [B, C]: a key's index among the step's tokens
        in_step = ((offset >= 0) & (offset < width))[:, None, :]  # [B, 1, C]
        bits = (rows.ancestors[:, :, None] >> offset.clamp(0, 62)[:, None, :]) & 1  # [B, W, C]
        seen = (offset < 0)[:, None, :] | (in_step & (bits == 1))
    visible = seen & (t[None, None, :] < limits[:, None, None])  # [B, W, C]
    qg = q.float().reshape(batch, kv_heads, groups, width, dim)
    scores = torch.einsum("bkgwd,bktd->bkgwt", qg, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # a row that sees no key: zeros
    out = torch.einsum("bkgwt,bktd->bkgwd", probs, values)
    return out.reshape(batch, heads, width, dim).to(q.dtype)


def available() -> bool:
    """Whether the Triton kernel can run here: Triton with a GPU, or its interpreter (`TRITON_INTERPRET=1`)."""
    return (torch.cuda.is_available() or _interpreting()) and _import_triton() and triton is not None


def _interpreting() -> bool:
    """Triton's CPU interpreter: its bf16 matrix products are wrong (triton 3.9), so there the kernel takes its
    float32 branch (the bf16 tensor-core branch runs on GPUs only: tests/engine/models/static/test_runner_cuda.py)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def num_splits(batch: int, kv_heads: int, capacity: int, device: torch.device) -> int:
    """Key splits per (row, KV head): enough programs to cover the device's multiprocessors about twice, at most
    one split per 4 key blocks of the slot, at least 1. Fixed per captured graph (a shape), while the keys each
    split reads follow the row's length at replay."""
    if device.type != "cuda":
        return min(4, max(1, capacity // (4 * BLOCK_N)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(2 * sms / max(1, batch * kv_heads))
    return max(1, min(want, capacity // (4 * BLOCK_N), 64))


def cache_attention(
    q: torch.Tensor,  # [B, H, W, D]
    k_cache: torch.Tensor,  # [S, KVH, C, D]
    v_cache: torch.Tensor,  # [S, KVH, C, D]
    rows: RowIndex,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:  # [B, H, W, D]
    """Causal (or tree: `rows.ancestors`) GQA attention of a step's queries over their rows' cached keys (the
    module docstring). Allocates
    only its outputs and scratch (inside a graph: from the graph's pool); never reads a device value on the host."""
    if not available():
        return reference_attention(q, k_cache, v_cache, rows, scale)
    batch, heads, width, dim = q.shape
    slot_count, kv_heads, capacity, cache_dim = k_cache.shape
    assert cache_dim == dim and v_cache.shape == k_cache.shape and heads % kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    groups = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(groups * width))
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot takes inner sizes of 16 and up
    splits = splits or num_splits(batch, kv_heads, capacity, q.device)
    part_out = torch.empty(batch, kv_heads, splits, block_m, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, kv_heads, splits, block_m, dtype=torch.float32, device=q.device)
    # written as [B, W, H, D] (the layout the output projection reads: its caller's transpose is then a view)
    out = torch.empty(batch, width, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    tree = rows.ancestors is not None
    if tree:  # [B, W] int64, any strides (a graph's staging view is transposed)
        assert rows.ancestors.shape == (batch, width) and rows.ancestors.dtype == torch.int64
        assert width <= 63, "ancestor bitmasks hold up to 63 step tokens"
    masks = rows.ancestors if tree else rows.starts  # the chain kernel never reads it
    _kernels()[0][(batch, kv_heads, splits)](
        q, k_cache, v_cache, rows.slots, rows.starts, rows.limits, masks, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        masks.stride(0), masks.stride(1) if tree else 0,
        scale, width, dim,
        GROUPS=groups, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32 or _interpreting(), TREE=tree)
    _kernels()[1][(batch, kv_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), out.stride(2), width, dim,
        GROUPS=groups, SPLITS=splits, BLOCK_M=block_m, BLOCK_D=block_d)
    return out


@functools.cache
def _kernels():
    """The two Triton kernels, defined on first use (importing this module must not need Triton)."""

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, starts_ptr, limits_ptr, masks_ptr, part_out_ptr, part_lse_ptr,
                     q_sb, q_sh, q_sw, c_ss, c_sh, c_st, m_sb, m_sw, scale, width, dim,
                     GROUPS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, IEEE: tl.constexpr, TREE: tl.constexpr):
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + b)
        start = tl.load(starts_ptr + b)
        limit = tl.load(limits_ptr + b)
        rows = tl.arange(0, BLOCK_M)  # query m: head kvh * GROUPS + m // width, position start + m % width
        row_ok = rows < GROUPS * width
        head = kvh * GROUPS + rows // width
        w = rows % width
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < dim
        q = tl.load(q_ptr + b * q_sb + head[:, None] * q_sh + w[:, None] * q_sw + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if TREE:  # each query's ancestor bitmask over the step's tokens (none for the block's spare rows)
            masks = tl.load(masks_ptr + b * m_sb + w * m_sw, mask=row_ok, other=0)
            committed = tl.where(row_ok, start, 0)  # keys every node sees
        else:
            sees = tl.minimum(start + w + 1, limit)  # keys each query sees
            sees = tl.where(row_ok, sees, 0)
        row_keys = tl.minimum(start + width, limit)  # keys the row's last query sees
        per_split = tl.cdiv(tl.cdiv(row_keys, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, row_keys)
        base = slot * c_ss + kvh * c_sh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for first in range(lo, hi, BLOCK_N):
            t = first + tl.arange(0, BLOCK_N)
            t_ok = t < hi
            kv_offsets = base + t[:, None] * c_st + dims[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=t_ok[:, None] & dim_ok[None, :], other=0.0)
            if IEEE:  # float32 products without TF32 rounding (float32 models; the interpreter)
                s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k).to(q.dtype)).to(tl.float32) * scale
            if TREE:  # committed keys, and the step's keys on the query's path; never at or past the limit
                offset = t - start  # a key's index among the step's tokens
                step_key = (offset >= 0) & (offset < width)
                bit = (masks[:, None] >> tl.where(step_key, offset, 0)[None, :]) & 1
                seen = (t[None, :] < committed[:, None]) | (step_key[None, :] & (bit == 1))
                s = tl.where(seen & (t < limit)[None, :], s, float("-inf"))
            else:
                s = tl.where(t[None, :] < sees[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(v_ptr + kv_offsets, mask=t_ok[:, None] & dim_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        part = ((b * tl.num_programs(1) + kvh) * SPLITS + split) * BLOCK_M + rows
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], acc / tl.maximum(l_i, 1e-30)[:, None])

    @triton.jit
    def combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, o_sb, o_sh, o_sw, width, dim,
                       GROUPS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        b, kvh = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        first = (b * tl.num_programs(1) + kvh) * SPLITS * BLOCK_M
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for split in range(SPLITS):
            top = tl.maximum(top, tl.load(part_lse_ptr + first + split * BLOCK_M + rows))
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(SPLITS):
            part = first + split * BLOCK_M + rows
            weight = tl.exp(tl.load(part_lse_ptr + part) - top_safe)
            acc += weight[:, None] * tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :])
            total += weight
        acc = acc / tl.maximum(total, 1e-30)[:, None]
        row_ok = rows < GROUPS * width
        head = kvh * GROUPS + rows // width
        w = rows % width
        tl.store(out_ptr + b * o_sb + head[:, None] * o_sh + w[:, None] * o_sw + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < dim)[None, :])

    return split_kernel, combine_kernel
