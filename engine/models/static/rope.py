"""Rotary position embedding (RoPE): which variants the static forward runs, its cos/sin tables, and the rotation.

The tables come from the model's own `rotary_emb` module, so every RoPE scaling variant transformers knows is
honoured exactly as the model defines it; only variants whose tables depend on the sequence length (dynamic NTK)
cannot be built once for the whole cache. `apply_rope` is the ATen form of the rotation: the eager step's
(engine/models/static/layer_ops.py) and the reference the fused kernels are tested against
(engine/models/static/fused_ops.py, engine/models/cpu/csrc/layer_ops.cpp).
"""

from __future__ import annotations

import torch
from torch import nn

# rope_type values whose tables are fixed per position (built once for the whole cache)
STATIC_ROPE = {None, "default", "linear", "llama3", "yarn", "longrope"}


def why_rope_unsupported(config) -> str | None:
    """None if the config's RoPE tables can be built once, else the reason."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) not in STATIC_ROPE:
        return f"RoPE type {rope.get('rope_type')!r} (its tables change with the sequence length)"
    return None


@torch.no_grad()
def rope_tables(rotary: nn.Module, capacity: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [capacity, D] float32
    """cos/sin for positions 0..capacity-1 from the model's own rotary module (its scaling variant included)."""
    probe = torch.zeros(1, 1, dtype=torch.float32, device=device)
    positions = torch.arange(capacity, device=device)[None]
    cos, sin = rotary(probe, positions)
    return cos[0].float(), sin[0].float()


def apply_rope(
    x: torch.Tensor,  # [B, heads, W, D]
    cos: torch.Tensor,  # [B, 1, W, D]: the table rows at each token's position
    sin: torch.Tensor,  # [B, 1, W, D]
) -> torch.Tensor:  # [B, heads, W, D]
    """x rotated as transformers' `apply_rotary_pos_emb` does (rotate_half: the second half of the dimensions, negated,
    before the first), computed in x's dtype: each product rounded, then their sum."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
