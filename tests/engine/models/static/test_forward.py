"""The static forward's pieces on their own: RoPE (its one definition against transformers'), the layer shape the
operators read, and the int8 projection's row limit (the int8 kernel for a step's few rows, a dense product for a
prompt chunk, the same logits either way)."""

import dataclasses

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.models.quantize import quantize_int8_weight_only
from engine.models.static import forward
from engine.models.static.layer_ops import LayerShape
from engine.models.static.rope import apply_rope, rope_tables, why_rope_unsupported
from engine.models.static.runner import KVBudget, StaticRunner
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rope_is_transformers_rotation_over_the_models_own_tables(family):
    model = make_tiny_model(family, seed=0)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cos, sin = rope_tables(model.base_model.rotary_emb, 40, torch.device("cpu"))  # [40, D]
    assert cos.shape == sin.shape == (40, head_dim)
    positions = torch.tensor([[0, 1, 2], [17, 18, 19]])  # [B, W]
    q = torch.randn(2, 4, 3, head_dim, generator=torch.Generator().manual_seed(1))  # [B, heads, W, D]
    k = torch.randn(2, 2, 3, head_dim, generator=torch.Generator().manual_seed(2))
    want_cos, want_sin = model.base_model.rotary_emb(q, positions)  # [B, W, D]
    want_q, want_k = apply_rotary_pos_emb(q, k, want_cos, want_sin)  # unsqueezes the heads' dimension
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, W, D]
    torch.testing.assert_close(apply_rope(q, c, s), want_q)
    torch.testing.assert_close(apply_rope(k, c, s), want_k)


def test_rope_variants_whose_tables_change_with_the_length_are_refused():
    config = make_tiny_model("llama").config
    assert why_rope_unsupported(config) is None
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    setattr(config, "rope_parameters" if hasattr(config, "rope_parameters") else "rope_scaling", dynamic)
    assert "dynamic" in why_rope_unsupported(config)


def test_the_layer_shape_is_one_ranks_share_and_frozen():
    config = make_tiny_model("gemma").config  # 4 heads, 2 KV heads, head_dim 16 (not hidden / heads), GELU-tanh
    whole = LayerShape.of(config, 1, torch.float32, torch.bfloat16)
    assert (whole.num_heads, whole.num_kv_heads, whole.head_dim, whole.gelu) == (4, 2, 16, True)
    assert (whole.q_size, whole.kv_size, whole.scale) == (64, 32, 16 ** -0.5)
    assert whole.eps == config.rms_norm_eps and whole.cache_dtype == torch.bfloat16
    half = LayerShape.of(config, 2, torch.float32, torch.float32)
    assert (half.num_heads, half.num_kv_heads, half.q_size, half.kv_size) == (2, 1, 32, 16)
    assert not LayerShape.of(make_tiny_model("llama").config, 1, torch.float32, torch.float32).gelu
    with pytest.raises(dataclasses.FrozenInstanceError):
        whole.eps = 0.0


def test_int8_prefill_takes_the_dense_product_with_the_int8_kernels_logits(monkeypatch):
    """A prompt chunk of more than INT8_KERNEL_MAX_ROWS rows dequantizes for one dense product; forced through ATen's
    int8 kernel instead (the limit raised), it gives the same logits up to rounding."""
    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))  # bf16 activations: not the fp32 kernel
    prompt = [(5 * t) % 60 + 2 for t in range(forward.INT8_KERNEL_MAX_ROWS + 9)]
    kernel, rows_fed = torch._weight_int8pack_mm, []
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, w, s: rows_fed.append(x.shape[0]) or kernel(x, w, s))

    def prefill_logits():
        rows_fed.clear()
        runner = StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=2), compile=False)
        runner.add("s")
        return runner.forward(["s"], [prompt], [4]), max(rows_fed)

    dense, widest = prefill_logits()
    assert widest <= forward.INT8_KERNEL_MAX_ROWS, "the prompt chunk took the dense product"
    monkeypatch.setattr(forward, "INT8_KERNEL_MAX_ROWS", 10**9)
    kernel_logits, widest = prefill_logits()
    assert widest == len(prompt) - 4, "the prompt chunk took the int8 kernel"
    torch.testing.assert_close(dense, kernel_logits, atol=0.1, rtol=0.05)
