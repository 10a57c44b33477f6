"""A faster nn.Linear for small-batch inference on CPU.

Verifying K draft tokens is a matrix product with only K+1 rows. With MKL on x86 CPUs, `F.linear(x, W)` for
2..16 rows picks a kernel that is several times slower than computing the same product as `(W @ x^T)^T`, which
streams the weight matrix once (measured on this project's 2-core AVX2 machine, torch 2.13, at SmolLM2's LM
head). Memory-bound decoding lives on exactly these shapes, so the runner switches the kernel per call.
bf16/fp16 weights keep `F.linear` (there the trick is slower).

A single row (a decode step) is a GEMV, and MKL runs a GEMV of these sizes on one thread: with the weights coming
from DRAM (a decode step reads every layer's once) it streams about half of what two threads read. Split into
`torch.get_num_threads()` row blocks and run as one `bmm`, ATen gives each thread its block (measured on the same
machine, SmolLM2-135M's projections and LM head, weights cold: markedly faster per step; bench/RESULTS.md).
Matrices that fit in cache (under `SPLIT_GEMV_MIN_ELEMENTS`) gain nothing and keep `F.linear`.

Where engine/models/cpu/extension.py's kernel is available (x86 with AVX2/FMA and a C++ compiler), 1 to 64 rows use it
instead: faster than both tricks above at every row count measured (bench/RESULTS.md, "A small-batch CPU matrix
product"), and batch invariant. The tricks stay for machines without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu import extension as cpu_extension

# below this many weight elements (1 MiB of fp32) the matrix stays in cache between steps and MKL's GEMV is as fast
SPLIT_GEMV_MIN_ELEMENTS = 1 << 18


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    step: bool | None = None,
) -> torch.Tensor:  # [..., out]
    """F.linear; on CPU with fp32 activations, engine/models/cpu/extension.py's kernel where it loads (fp32 or bf16
    weights), else one row as a GEMV split across threads, 2+ rows as (W @ x^T)^T.

    Which rows take the kernel with fp32 weights: `step=True` (a decode or verify step, a few tokens per row) every
    row, so a row is computed the same whatever the batch (the kernel is batch invariant: a verify scores a token
    exactly as a decode step would); `step=False` (a prompt chunk, compute-bound) none, MKL is faster there; `None`
    (callers that do not know) at most MAX_ROWS.

    bf16 weights beside fp32 activations (the static runner's bf16 models on CPU, engine/factory.cpu_step_dtypes) make
    a bf16 product: the activations rounded to bf16, fp32 sums and output, always on the kernel, prompt chunks
    included. ATen's bf16 GEMM (oneDNN) computes a 256-row chunk faster here but rounds its output to bf16 and
    is not batch invariant: a prompt's cache then depended on which prompts shared its forward and on how it was
    chunked, and served greedy texts differed from the same request decoded alone (bench/RESULTS.md).
    Without the kernel, the product is ATen's bf16 GEMM. (The static runner multiplies bf16 weights on CPUs with
    AVX512_BF16 by engine/models/cpu/csrc/bf16_gemm.cpp instead, over weights packed by `pack_bf16`: engine/models/static/forward.py.)"""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype not in (torch.float32, torch.bfloat16):
        return F.linear(x, weight, bias)
    kernel = small_gemm_for(x, weight)
    if kernel is not None and kernel_takes(rows, weight, step):
        out = kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight, None if bias is None else bias.contiguous())
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if weight.dtype != torch.float32:
        out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return out if bias is None else out + bias
    if torch.compiler.is_compiling():  # compiled steps (inductor, frozen weights) choose their own kernels
        return F.linear(x, weight, bias)
    if rows == 1:
        return _split_gemv(x, weight, bias)
    # x must be row-major here: MKL is fast for W @ (row-major x)^T, slow when that operand is column-major
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def small_gemm_for(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]: fp32, bf16 or int8
) -> Callable | None:
    """engine/models/cpu/extension.py's kernel where it can compute this product (fp32 activations on CPU, `in` a
    multiple of 8, a contiguous weight, an eager step), else None."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[-1] % 8 or not weight.is_contiguous()
            or torch.compiler.is_compiling()):
        return None
    return cpu_extension.small_gemm()


def kernel_takes(rows: int, weight: torch.Tensor, step: bool | None) -> bool:
    """Whether the kernel computes a product of `rows` rows (see `linear`): bf16 weights always; else steps (True)
    always, prompt chunks (False) never, and callers that do not say up to MAX_ROWS."""
    return weight.dtype == torch.bfloat16 or (rows <= cpu_extension.MAX_ROWS if step is None else step)


BF16_LANES = 16  # output columns per packed vector (bf16_gemm.cpp)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [ceil(out/16), ceil(in/2), 16, 2] bf16
    """A weight in the VNNI layout engine/models/cpu/csrc/bf16_gemm.cpp reads: 16 output columns by a pair of inputs per
    64-byte vector, zero-padded to whole vectors and pairs."""
    out_features, in_features = weight.shape
    vectors, pairs = -(-out_features // BF16_LANES), -(-in_features // 2)
    padded = torch.zeros(vectors * BF16_LANES, pairs * 2, dtype=torch.bfloat16, device=weight.device)
    padded[:out_features, :in_features] = weight
    return padded.view(vectors, BF16_LANES, pairs, 2).transpose(1, 2).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:  # -> [out, in] bf16
    """The [out, in] weight `pack_bf16` packed."""
    vectors, pairs = packed.shape[0], packed.shape[1]
    return packed.transpose(1, 2).reshape(vectors * BF16_LANES, pairs * 2)[:out_features, :in_features]


def _split_gemv(
    x: torch.Tensor,  # [..., in], one row
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [..., out]
    """One row times a large matrix, as `threads` row blocks in one bmm (one block per thread)."""
    out_features, in_features = weight.shape
    parts = torch.get_num_threads()
    if parts < 2 or weight.numel() < SPLIT_GEMV_MIN_ELEMENTS or out_features % parts or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    blocks = weight.view(parts, out_features // parts, in_features)  # [P, out/P, in]
    # the column as x^T (strides (1, in)): given strides (in, 1, 1) instead, ATen's bmm takes a much slower kernel
    column = x.reshape(1, in_features).t().expand(parts, in_features, 1)  # [P, in, 1]
    out = torch.bmm(blocks, column).reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


class SmallBatchLinear(nn.Linear):
    """Same parameters and results as nn.Linear (up to float summation order), faster for 2+ rows on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return linear(x, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Switch every plain nn.Linear of `model` to SmallBatchLinear in place (weights shared, ties kept)."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            switched += 1
    return switched
