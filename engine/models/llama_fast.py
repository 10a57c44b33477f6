"""A lean decoder forward for Llama-family models (Llama, Qwen2, Mistral), over the transformers model's weights.

Decoding a small model on a CPU is dominated by per-operator overhead as much as by weight bandwidth: the
transformers modules' Python is a large share of a SmolLM2-135M step on this project's 2-core machine. This forward
runs the same maths with q/k/v and gate/up projections fused into one matrix each (4 matrix products per layer
instead of 7), `torch.rms_norm`, and one Python frame per layer. Rotary tables come from the model's own
`rotary_emb` module (so every RoPE scaling variant transformers knows is honoured), and keys/values go through the
same `SlotKVCache`. Models it does not cover (other families, tensor-parallel shards) keep the transformers path;
tests/engine/models/test_llama_fast.py checks both give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu.linear import linear
from engine.models.quantize import Int8WeightOnlyLinear

FAMILIES = ("llama", "qwen2", "mistral")
# ATen's int8 weight-only kernel is built for decode (a few rows); past this many rows (a prompt's prefill) the
# int8 weights are dequantized for one dense fp32 product instead (measured: see bench/RESULTS-engine.md)
INT8_KERNEL_MAX_ROWS = 32


@dataclass
class _Proj:
    """One (possibly fused) projection: float weights, or int8 weights with per-channel scales."""

    weight: torch.Tensor  # [out, in] float, or int8
    scales: torch.Tensor | None  # [out] for int8 weights
    bias: torch.Tensor | None

    @staticmethod
    def fuse(modules: list[nn.Module]) -> "_Proj":
        if all(isinstance(m, Int8WeightOnlyLinear) for m in modules):
            weight = torch.cat([m.weight_int8 for m in modules])
            scales = torch.cat([m.scales for m in modules])
        else:
            weight, scales = torch.cat([m.weight.detach() for m in modules]), None
        biases = [m.bias for m in modules]
        bias = None if all(b is None for b in biases) else torch.cat([
            b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype if scales is None
                                                         else m.compute_dtype)
            for m, b in zip(modules, biases)])
        return _Proj(weight, scales, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, in] -> [B, N, out]
        if self.scales is None:
            return linear(x, self.weight, self.bias)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.shape[0] > INT8_KERNEL_MAX_ROWS:  # prefill: a dense fp32 product beats the int8 kernel here
            out = F.linear(rows.float(), self.weight.float() * self.scales.float()[:, None]).to(x.dtype)
        else:
            out = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], -1)


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: _Proj
    o: _Proj
    gate_up: _Proj
    down: _Proj


def supports(model: nn.Module) -> bool:
    """True for an untouched (or int8-quantized) Llama/Qwen2/Mistral model on CPU with SiLU MLPs."""
    config = model.config
    if config.model_type not in FAMILIES or getattr(config, "hidden_act", "silu") != "silu":
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    base = model.base_model
    ok_types = (nn.Linear, Int8WeightOnlyLinear)
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(isinstance(m, ok_types) for m in mods):
            return False
    return isinstance(base.embed_tokens, nn.Embedding)


class FastLlamaForward(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        assert supports(model), "FastLlamaForward needs a Llama/Qwen2/Mistral model on CPU"
        base = model.base_model
        config = model.config
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight.detach()
        self.eps = base.norm.variance_epsilon
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=_Proj.fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                o=_Proj.fuse([layer.self_attn.o_proj]),
                gate_up=_Proj.fuse([layer.mlp.gate_proj, layer.mlp.up_proj]),
                down=_Proj.fuse([layer.mlp.down_proj]),
            )
            for layer in base.layers
        ]
        self.scaling = self.head_dim ** -0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, N]
        attention_mask: torch.Tensor,  # [B, 1, N, kv_len] additive
        position_ids: torch.Tensor,  # [B, N]
        past_key_values,  # SlotKVCache with its write plan set
    ) -> torch.Tensor:  # [B, N, H] final hidden states
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)  # [B, N, D]
        cos, sin = cos[:, None].to(hidden.dtype), sin[:, None].to(hidden.dtype)
        batch, n, _ = hidden.shape
        mask = attention_mask.to(hidden.dtype)
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            q = qkv[..., : self.q_size].view(batch, n, -1, self.head_dim).transpose(1, 2)
            k = qkv[..., self.q_size : self.q_size + self.kv_size].view(batch, n, -1, self.head_dim).transpose(1, 2)
            v = qkv[..., self.q_size + self.kv_size :].view(batch, n, -1, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            keys, values = past_key_values.update(k, v, index)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
            hidden = hidden + layer.o(attn.transpose(1, 2).reshape(batch, n, -1))
            x = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return F.rms_norm(hidden, (hidden.shape[-1],), self.final_norm, self.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [B, heads, N, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
