"""engine/models/cpu/csrc/bf16_gemm.cpp (cpu_extension.bf16_gemm, weights from linear.pack_bf16): the bf16 product
of bf16 models on CPUs with AVX512_BF16. Its sums are VDPBF16PS's, bit for bit; a row's result does not depend on the
rows beside it or on the threads; it refuses what it does not compute. Skipped where the CPU lacks AVX512_BF16 (then
bf16 models keep small_gemm, tests/engine/models/cpu/test_extension.py)."""

import platform

import pytest
import torch

from engine.models.cpu import extension as cpu_extension
from engine.models.cpu.linear import pack_bf16
from tests.engine.bf16_reference import dpbf16_reference, random_product


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


HAS_BF16 = platform.machine().lower() in ("x86_64", "amd64") and "avx512_bf16" in _cpu_flags()
pytestmark = pytest.mark.skipif(not HAS_BF16, reason="the CPU lacks AVX512_BF16")


@pytest.fixture(scope="module")
def gemm():
    op = cpu_extension.bf16_gemm()
    assert op is not None, f"bf16_gemm unavailable on an AVX512_BF16 CPU: {cpu_extension.why_unavailable()}"
    return op


def test_pack_puts_16_columns_by_a_pair_of_inputs_in_each_vector():
    weight = torch.arange(35 * 7, dtype=torch.float32).reshape(35, 7).bfloat16()  # N, K not multiples
    packed = pack_bf16(weight)
    assert packed.shape == (3, 4, 16, 2) and packed.dtype == torch.bfloat16
    for n, k in [(0, 0), (0, 1), (17, 4), (34, 6), (15, 3)]:
        assert packed[n // 16, k // 2, n % 16, k % 2] == weight[n, k]
    assert not packed[2, :, 3:].any() and not packed[:, 3, :, 1].any()  # padding is zero


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 2), (17, 7), (48, 64), (961, 576)])
def test_sums_are_vdpbf16ps_bit_for_bit(gemm, rows, out_features, in_features):
    x, weight, bias = random_product(rows, out_features, in_features, seed=rows * 13 + out_features)
    packed = pack_bf16(weight)
    assert torch.equal(gemm(x, packed, out_features, bias), dpbf16_reference(x, weight, bias))
    assert torch.equal(gemm(x, packed, out_features, None), dpbf16_reference(x, weight, None))
    exact = x.bfloat16().double() @ weight.double().t()
    torch.testing.assert_close(gemm(x, packed, out_features, None).double(), exact, atol=1e-4, rtol=1e-5)


def test_activations_round_to_nearest_even_as_torch_does(gemm):
    """Ties, values just off a tie, overflow to the largest bf16, NaN: the kernel's bf16 is torch's .bfloat16()."""
    ones = torch.zeros(16, 16, dtype=torch.bfloat16)
    ones.fill_diagonal_(1.0)  # y = bf16(x): column c picks input c
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0e38, 3.3e38,
                           -3.0e38, 1.0e-3, 65504.0, 2**-9, 1.00390625, 1.01171875, -2.5, 0.0, 7.0, 1e30])
    got = gemm(values[None].contiguous(), pack_bf16(ones), 16, None)[0]
    assert torch.equal(got, values.bfloat16().float())
    nan = gemm(torch.full((1, 16), float("nan")), pack_bf16(ones), 16, None)
    assert nan.isnan().all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(gemm, threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight = torch.randn(19, 576), torch.randn(3 * 16 * 11 + 5, 576).bfloat16()  # partial panel and vector
        packed = pack_bf16(weight)
        together = gemm(x, packed, weight.shape[0], None)
        for r in range(x.shape[0]):
            assert torch.equal(gemm(x[r : r + 1].contiguous(), packed, weight.shape[0], None)[0], together[r])
            assert torch.equal(gemm(x[r:].contiguous(), packed, weight.shape[0], None)[0], together[r])
    finally:
        torch.set_num_threads(saved)
    torch.set_num_threads(3 - threads)
    try:
        assert torch.equal(gemm(x, packed, weight.shape[0], None), together)  # the threads' split changes nothing
    finally:
        torch.set_num_threads(saved)


def test_no_rows_give_an_empty_result(gemm):
    assert gemm(torch.empty(0, 64), pack_bf16(torch.ones(32, 64, dtype=torch.bfloat16)), 32, None).shape == (0, 32)


@pytest.mark.parametrize(("x", "n", "bias", "message"), [
    (torch.randn(2, 64, dtype=torch.float64), 32, None, "float32"),
    (torch.randn(64, 2).t(), 32, None, "contiguous"),
    (torch.randn(2, 62), 32, None, "columns"),
    (torch.randn(2, 64), 33, None, "does not fit"),
    (torch.randn(2, 64), 16, None, "does not fit"),
    (torch.randn(2, 64), 32, torch.ones(31), "bias must be"),
])
def test_refuses_what_it_does_not_compute(gemm, x, n, bias, message):
    packed = pack_bf16(torch.ones(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=message):
        gemm(x, packed, n, bias)


def test_refuses_a_weight_that_is_not_packed(gemm):
    with pytest.raises(RuntimeError, match="pack_bf16"):
        gemm(torch.randn(2, 64), torch.ones(32, 64, dtype=torch.bfloat16), 32, None)
