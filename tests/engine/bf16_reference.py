"""The arithmetic of engine/models/cpu/csrc/bf16_gemm.cpp (VDPBF16PS) and of amx_gemm.cpp's emulated tiles (TDPBF16PS) in
torch, for tests: what their products must equal bit for bit."""

import torch


def dpbf16_reference(
    x: torch.Tensor,  # [M, K] float32
    weight: torch.Tensor,  # [N, K] bf16 values (bfloat16, or float32 holding them)
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] float32
    """VDPBF16PS's arithmetic (Intel SDM): x rounded to bf16, exact products added to fp32 accumulators a pair of k at
    a time, the odd k first, each addition rounded to nearest even; then the bias."""
    xs, ws = x.bfloat16().float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        for j in (k + 1, k):
            if j < x.shape[1]:
                acc = acc + xs[:, j, None] * ws[None, :, j]
    return acc if bias is None else acc + bias


def tdpbf16_reference(
    x: torch.Tensor,  # [M, K] float32
    weight: torch.Tensor,  # [N, K] bf16 values
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] float32
    """TDPBF16PS's arithmetic as the SDM's pseudocode (and engine/models/cpu/csrc/amx_gemm.cpp's emulated tiles) gives
    it, for values without denormals: x rounded to bf16, exact products added to fp32 accumulators one k at a time,
    the even k of a pair first, each addition rounded to nearest even; then the bias."""
    xs, ws = x.bfloat16().float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xs[:, k, None] * ws[None, :, k]
    return acc if bias is None else acc + bias


def random_product(
    rows: int, out_features: int, in_features: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x [rows, in] fp32, weight [out, in] bf16, bias [out] fp32
    """A product's random operands, drawn from `seed`, for the products' bit-for-bit tests."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    return x, weight, torch.randn(out_features, generator=generator)
