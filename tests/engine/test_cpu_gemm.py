"""engine/cpu_gemm.py: the small-batch fp32 kernel builds on x86 machines with AVX2 and a compiler (this project's
machines and CI), equals F.linear, gives a row the same bits whatever rows share the call, and refuses what it
does not compute; where it cannot be built the reason is clear."""

import platform

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_gemm

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and \
    torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not X86_AVX2, reason="the kernel is x86 AVX2/FMA code")


@pytest.fixture(scope="module")
def kernel():
    op = cpu_gemm.small_gemm()
    assert op is not None, f"small_gemm unavailable: {cpu_gemm.why_unavailable()}"
    return op


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 33, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (2, 64), (7, 576), (1024, 320), (4099, 1536)])
def test_equals_f_linear(kernel, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    torch.testing.assert_close(kernel(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(kernel, threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight = torch.randn(11, 576), torch.randn(3 * 700 + 2, 576)  # a partial last panel
        together = kernel(x, weight, None)
        for r in range(x.shape[0]):
            assert torch.equal(kernel(x[r : r + 1].contiguous(), weight, None)[0], together[r])
            assert torch.equal(kernel(x[: r + 1].contiguous(), weight, None)[r], together[r])
    finally:
        torch.set_num_threads(saved)
    torch.set_num_threads(3 - threads)
    try:
        assert torch.equal(kernel(x, weight, None), together)  # the threads' split changes nothing either
    finally:
        torch.set_num_threads(saved)


@needs_kernel
@pytest.mark.parametrize(("x", "weight", "message"), [
    (torch.randn(65, 64), torch.randn(8, 64), "at most 64 rows"),
    (torch.randn(2, 12), torch.randn(8, 12), "multiple of 8"),
    (torch.randn(2, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64), "float32"),
    (torch.randn(2, 64), torch.randn(8, 32), "columns"),
    (torch.randn(64, 2).t(), torch.randn(8, 64), "contiguous"),
])
def test_refuses_what_it_does_not_compute(kernel, x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        kernel(x, weight, None)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_GEMM", "aten")
    assert cpu_gemm.why_unavailable() == "turned off (SPECSERVE_CPU_GEMM=aten)"


@needs_kernel
def test_without_a_compiler_the_reason_names_it(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert "no C++ compiler" in cpu_gemm.why_unavailable()


@needs_kernel
def test_a_failed_build_says_why_and_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(cpu_gemm.KernelUnavailable, match="failed"):
        cpu_gemm.build()
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_the_library_is_cached_per_source_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    path = cpu_gemm.library_path()
    assert path.parent == tmp_path and path.name.startswith("small_gemm-")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert cpu_gemm.library_path() != path  # another torch build gets its own library
