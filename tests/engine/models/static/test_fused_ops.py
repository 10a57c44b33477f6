"""A graph step's fused elementwise kernels (Triton; on a CPU in its interpreter) against the ATen operators they
replace: RMSNorm, the residual add with RMSNorm, SwiGLU, and RoPE with the KV-cache write (each row's keys and values
land at its own slot and position, nothing else in the cache changes)."""

import pytest
import torch
import torch.nn.functional as F

from engine.models.static import fused_ops
from engine.models.static.attention import RowIndex
from engine.models.static.layer_ops import _rms_norm
from engine.models.static.rope import apply_rope

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without a GPU: Triton's interpreter (tests/conftest.py)
# the interpreter's bf16 arithmetic is not the GPU's (engine/models/static/attention.py): bf16 runs on a GPU only
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.fixture(autouse=True)
def runnable():
    if not fused_ops.available():
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET unset)")


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _tolerance(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 100, 4096])  # a power of two, not one, an 8B model's hidden size
def test_rms_norm_and_the_residual_add_with_it_match_aten(dtype, size):
    x, delta = _randn(2, 3, size, dtype=dtype), _randn(2, 3, size, dtype=dtype, seed=1)
    weight = _randn(size, dtype=torch.float32, seed=2)
    got = fused_ops.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, _rms_norm(x, weight, 1e-5), **_tolerance(dtype))
    total, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-6)
    torch.testing.assert_close(total, x + delta, atol=0, rtol=0)  # the add rounds as ATen's does
    torch.testing.assert_close(normed, _rms_norm(x + delta, weight, 1e-6), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [48, 1500])  # one block, and several with a partial last one
def test_silu_mul_matches_aten(dtype, inner):
    gate_up = _randn(2, 2, 2 * inner, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = fused_ops.silu_mul(gate_up)
    assert got.shape == (2, 2, inner)
    torch.testing.assert_close(got, F.silu(gate) * up, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (6, 6, 24), (8, 2, 128)])
def test_rope_rotates_queries_and_writes_keys_and_values_at_each_rows_slot_and_position(dtype, heads, kv_heads,
                                                                                       dim):
    batch, width, slots, capacity = 3, 4, 5, 40
    qkv = _randn(batch, width, (heads + 2 * kv_heads) * dim, dtype=dtype)
    cos, sin = _randn(capacity, dim, dtype=dtype, seed=1), _randn(capacity, dim, dtype=dtype, seed=2)
    rows = RowIndex(slots=torch.tensor([4, 0, 2], device=DEVICE), starts=torch.tensor([0, 7, 30], device=DEVICE),
                    limits=torch.tensor([4, 11, 34], device=DEVICE))
    k_cache = torch.full((slots, kv_heads, capacity, dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, 9.0)
    q = fused_ops.rope_to_cache(qkv, cos, sin, rows, k_cache, v_cache, heads, kv_heads)

    positions = rows.starts[:, None] + torch.arange(width, device=DEVICE)[None]  # [B, W]
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, W, D]
    want_q = apply_rope(qkv[..., : heads * dim].view(batch, width, heads, dim).transpose(1, 2), c, s)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(batch, width, kv_heads, dim).transpose(1, 2)
    want_k = apply_rope(k, c, s).transpose(1, 2)  # [B, W, KVH, D]
    want_v = qkv[..., (heads + kv_heads) * dim :].view(batch, width, kv_heads, dim)
    assert q.shape == (batch, heads, width, dim)
    torch.testing.assert_close(q, want_q, **_tolerance(dtype))
    written = torch.zeros(slots, capacity, dtype=torch.bool, device=DEVICE)
    for b in range(batch):
        slot, pos = int(rows.slots[b]), positions[b]
        written[slot, pos] = True
        torch.testing.assert_close(k_cache[slot, :, pos].transpose(0, 1), want_k[b], **_tolerance(dtype))
        torch.testing.assert_close(v_cache[slot, :, pos].transpose(0, 1), want_v[b], atol=0, rtol=0)
    assert bool((k_cache.permute(0, 2, 1, 3)[~written] == 7.0).all())  # nothing else in the cache changed
    assert bool((v_cache.permute(0, 2, 1, 3)[~written] == 9.0).all())


def test_eager_steps_on_a_triton_device_run_the_kernels_and_give_the_aten_logits(monkeypatch):
    """Prompt chunks and uncaptured shapes run eagerly; on CUDA their elementwise work takes the same kernels (without
    a GPU the CPU stands in, through Triton's interpreter), rows written at consecutive slots from first_slot."""
    from engine.models.static import layer_ops
    from engine.models.static.runner import KVBudget, StaticRunner
    from tests.conftest import make_tiny_model
    from tests.engine.models.static.test_runner import ROUNDS, assert_same_logits, scripted

    model = make_tiny_model("qwen2", seed=2).to(DEVICE)  # biased qkv: the kernel reads the projection's output
    build = lambda: StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=4), compile="off",  # noqa: E731
                                 prefill_chunk=16)
    monkeypatch.setattr(layer_ops.LayerOps, "for_step", classmethod(  # no CPU operators
        lambda cls, shape, cos, sin, positions, first_slot, kv_len, **tree: cls(shape, cos, sin, None, positions,
                                                                                first_slot, kv_len, **tree)))
    monkeypatch.setattr(layer_ops, "TRITON_EAGER_DEVICES", set())  # the reference: ATen's operators
    aten = scripted(build(), ROUNDS)
    calls = []
    rope = fused_ops.rope_to_cache
    monkeypatch.setattr(fused_ops, "rope_to_cache", lambda *a: calls.append(1) or rope(*a))
    monkeypatch.setattr(layer_ops, "TRITON_EAGER_DEVICES", {DEVICE})
    assert_same_logits(scripted(build(), ROUNDS), aten, atol=1e-4, rtol=1e-4)
    assert calls, "the eager steps ran the Triton kernels"
