"""engine/models/cpu/csrc/amx_gemm.cpp: the bf16 product by AMX tiles over linear.pack_bf16's weights.

Its tile program runs everywhere on emulated tiles (`amx_bf16_gemm_emulated`: TDPBF16PS as the SDM's pseudocode gives
it, every tile shape checked as the hardware checks it), so layouts, k/n/m tails and blocking are tested on CPUs
without AMX, bit for bit against tests/engine/bf16_reference.py. On the CPU's own tiles (skipped where
`cpu_extension.amx_unavailable()` gives a reason) the product is checked against the exact product and for batch
invariance: the hardware's rounding of a pair is its own, so its bits are compared with themselves, not with the
emulation."""

import pytest
import torch

from engine.models.cpu import extension as cpu_extension
from engine.models.cpu.linear import pack_bf16
from tests.engine.bf16_reference import random_product, tdpbf16_reference
from tests.engine.models.cpu.test_bf16_gemm import HAS_BF16


@pytest.fixture(scope="module")
def emulated():
    if cpu_extension.op("amx_status") is None:
        pytest.skip(f"specserve's CPU operators are unavailable: {cpu_extension.why_unavailable()}")
    return torch.ops.specserve.amx_bf16_gemm_emulated


# (out, in): whole k blocks of 16 pairs only (576), a tail after whole blocks (70: 2 blocks + 3 pairs), a tail only
# (7: 4 pairs, the last half empty), a partial panel and vector (961, 50)
SHAPES = [(1, 2), (17, 7), (50, 70), (48, 64), (961, 576)]


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 70])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_tile_program_computes_tdpbf16ps_sums_bit_for_bit(emulated, rows, out_features, in_features):
    x, weight, bias = random_product(rows, out_features, in_features, seed=rows * 7 + out_features)
    packed = pack_bf16(weight)
    assert torch.equal(emulated(x, packed, out_features, bias), tdpbf16_reference(x, weight, bias))
    assert torch.equal(emulated(x, packed, out_features, None), tdpbf16_reference(x, weight, None))


def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(emulated):
    x, weight = torch.randn(37, 96), torch.randn(3 * 16 * 2 + 5, 96).bfloat16()  # 3 row blocks, a partial panel
    packed = pack_bf16(weight)
    together = emulated(x, packed, weight.shape[0], None)
    for r in range(x.shape[0]):
        assert torch.equal(emulated(x[r : r + 1].contiguous(), packed, weight.shape[0], None)[0], together[r])
        assert torch.equal(emulated(x[r:].contiguous(), packed, weight.shape[0], None)[0], together[r])


def test_input_denormals_count_as_zero_as_the_sdm_says(emulated):
    weight = torch.ones(16, 32, dtype=torch.bfloat16)
    x = torch.zeros(1, 32)
    x[0, 0] = 1e-39  # a bf16 denormal after rounding
    x[0, 1] = 2.0
    assert torch.equal(emulated(x, pack_bf16(weight), 16, None), torch.full((1, 16), 2.0))


@pytest.mark.parametrize(("x", "n", "bias", "message"), [
    (torch.randn(2, 64, dtype=torch.float64), 32, None, "float32"),
    (torch.randn(2, 62), 32, None, "columns"),
    (torch.randn(2, 64), 33, None, "does not fit"),
    (torch.randn(2, 64), 32, torch.ones(31), "bias must be"),
])
def test_refuses_what_it_does_not_compute(emulated, x, n, bias, message):
    with pytest.raises(RuntimeError, match=message):
        emulated(x, pack_bf16(torch.ones(32, 64, dtype=torch.bfloat16)), n, bias)


def test_without_amx_the_operator_is_absent_with_its_reason():
    reason = cpu_extension.amx_unavailable()
    if reason is None:
        assert cpu_extension.amx_bf16_gemm() is not None
        return
    assert cpu_extension.amx_bf16_gemm() is None
    assert "AMX" in reason or "AVX512" in reason or "operators are unavailable" in reason
    if cpu_extension.op("amx_status") is not None:  # the CPU's tiles refuse to run where they are not granted
        with pytest.raises(RuntimeError, match="amx_bf16_gemm: "):
            torch.ops.specserve.amx_bf16_gemm(torch.randn(1, 64), pack_bf16(torch.ones(16, 64).bfloat16()), 16, None)


needs_amx = pytest.mark.skipif(not HAS_BF16 or cpu_extension.amx_unavailable() is not None,
                               reason=f"no AMX here: {cpu_extension.amx_unavailable() if HAS_BF16 else 'no bf16'}")


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 130])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_cpus_tiles_compute_the_product(rows, out_features, in_features):
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features)
    got = cpu_extension.amx_bf16_gemm()(x, pack_bf16(weight), out_features, bias)
    exact = x.bfloat16().double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(got.double(), exact, atol=1e-4 * in_features ** 0.5, rtol=1e-5)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpus_tiles_are_batch_invariant(threads):
    gemm = cpu_extension.amx_bf16_gemm()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight = torch.randn(64, 576), torch.randn(3 * 16 * 11 + 5, 576).bfloat16()
        packed = pack_bf16(weight)
        together = gemm(x, packed, weight.shape[0], None)
        for rows in range(1, 65):
            part = gemm(x[:rows].contiguous(), packed, weight.shape[0], None)
            assert torch.equal(part, together[:rows]), rows
            assert torch.equal(gemm(x[rows - 1 :].contiguous(), packed, weight.shape[0], None)[0], together[rows - 1])
    finally:
        torch.set_num_threads(saved)
