"""A graph step's elementwise work as one Triton kernel each: RMSNorm, the residual add with the next RMSNorm, SwiGLU,
and RoPE with the KV-cache write.

Inside a captured CUDA graph a kernel's launch costs next to nothing on the host, but every kernel still costs the
device a few microseconds of start and drain, whatever its size. Written with ATen operators a Llama layer's norms,
RoPE, SiLU and residual adds take ~40 kernels; at decode sizes their arithmetic is nothing and their count is the
cost (an 8B-shaped step: 32 layers, ~1,300 such kernels; the graphs took markedly longer over the memory
roofline than inductor's fused graphs: bench/RESULTS.md, the first H100 runs of the graph runner). Here each is
one kernel, as vLLM's and SGLang's fused RMSNorm, SiLU-and-mul and rotary-embedding kernels are; a layer is then 4
products, 4 of these and attention.

Each kernel rounds where the ATen operators it replaces round (a bf16 product, then a bf16 sum, as `apply_rope` in
bf16 does: engine/models/static/rope.py), so its results match theirs but for the order of a norm's sum of squares.
Like the attention kernel (engine/models/static/attention.py) they run where Triton runs: on a GPU, or on CPU tensors
in Triton's interpreter (`TRITON_INTERPRET=1`, how the tests check them against the ATen operators); elsewhere
`available()` is False and engine/models/static/layer_ops.py keeps the ATen operators.
"""

from __future__ import annotations

import functools

import torch

from engine.models.static import attention as attention_kernels
from engine.models.static.attention import RowIndex

BLOCK = 1024  # elements per program of the elementwise kernels without a reduction


def available() -> bool:
    """Whether these kernels can run here (the attention kernel's condition: Triton on a GPU, or its interpreter)."""
    return attention_kernels.available()


