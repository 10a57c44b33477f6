"""engine/models/cpu/extension.py: the small-batch kernel (fp32 activations; fp32, bf16 or int8 weights) builds on x86
machines with AVX2 and a compiler (this project's machines and CI), equals F.linear, gives a row the same bits whatever
rows share the call, and refuses what it does not compute; where it cannot be built the reason is clear."""

import platform

import pytest
import torch
import torch.nn.functional as F

from engine.models.cpu import extension as cpu_extension

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and \
    torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not X86_AVX2, reason="the kernel is x86 AVX2/FMA code")


@pytest.fixture(scope="module")
def kernel():
    op = cpu_extension.small_gemm()
    assert op is not None, f"small_gemm unavailable: {cpu_extension.why_unavailable()}"
    return op


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 33, 64, 130])
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
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 17, 64, 131])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 576), (1537, 576), (4099, 64)])
def test_bf16_and_int8_weights_are_widened_exactly(kernel, rows, out_features, in_features):
    """A bf16 weight makes a bf16 product: the activations rounded to bf16 (as torch rounds), each term exact, fp32
    sums and output; an int8 weight with per-channel scales is the fp32 product over its integers, scaled per output."""
    generator = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    bf16 = torch.randn(out_features, in_features, generator=generator).bfloat16()
    torch.testing.assert_close(kernel(x, bf16, bias), F.linear(x.bfloat16().float(), bf16.float(), bias),
                               atol=1e-4, rtol=1e-4)
    int8 = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, generator=generator) / 64
    torch.testing.assert_close(kernel(x, int8, None, scales), F.linear(x, int8.float()) * scales,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel(x, int8, bias, scales), F.linear(x, int8.float()) * scales + bias,
                               atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_narrow_weights_keep_a_row_s_bits_whatever_rows_share_the_call(kernel, dtype):
    x = torch.randn(9, 576)
    weight = torch.randn(3 * 500 + 1, 576).to(dtype) if dtype != torch.int8 else \
        torch.randint(-128, 128, (3 * 500 + 1, 576), dtype=torch.int8)
    scales = torch.rand(weight.shape[0]) if dtype == torch.int8 else None
    together = kernel(x, weight, None, scales)
    for r in range(x.shape[0]):
        assert torch.equal(kernel(x[r : r + 1].contiguous(), weight, None, scales)[0], together[r])


@needs_kernel
@pytest.mark.parametrize(("x", "weight", "message"), [
    (torch.randn(2, 12), torch.randn(8, 12), "multiple of 8"),
    (torch.randn(2, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64), "float32"),
    (torch.randn(2, 64), torch.randn(8, 32), "columns"),
    (torch.randn(64, 2).t(), torch.randn(8, 64), "contiguous"),
    (torch.randn(2, 64), torch.randn(8, 64).half(), "float32, bfloat16 or int8"),
    (torch.randn(2, 64), torch.ones(8, 64, dtype=torch.int8), "int8 weights need scales"),
])
def test_refuses_what_it_does_not_compute(kernel, x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        kernel(x, weight, None)


@needs_kernel
def test_scales_belong_to_int8_weights_only(kernel):
    with pytest.raises(RuntimeError, match="int8 weights need scales"):
        kernel(torch.randn(2, 64), torch.randn(8, 64), None, torch.ones(8))
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32"):
        kernel(torch.randn(2, 64), torch.ones(8, 64, dtype=torch.int8), None, torch.ones(7))


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_OPS", "aten")
    assert cpu_extension.why_unavailable() == "turned off (SPECSERVE_CPU_OPS=aten)"


@needs_kernel
def test_without_a_compiler_the_reason_names_it(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert "no C++ compiler" in cpu_extension.why_unavailable()


@needs_kernel
def test_a_failed_build_says_why_and_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.raises(cpu_extension.KernelUnavailable, match="failed"):
        cpu_extension.build()
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_the_library_is_cached_per_source_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path))
    path = cpu_extension.library_path()
    assert path.parent == tmp_path and path.name.startswith("specserve_ops-")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert cpu_extension.library_path() != path  # another torch build gets its own library


# ---- layer_ops.cpp: each fused operator against the Python it replaces (engine/models/static/layer_ops.py)
# --------------------

@pytest.fixture(scope="module")
def ops():
    assert cpu_extension.op("rms_norm") is not None, cpu_extension.why_unavailable()
    return torch.ops.specserve


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (2, 300, 24)])
def test_rms_norm_and_add_rms_norm(ops, shape):
    from engine.models.static.layer_ops import _rms_norm

    x, delta, weight = torch.randn(shape), torch.randn(shape), torch.rand(shape[-1]) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), _rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)
    hidden = x.clone()
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(hidden, x + delta)  # added in place
    torch.testing.assert_close(normed, _rms_norm(x + delta, weight, 1e-5), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("half", [40, 13, 1536])  # whole 8-lane vectors, a partial last one
def test_silu_mul(ops, half):
    gate_up = torch.cat([torch.randn(2, 3, 2 * half) * scale for scale in (0.1, 4, 40)])
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    want = F.silu(gate.double()) * up.double()  # the exact value: e^x is a polynomial within 2 ulp
    torch.testing.assert_close(got.double(), want, atol=1e-30, rtol=1e-6)
    rows = gate_up.reshape(-1, 2 * half)
    together = ops.silu_mul(rows)
    for r in (0, 5, rows.shape[0] - 1):  # a value's result does not depend on the values beside it
        assert torch.equal(ops.silu_mul(rows[r : r + 1].contiguous())[0], together[r])
    assert ops.silu_mul(torch.tensor([[float("nan"), 1.0]])).isnan().all()


def rope_inputs(heads, kv_heads, width, dim, slots, capacity, last_start):
    """qkv [3, W, (H + 2 KVH) D], cos/sin tables [capacity, D], positions [3, W] (rows starting at 7, 0 and
    `last_start`), fp32 K/V caches [slots, KVH, capacity, D] of random values."""
    qkv = torch.randn(3, width, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(capacity, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.tensor([[7], [0], [last_start]]) + torch.arange(width)
    caches = torch.randn(slots, kv_heads, capacity, dim), torch.randn(slots, kv_heads, capacity, dim)
    return qkv, cos, sin, positions, caches


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(9, 3, 1), (4, 4, 3), (8, 2, 5)])
def test_rope_to_cache_rotates_and_writes_where_the_python_step_does(ops, heads, kv_heads, width):
    from engine.models.static.rope import apply_rope

    batch, dim, first_slot = 3, 16, 1
    qkv, cos, sin, positions, (k_cache, v_cache) = rope_inputs(heads, kv_heads, width, dim, 5, 40, 30)
    k_want, v_want = k_cache.clone(), v_cache.clone()

    q = ops.rope_to_cache(qkv, cos, sin, positions, k_cache, v_cache, first_slot, heads, kv_heads)

    c, s = cos[positions][:, None], sin[positions][:, None]
    q_size, kv_size = heads * dim, kv_heads * dim
    q_want = apply_rope(qkv[..., :q_size].view(batch, width, heads, dim).transpose(1, 2), c, s)
    k = apply_rope(qkv[..., q_size : q_size + kv_size].view(batch, width, kv_heads, dim).transpose(1, 2), c, s)
    rows = torch.arange(first_slot, first_slot + batch)[:, None]
    k_want[rows, :, positions] = k.transpose(1, 2)
    v_want[rows, :, positions] = qkv[..., q_size + kv_size :].view(batch, width, kv_heads, dim)
    torch.testing.assert_close(q, q_want)
    torch.testing.assert_close(k_cache, k_want)  # the other slots and positions untouched
    torch.testing.assert_close(v_cache, v_want)


@needs_kernel
def test_rope_to_cache_refuses_positions_past_the_cache(ops):
    qkv, table = torch.randn(1, 1, 3 * 8), torch.ones(10, 8)
    cache = torch.zeros(2, 1, 10, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_to_cache(qkv, table, table, torch.tensor([[10]]), cache, cache.clone(), 0, 1, 1)
    with pytest.raises(RuntimeError, match="slots"):
        ops.rope_to_cache(qkv, table, table, torch.tensor([[3]]), cache, cache.clone(), 2, 1, 1)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(9, 3, 1), (4, 4, 4), (8, 2, 3), (4, 2, 13)])
