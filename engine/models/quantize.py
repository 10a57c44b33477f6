"""Weight-only int8 quantization for draft models (per output channel, symmetric).

A draft only has to agree with the target often, not to be exact (the rejection sampler keeps the output
lossless), so a cheaper draft pays directly. Weight-only int8 with per-channel scales keeps a draft's argmax close
to the full-precision model's (gpt-fast's `WeightOnlyInt8Linear`, Frantar et al. 2022 arXiv 2210.17323 on why
per-channel weight quantization is benign), and halves the weight bytes read per step again after bf16, which is
what a memory-bound decode step costs. On CPU it runs on ATen's `_weight_int8pack_mm` kernel.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("weight_int8", (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(compute_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute_dtype))
        self.compute_dtype = compute_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.compute_dtype)
        if x2.device.type == "cpu":
            out = torch._weight_int8pack_mm(x2, self.weight_int8, self.scales)
        else:
            out = (x2 @ self.weight_int8.to(self.compute_dtype).t()) * self.scales
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_int8_weight_only(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every nn.Linear (the LM head included) in place; the rest of the model runs in `compute_dtype`."""
    model.to(compute_dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8WeightOnlyLinear(child, compute_dtype))
    return model