def _rows(x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [N, H], contiguous
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H], weight [H] fp32
    """RMSNorm in float32, back in x's dtype (layer_ops._rms_norm's meaning)."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    size = rows.shape[-1]
    _kernels()["add_rms_norm"][(rows.shape[0],)](rows, rows, weight, out, out, size, eps, ADD=False,
                                                 BLOCK_H=_next_power_of_2(size), num_warps=_warps(size))
    return out.view(x.shape)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # [..., H] each -> (hidden + delta, its norm)
    """The residual add (rounded to hidden's dtype, as ATen's add) and the RMSNorm of its result, in one pass."""
    rows, deltas = _rows(hidden), _rows(delta)
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    size = rows.shape[-1]
    _kernels()["add_rms_norm"][(rows.shape[0],)](rows, deltas, weight, total, out, size, eps, ADD=True,
                                                 BLOCK_H=_next_power_of_2(size), num_warps=_warps(size))
    return total.view(hidden.shape), out.view(hidden.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """SwiGLU's SiLU(gate) * up, each rounded to the input's dtype as ATen's two operators round."""
    rows = _rows(gate_up)
    inner = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], inner, dtype=rows.dtype, device=rows.device)
    _kernels()["silu_mul"][(rows.shape[0], -(-inner // BLOCK))](rows, out, inner, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], inner)


def rope_to_cache(
    qkv: torch.Tensor,  # [B, W, (H + 2 KVH) * D]: the fused projection's output
    cos: torch.Tensor,  # [C, D] the model's table, in its dtype
    sin: torch.Tensor,  # [C, D]
    rows: RowIndex,
    k_cache: torch.Tensor,  # [S, KVH, C, D]
    v_cache: torch.Tensor,  # [S, KVH, C, D]
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # q [B, H, W, D] (a view of a [B, W, H, D] tensor)
    """RoPE (rotate-half, transformers' convention) on the queries and keys of token w of row b at position
    starts[b] + w (a token tree's step, `rows.depths`: at starts[b] + depths[b, w]); its keys and values written to
    the cache at (slots[b], :, starts[b] + w); the rotated queries returned. One program per (token, head)."""
    batch, width, _ = qkv.shape
    dim = cos.shape[-1]
    flat = qkv.reshape(batch * width, -1).contiguous()
    assert cos.is_contiguous() and sin.is_contiguous() and flat.shape[-1] == (num_heads + 2 * num_kv_heads) * dim
    q = torch.empty(batch, width, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    tree = rows.depths is not None
    if tree:  # [B, W] int64, any strides (a graph's staging view is transposed)
        assert rows.depths.shape == (batch, width) and rows.depths.dtype == torch.int64
    depths = rows.depths if tree else rows.starts  # the chain kernel never reads it
    _kernels()["rope_to_cache"][(batch * width, num_heads + num_kv_heads)](
        flat, cos, sin, rows.slots, rows.starts, depths, q, k_cache, v_cache,
        width, num_heads, num_kv_heads, dim, flat.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        depths.stride(0), depths.stride(1) if tree else 0,
        BLOCK_D=_next_power_of_2(dim), TREE=tree)
    return q.transpose(1, 2)


def _next_power_of_2(n: int) -> int:
    return _triton().next_power_of_2(n)


def _warps(size: int) -> int:
    """Warps of a norm's program: one row of `size` elements, ~16 of them per thread."""
    return max(1, min(16, _next_power_of_2(size) // 512))


def _triton():
    """Triton, imported on first use as the attention kernel imports it (importing this module must not need it)."""
    assert attention_kernels._import_triton()
    return attention_kernels.triton


@functools.cache
def _kernels() -> dict:
    """The Triton kernels, defined on first use."""
    triton, tl = _triton(), attention_kernels.tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, total_ptr, out_ptr, size, eps,
                            ADD: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < size
        x = tl.load(x_ptr + row * size + cols, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            x = x + tl.load(delta_ptr + row * size + cols, mask=ok, other=0.0).to(tl.float32)
            x = x.to(total_ptr.dtype.element_ty).to(tl.float32)  # rounded where ATen's add rounds
            tl.store(total_ptr + row * size + cols, x.to(total_ptr.dtype.element_ty), mask=ok)
        inv = tl.rsqrt(tl.sum(x * x, 0) / size + eps)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * size + cols, ((x * inv) * weight).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inner
        gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=ok, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # as F.silu rounds
        tl.store(out_ptr + row * inner + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rope_to_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, starts_ptr, depths_ptr, q_ptr, k_ptr, v_ptr,
                             width, num_heads, num_kv_heads, dim, qkv_stride, c_ss, c_sh, c_st, d_sb, d_sw,
                             BLOCK_D: tl.constexpr, TREE: tl.constexpr):
        token, head = tl.program_id(0), tl.program_id(1)
        b, w = token // width, token % width
        position = tl.load(starts_ptr + b) + w  # where the token's key and value are written
        if TREE:  # a tree node is rotated at its depth below the step's first position
            rotate_at = tl.load(starts_ptr + b) + tl.load(depths_ptr + b * d_sb + w * d_sw)
        else:
            rotate_at = position
        dims = tl.arange(0, BLOCK_D)
        ok = dims < dim
        half = dim // 2
        partner = tl.where(dims < half, dims + half, dims - half)  # rotate_half: [-x2, x1]
        sign = tl.where(dims < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + rotate_at * dim + dims, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + rotate_at * dim + dims, mask=ok, other=0.0).to(tl.float32)
        row = qkv_ptr + token * qkv_stride
        # the fused projection's layout: query heads, key heads, value heads (a key head's program moves its value)
        x = tl.load(row + head * dim + dims, mask=ok, other=0.0).to(tl.float32)
        rotated = sign * tl.load(row + head * dim + partner, mask=ok, other=0.0).to(tl.float32)
        # `apply_rope` in the model's dtype: x * cos and rotated * sin rounded, then their sum
        dtype = qkv_ptr.dtype.element_ty
        out = (x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)
        if head < num_heads:
            tl.store(q_ptr + (token * num_heads + head) * dim + dims, out.to(q_ptr.dtype.element_ty), mask=ok)
        else:
            kv_head = head - num_heads
            cache = tl.load(slots_ptr + b) * c_ss + kv_head * c_sh + position * c_st + dims
            tl.store(k_ptr + cache, out.to(k_ptr.dtype.element_ty), mask=ok)
            value = tl.load(row + (num_heads + num_kv_heads + kv_head) * dim + dims, mask=ok, other=0.0)
            tl.store(v_ptr + cache, value.to(v_ptr.dtype.element_ty), mask=ok)

    return {"add_rms_norm": add_rms_norm_kernel, "silu_mul": silu_mul_kernel, "rope_to_cache": rope_to_cache_kernel}
