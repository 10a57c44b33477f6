"""A faster nn.Linear for small-batch inference on CPU.

Verifying K draft tokens is a matrix product with only K+1 rows. With MKL on x86 CPUs, `F.linear(x, W)` for
2..16 rows picks a kernel that is up to 3x slower than computing the same product as `(W @ x^T)^T`, which streams
the weight matrix once (measured on this project's 2-core AVX2 machine, torch 2.13: SmolLM2's LM head, 5 rows:
20.0 ms vs 6.6 ms). Memory-bound decoding lives on exactly these shapes, so the runner switches the kernel per call.
Single rows keep `F.linear` (a GEMV, already optimal), and so do bf16/fp16 weights (there the trick is slower).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """F.linear, computed as (W @ x^T)^T for 2+ fp32 rows on CPU."""
    rows = x.numel() // x.shape[-1]
    if rows < 2 or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    # x must be row-major here: MKL is fast for W @ (row-major x)^T, slow when that operand is column-major
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).contiguous().t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


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
