"""engine/models/cpu/linear.py: the small-batch linear equals F.linear for every row count, uses
engine/models/cpu/extension.py's kernel where it is available, and otherwise takes the split GEMV for one row of a large
matrix."""

import pytest
import torch
import torch.nn.functional as F

from engine.models.cpu import linear as linear_module
from engine.models.cpu.linear import SPLIT_GEMV_MIN_ELEMENTS, linear


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows, with_bias, two_threads):
    torch.manual_seed(0)
    weight = torch.randn(1024, 320)  # 327,680 elements: above the split threshold
    assert weight.numel() >= SPLIT_GEMV_MIN_ELEMENTS
    bias = torch.randn(1024) if with_bias else None
    x = torch.randn(1, rows, 320)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_one_row_of_a_large_matrix_runs_as_one_bmm_per_thread_block(two_threads, monkeypatch):
    monkeypatch.setattr(linear_module.cpu_extension, "small_gemm", lambda: None)  # a machine without the kernel
    calls = []
    real_bmm = torch.bmm

    def spy(a, b):
        calls.append((tuple(a.shape), tuple(b.shape), b.stride()))
        return real_bmm(a, b)

    monkeypatch.setattr(torch, "bmm", spy)
    weight, x = torch.randn(1024, 320), torch.randn(1, 1, 320)
    out = linear(x, weight)
    assert calls == [((2, 512, 320), (2, 320, 1), (0, 1, 320))]  # the x^T layout: the fast bmm kernel
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(64, 320), (1023, 320)])  # small (stays in cache); rows not divisible by 2
def test_split_gemv_falls_back_to_f_linear(shape, two_threads, monkeypatch):
    monkeypatch.setattr(torch, "bmm", lambda *a: pytest.fail("bmm used"))
    weight, x = torch.randn(*shape), torch.randn(1, 320)
    torch.testing.assert_close(linear_module.linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize(("rows", "in_features", "used"), [(1, 320, True), (64, 320, True), (65, 320, False),
                                                            (8, 324, False)])
def test_rows_the_small_gemm_kernel_takes(rows, in_features, used, monkeypatch):
    seen = []

    def kernel(x, weight, bias):
        seen.append(tuple(x.shape))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module.cpu_extension, "small_gemm", lambda: kernel)
    x, weight = torch.randn(1, rows, in_features), torch.randn(1024, in_features)
    out = linear(x, weight)
    assert out.shape == (1, rows, 1024)
    assert seen == ([(rows, in_features)] if used else [])  # 64 rows at most, K a multiple of 8


@pytest.mark.parametrize("rows", [1, 8, 64, 200])
def test_bf16_weights_beside_fp32_activations_make_a_bf16_product_on_the_kernel(rows, two_threads):
    """The static runner's bf16 models on CPU: the activations rounded to bf16, fp32 sums and output, on the
    batch-invariant kernel for steps and prompt chunks alike (a row's bits never depend on the rows beside it)."""
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(1024, 320).bfloat16(), torch.randn(1024), torch.randn(1, rows, 320)
    want = F.linear(x.bfloat16().float(), weight.float(), bias)
    for step in (True, False, None):
        out = linear(x, weight, bias, step=step)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(out[:, :1], linear(x[:, :1], weight, bias, step=step))


@pytest.mark.parametrize(("rows", "step", "used"), [(200, True, True), (1, False, False), (64, None, True),
                                                    (65, None, False)])
def test_steps_take_the_kernel_for_every_row_and_prompt_chunks_never(rows, step, used, monkeypatch):
    """A verify of 4 tokens for 32 rows (128 rows) still runs on the batch-invariant kernel, so each row is
    computed as its decode step would be; prompt chunks take ATen's GEMM; callers that do not say: 64 rows."""
    seen = []

    def kernel(x, weight, bias):
        seen.append(tuple(x.shape))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module.cpu_extension, "small_gemm", lambda: kernel)
    linear(torch.randn(1, rows, 320), torch.randn(1024, 320), step=step)
    assert seen == ([(rows, 320)] if used else [])