def test_cache_attention_equals_masked_attention_over_each_rows_own_keys(ops, heads, kv_heads, width):
    from engine.models.static.layer_ops import grouped_attention, visible_keys

    batch, dim, slots, capacity, first_slot, kv_len = 3, 16, 5, 64, 1, 48
    q = torch.randn(batch, heads, width, dim)
    k_cache, v_cache = torch.randn(slots, kv_heads, capacity, dim), torch.randn(slots, kv_heads, capacity, dim)
    positions = torch.tensor([[5], [0], [40]]) + torch.arange(width)
    positions[1] = 60  # a padding row (position past every real key): reads kv_len keys, its output unused
    got = ops.cache_attention(q, k_cache, v_cache, first_slot, positions, kv_len, dim ** -0.5)
    rows = slice(first_slot, first_slot + batch)
    want = grouped_attention(q, k_cache[rows, :, :kv_len], v_cache[rows, :, :kv_len],
                             visible_keys(positions, kv_len), dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    alone = ops.cache_attention(q[2:].contiguous(), k_cache, v_cache, first_slot + 2, positions[2:].contiguous(),
                                kv_len, dim ** -0.5)
    assert torch.equal(alone[0], got[2]), "a row's attention does not depend on the rows beside it"


@needs_kernel
@pytest.mark.parametrize("dim", [64, 16, 136])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (8, 2), (4, 2)])
def test_a_querys_attention_is_the_same_bits_in_any_step_width(ops, dim, heads, kv_heads):
    """A query's result depends on its own position and keys only, not on how many queries share the call or where
    it falls among them: a prompt fed whole, in chunks or token by token writes the same keys and values, which
    exact prefix caching relies on (engine/models/static/prefix_cache.py). Head sizes of 64 (whole 64-lane blocks of
    values), 16 and 136 (a remainder); groups of 3, 4 and 2 heads, so queries go through register tiles of three and of
    two queries and alone (a width-1 step of one row: a head per task)."""
    capacity, width, start = 128, 37, 20
    k_cache, v_cache = torch.randn(1, kv_heads, capacity, dim), torch.randn(1, kv_heads, capacity, dim)
    q = torch.randn(1, heads, width, dim)
    positions = start + torch.arange(width)[None]
    kv_len = start + width
    whole = ops.cache_attention(q, k_cache, v_cache, 0, positions, kv_len, dim ** -0.5)
    for cut in (1, 5, 8, 30):
        for lo, hi in ((0, cut), (cut, width)):
            part = ops.cache_attention(q[:, :, lo:hi].contiguous(), k_cache, v_cache, 0,
                                       positions[:, lo:hi].contiguous(), kv_len, dim ** -0.5)
            assert torch.equal(part, whole[:, :, lo:hi]), (cut, lo, hi)
    one = ops.cache_attention(q[:, :, -1:].contiguous(), k_cache, v_cache, 0, positions[:, -1:].contiguous(),
                              kv_len + 40, dim ** -0.5)  # a longer key range: the extra keys are past the query
    assert torch.equal(one, whole[:, :, -1:])


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "width"), [(9, 3, 1), (4, 2, 4), (8, 2, 13)])
def test_a_bf16_cache_is_written_rounded_and_read_exactly(ops, heads, kv_heads, width):
    """rope_to_cache into a bf16 cache stores the bf16 rounding (torch's .bfloat16()) of what it stores in an fp32
    one, and cache_attention over it gives the bits it gives over an fp32 cache holding those same values: the
    loads widen exactly and the arithmetic is the fp32 one. Also with one head per task and a whole group per task
    (the kernel chooses by the number of tasks)."""
    batch, dim, first_slot = 3, 64, 1
    qkv, cos, sin, positions, (k32, v32) = rope_inputs(heads, kv_heads, width, dim, 5, 72, 50)
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    q32 = ops.rope_to_cache(qkv, cos, sin, positions, k32, v32, first_slot, heads, kv_heads)
    q16 = ops.rope_to_cache(qkv, cos, sin, positions, k16, v16, first_slot, heads, kv_heads)
    assert torch.equal(q16, q32)  # queries stay fp32
    assert torch.equal(k16, k32.bfloat16()) and torch.equal(v16, v32.bfloat16())
    kv_len = int(positions.max()) + 1
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = ops.cache_attention(q32, k16, v16, first_slot, positions, kv_len, dim ** -0.5)
            want = ops.cache_attention(q32, k16.float(), v16.float(), first_slot, positions, kv_len, dim ** -0.5)
            for b in range(batch):  # one row alone: few tasks, a head per task
                alone = ops.cache_attention(q32[b : b + 1].contiguous(), k16, v16, first_slot + b,
                                            positions[b : b + 1].contiguous(), kv_len, dim ** -0.5)
                assert torch.equal(alone[0], got[b]), (threads, b)
        finally:
            torch.set_num_threads(saved)
        assert torch.equal(got, want), threads


@needs_kernel
def test_caches_of_other_or_mixed_dtypes_are_refused(ops):
    q, positions = torch.randn(1, 2, 1, 8), torch.tensor([[3]])
    cache = torch.zeros(1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.cache_attention(q, cache, cache.bfloat16(), 0, positions, 4, 0.3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.cache_attention(q, cache.half(), cache.half(), 0, positions, 4, 0.3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rope_to_cache(torch.randn(1, 1, 4 * 8), torch.ones(8, 8), torch.ones(8, 8), positions, cache.double(),
                          cache.double(), 0, 2, 1)
