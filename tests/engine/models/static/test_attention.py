"""The decode/verify attention kernel (Triton, run on the CPU by its interpreter): the reference's outputs for GQA
groups, widths and head sizes, any split count; each row reads only its own slot's keys below its limit; padding
rows give zeros."""

import pytest
import torch

from engine.models.static import attention
from engine.models.static.attention import RowIndex, cache_attention, reference_attention
from tests.engine.models.static.attention_cases import DEVICE, attention_case

pytest.importorskip("triton")


@pytest.fixture
def interpreted():
    """The Triton kernel runs here: on a GPU, or on the CPU in Triton's interpreter."""
    if not attention.available():
        pytest.skip("Triton cannot run here (no GPU and TRITON_INTERPRET unset)")


@pytest.mark.parametrize("shape", [
    (3, 4, 2, 1, 16, 4, 200),  # decode, groups of 2
    (2, 6, 2, 4, 32, 3, 300),  # a 4-token verify, groups of 3
    (2, 4, 4, 3, 24, 2, 130),  # no GQA, a head size that is not a power of two
    (1, 8, 2, 16, 64, 1, 400),  # the widest step: 4 x 16 queries per program
    (2, 4, 2, 2, 8, 2, 100),  # a head size below the products' smallest tile (the tiny test models')
])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_kernel_gives_the_reference_attention(interpreted, shape, splits):
    q, k, v, rows = attention_case(*shape, dtype=torch.float32)
    got = cache_attention(q, k, v, rows, 0.3, splits=splits)
    torch.testing.assert_close(got, reference_attention(q, k, v, rows, 0.3), atol=2e-6, rtol=2e-5)


def test_bf16_inputs_within_bf16_precision(interpreted):
    q, k, v, rows = attention_case(3, 8, 2, 5, 64, 4, 256, torch.bfloat16)
    got = cache_attention(q, k, v, rows, 0.125, splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_attention(q, k, v, rows, 0.125).float(), atol=2e-2, rtol=1e-2)


def test_a_row_reads_only_its_slot_below_its_limit_and_padding_rows_are_zero(interpreted):
    q, k, v, rows = attention_case(3, 4, 2, 2, 32, 5, 260, torch.float32, seed=3)
    want = reference_attention(q, k, v, rows, 0.2)
    poisoned_k, poisoned_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for b in range(3):  # only the keys and values each row may read are real; every other entry is NaN
        s, limit = int(rows.slots[b]), int(rows.limits[b])
        poisoned_k[s, :, :limit], poisoned_v[s, :, :limit] = k[s, :, :limit], v[s, :, :limit]
    got = cache_attention(q, poisoned_k, poisoned_v, rows, 0.2, splits=3)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    padded = RowIndex(slots=rows.slots, starts=rows.starts,
                      limits=torch.tensor([0, 0, int(rows.limits[2])], device=DEVICE))
    out = cache_attention(q, poisoned_k, poisoned_v, padded, 0.2, splits=3)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    torch.testing.assert_close(out[2], want[2], atol=2e-6, rtol=2e-5)


def test_without_triton_the_reference_runs(monkeypatch):
    monkeypatch.setattr(attention, "triton", None)
    q, k, v, rows = attention_case(2, 4, 2, 3, 16, 2, 100, torch.float32)
    assert not attention.available()
    torch.testing.assert_close(cache_attention(q, k, v, rows, 0.5), reference_attention(q, k, v, rows, 0.5))


def test_the_reference_is_causal_attention_over_each_row_prefix():
    q, k, v, rows = attention_case(2, 4, 2, 3, 16, 3, 64, torch.float32, seed=7)
    got = reference_attention(q, k, v, rows, 0.25)
    for b in range(2):
        s, start = int(rows.slots[b]), int(rows.starts[b])
        for w in range(3):
            keys = k[s, :, : start + w + 1].repeat_interleave(2, dim=0)  # [H, L, D]
            values = v[s, :, : start + w + 1].repeat_interleave(2, dim=0)
            probs = (q[b, :, w, None, :] @ keys.transpose(1, 2) * 0.25).softmax(-1)  # [H, 1, L]
            torch.testing.assert_close(got[b, :, w], (probs @ values)[:, 0], atol=1e-5, rtol=1e-5)

