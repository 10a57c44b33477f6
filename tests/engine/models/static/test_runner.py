"""The fast runner: same logits as transformers per family, a KV budget that refuses and reuses, chunked prefill,
no host sync inside a step, compiled == eager."""

import copy
import functools
import platform

import pytest
import torch

from engine.models.kv_budget import plan_num_slots
from engine.models.quantize import quantize_int8_weight_only
from engine.models.runner import KVCacheFull, resolve_dtype
from engine.models.static.forward import UnsupportedModel, why_unsupported
from engine.models.static.prefill_plan import prefill_groups
from engine.models.static.runner import KVBudget, StaticRunner
from engine.models.static.steps import forbid_host_sync, step_mode
from engine.models.transformers_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.engine.bf16_reference import dpbf16_reference

SLOTS = KVBudget(gib=1.0, max_num_seqs=4)


def scripted(runner, rounds):
    """Feed rows of mixed lengths over several calls, with a rollback; returns each call's logits."""
    out = []
    for seq_ids, feeds, widths in rounds:
        for s in seq_ids:
            if not runner.has(s):
                runner.add(s)
        out.append(runner.forward(seq_ids, feeds, widths))
    return out


ROUNDS = [
    (["a", "b", "c"], [[2, 3, 4, 5, 6, 7], [9, 8], [5]], [2, 1, 1]),  # three prompts of different lengths
    (["a", "b", "c"], [[11, 12, 13, 14], [13], [7, 9]], [4, 1, 2]),  # verify-like widths
    (["c", "a"], [[10], [21, 22, 23]], [1, 3]),  # a subset, out of slot order
    (["b"], [[(7 * t) % 60 + 2 for t in range(40)]], [3]),  # a long row: chunked prefill, then batched tail
    (["a", "b", "c"], [[3], [4], [5]], [1, 1, 1]),  # a decode step (one SDPA call per layer on CPU)
]


def reference(model):
    return scripted(ModelRunner(model), ROUNDS)


def assert_same_logits(got, want, rounds=ROUNDS, **tol):
    """Row b's logits at its first num_logits[b] positions (the rest of the padded width is unspecified)."""
    for g, w, (_, _, widths) in zip(got, want, rounds):
        for b, k in enumerate(widths):
            torch.testing.assert_close(g[b, :k], w[b, :k], **tol)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_static_forward_matches_transformers(family):
    model = make_tiny_model(family, seed=0)
    want = reference(model)
    got = scripted(StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16), ROUNDS)
    assert_same_logits(got, want, atol=1e-4, rtol=1e-4)


def test_rollback_then_refeed_matches():
    model = make_tiny_model("llama", seed=2)
    runner = StaticRunner(model, budget=SLOTS, compile=False)
    ref = ModelRunner(model)
    for r in (runner, ref):
        r.add("s")
        r.forward(["s"], [[2, 3, 4, 5]], [1])
        r.forward(["s"], [[6, 7, 8]], [3])  # drafts
        feed = r.sync("s", [2, 3, 4, 5, 6, 9])  # the last draft rejected
        assert feed == [9]
    torch.testing.assert_close(runner.forward(["s"], [[9]], [1]), ref.forward(["s"], [[9]], [1]),
                               atol=1e-4, rtol=1e-4)


def test_chunked_and_unchunked_prefill_give_the_same_logits():
    model = make_tiny_model("llama", seed=3)
    prompt = [(5 * t) % 60 + 2 for t in range(100)]

    def run(chunk):
        runner = StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=chunk)
        runner.add("s")
        first = runner.forward(["s"], [prompt], [1])
        return first, runner.forward(["s"], [[int(first.argmax())]], [1])

    for a, b in zip(run(16), run(128)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_int8_weights_run_on_the_fast_path():
    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))
    assert why_unsupported(model) is None
    got = scripted(StaticRunner(model, budget=SLOTS, compile=False), ROUNDS)  # bf16 activations, as quantized
    assert got[0].dtype == torch.float32 and got[0].shape[-1] == 64
    want = reference(model)
    assert_same_logits(got, want, atol=0.5, rtol=0.1)  # bf16 rounding, and a different int8 kernel
    agree = [(g[b, :k].argmax(-1) == w[b, :k].argmax(-1)).float().mean()
             for g, w, (_, _, widths) in zip(got, want, ROUNDS) for b, k in enumerate(widths)]
    assert sum(agree) / len(agree) > 0.9


def test_int8_weights_with_fp32_activations_feed_the_int8_kernel_bf16(monkeypatch):
    """Without specserve's CPU operators, an int8 draft with fp32 activations hands ATen's int8 kernel bf16 rows,
    its fast path; its logits stay those of the bf16-activation runner up to rounding."""
    from engine.models.cpu import extension as cpu_extension

    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))
    want = scripted(StaticRunner(model, budget=SLOTS, compile=False), ROUNDS)
    monkeypatch.setattr(cpu_extension, "small_gemm", lambda: None)
    fed = []
    kernel = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, w, s: fed.append((x.dtype, s.dtype)) or kernel(x, w, s))
    got = scripted(StaticRunner(model, budget=SLOTS, compile=False, dtype=torch.float32), ROUNDS)
    assert fed and set(fed) == {(torch.bfloat16, torch.bfloat16)}
    assert_same_logits(got, want, atol=0.5, rtol=0.1)


X86 = platform.machine().lower() in ("x86_64", "amd64")


def rounding_linear_inputs(model):
    """`model` (fp32) with every nn.Linear's input rounded to bf16: the fp32 forward of bf16 products."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    return model


def dpbf16_linears(model):
    """`model` (fp32, bf16-valued weights) whose nn.Linear layers compute as engine/models/cpu/csrc/bf16_gemm.cpp does:
    inputs rounded to bf16, exact products summed into fp32 a pair of k at a time, the odd k first, one rounding per
    addition (VDPBF16PS as Intel's SDM specifies it, and as this project's AVX512_BF16 machines compute it), then
    the bias (tests/engine/bf16_reference.py)."""
    def forward(module, x):
        rows = dpbf16_reference(x.reshape(-1, x.shape[-1]), module.weight, module.bias)
        return rows.reshape(*x.shape[:-1], -1)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = functools.partial(forward, module)
    return model


@pytest.mark.skipif(not X86, reason="specserve's CPU operators are x86 code")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_bf16_weights_with_fp32_activations_make_bf16_products_and_keep_the_rest_fp32(family):
    """How a bf16 model runs on CPU (engine/factory.cpu_step_dtypes): weights stay bf16, each product takes
    bf16-rounded activations with fp32 sums, norms, attention, residuals and the KV cache are fp32. The logits equal
    that reference up to where a last-bit difference in fp32 (the bias is added in another order, attention sums in
    another order) moves an activation across a bf16 rounding boundary, one bf16 step (2^-8 relative)."""
    model = make_tiny_model(family, seed=0).to(torch.bfloat16)
    runner = StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16, dtype=torch.float32,
                          weight_dtype=torch.bfloat16)
    layer = runner.model.layers[0]
    # packed: bf16_gemm (AVX512_BF16) computes the products, else small_gemm (fp32 FMAs in k order)
    products = dpbf16_linears if layer.qkv.packed is not None else rounding_linear_inputs
    want = reference(products(copy.deepcopy(model).float()))
    stored = [p.packed if p.packed is not None else p.weight for p in (layer.qkv, layer.down)]  # packed: bf16_gemm
    assert {*(w.dtype for w in stored), runner.model.embed.dtype} == {torch.bfloat16}
    assert runner.model.k_cache_0.dtype == torch.float32
    got = scripted(runner, ROUNDS)
    assert_same_logits(got[:3], want[:3], rounds=ROUNDS[:3], atol=0.05, rtol=0.02)
    exact = [torch.equal(g[b, :k], w[b, :k]) for g, w, (_, _, widths) in zip(got[:3], want[:3], ROUNDS[:3])
             for b, k in enumerate(widths)]
    assert sum(exact) >= len(exact) - 2, exact  # bit for bit, but for such a flip or two
    assert_same_logits(got[3:], want[3:], rounds=ROUNDS[3:], atol=0.05, rtol=0.02)


@pytest.mark.skipif(not X86, reason="specserve's CPU operators are x86 code")
def test_an_fp32_verify_of_every_width_scores_each_position_with_a_decode_steps_bits():
    """A verify pass (a chain of K drafts, or a token tree's nodes: up to the runner's widest step) runs its fp32
    products on the kernel a decode step runs, so greedy speculation emits plain decoding's tokens bit for bit, near
    ties included (past 8 positions they had taken MKL's product, whose sums differ in the last bits)."""
    from engine.models.static import runner as runner_module
    from engine.models.static.forward import STEP_MAX_WIDTH

    assert STEP_MAX_WIDTH == runner_module.MAX_WIDTH
    model = make_tiny_model("llama", seed=2)
    prompt, tokens = [5, 9, 14, 3, 22, 8, 17, 30], [(7 * t + 11) % 60 + 2 for t in range(STEP_MAX_WIDTH)]
    runner = StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=32)
    runner.add("decoded")
    runner.forward(["decoded"], [prompt], [1])
    decoded = [runner.forward(["decoded"], [[t]], [1])[0, -1].clone() for t in tokens]
    for width in (4, 9, STEP_MAX_WIDTH):
        runner.add(f"verified{width}")
        runner.forward([f"verified{width}"], [prompt], [1])
        verified = runner.forward([f"verified{width}"], [tokens[:width]], [width])[0]
        assert all(torch.equal(verified[i], decoded[i]) for i in range(width)), width


@pytest.mark.skipif(not X86, reason="specserve's CPU operators are x86 code")
@pytest.mark.parametrize("product", ["vdpbf16ps", "amx"])
def test_a_bf16_rows_step_is_the_same_bits_in_any_batch(product, monkeypatch):
    """Steps of every width and batch, and prompt chunks, run their products on a batch-invariant kernel (either one
    engine/models/cpu/bf16_products.py may choose): a row's logits are the bits the same row gets alone, so batching
    never changes a greedy text."""
    from engine.models.cpu import bf16_products
    from engine.models.cpu import extension as cpu_extension

    if product == "amx" and cpu_extension.amx_unavailable() is not None:
        pytest.skip(f"no AMX here: {cpu_extension.amx_unavailable()}")
    monkeypatch.setattr(bf16_products, "_current", None)
    monkeypatch.setenv("SPECSERVE_BF16_PRODUCT", product)
    model = make_tiny_model("llama", seed=1).to(torch.bfloat16)

    def run(rows):
        runner = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=24), compile=False, dtype=torch.float32,
                              weight_dtype=torch.bfloat16)
        ids = [f"r{i}" for i in range(rows)]
        for i, s in enumerate(ids):
            runner.add(s)
        first = runner.forward(ids, [[2 + i] + [3, 4, 5] * 8 for i in range(rows)], [1] * rows)  # prompt chunks
        return first, runner.forward(ids, [[6, 7, 8, 9]] * rows, [4] * rows)  # 4 tokens per row: up to 96 rows

    (prompt_alone, alone), (prompt_batched, batched) = run(1), run(24)
    assert torch.equal(prompt_alone[0], prompt_batched[0]) and torch.equal(alone[0], batched[0])


@pytest.mark.skipif(not X86, reason="specserve's CPU operators are x86 code")
def test_int8_weights_with_fp32_activations_are_the_fp32_model_of_the_dequantized_weights(monkeypatch):
    """An int8 draft on CPU: specserve's kernel widens the integers in registers and scales each output, the
    activations stay fp32 (ATen's int8 kernel is not called), so the logits are the dequantized fp32 model's."""
    from engine.models.quantize import Int8WeightOnlyLinear

    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))
    dequantized = make_tiny_model("llama", seed=0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Int8WeightOnlyLinear):
                dequantized.get_submodule(name).weight.copy_(module.weight_int8.float() * module.scales.float()[:, None])
        for name, param in model.named_parameters():
            dequantized.get_parameter(name).copy_(param.float())
        for name, buffer in model.named_buffers():  # RoPE's inv_freq, rounded to bf16 with the rest of the model
            if not name.endswith(("weight_int8", "scales")):
                dequantized.get_buffer(name).copy_(buffer.float())
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: pytest.fail("ATen's int8 kernel used"))
    got = scripted(StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16, dtype=torch.float32,
                                weight_dtype=torch.bfloat16), ROUNDS)
    assert_same_logits(got, reference(dequantized), atol=1e-4, rtol=1e-4)


def test_other_families_are_refused_with_the_reason():
    assert "gpt2" in why_unsupported(make_tiny_model("gpt2"))
    with pytest.raises(UnsupportedModel):
        StaticRunner(make_tiny_model("gpt2"), budget=SLOTS, compile=False)


def test_budget_sets_the_slots_refuses_when_full_and_reuses_released_space():
    model = make_tiny_model("llama", seed=0)
    from engine.models.static.forward import StaticLlama

    per_slot = StaticLlama.slot_bytes(model.config, 256 + 16, torch.float32)
    runner = StaticRunner(model, max_model_len=256, budget=KVBudget(gib=2.5 * per_slot / (1 << 30)),
                          compile=False, prefill_chunk=16)
    assert runner.capacity == 2
    assert runner.model.cache_bytes() == 2 * per_slot
    runner.add("a")
    runner.add("b")
    with pytest.raises(KVCacheFull):
        runner.add("c")
    runner.forward(["a", "b"], [[2, 3, 4], [5, 6]], [1, 1])
    before = runner.forward(["b"], [[7]], [1])
    runner.release("a")  # b moves into slot 0
    runner.add("c")
    assert runner.sync("b", [5, 6, 7]) == [7]  # the last token is fed again for its logits
    again = runner.forward(["b"], [[7]], [1])
    torch.testing.assert_close(before, again)
    caches = [t.data_ptr() for t in runner.model.k_cache]
    runner.forward(["c", "b"], [[9, 9, 9], [8]], [1, 1])
    assert [t.data_ptr() for t in runner.model.k_cache] == caches  # never reallocated


def test_a_budget_below_one_sequence_is_an_error_that_says_what_to_change():
    with pytest.raises(ValueError, match="max_model_len"):
        plan_num_slots(slot_bytes=1000, budget_bytes=999, max_num_seqs=8)


def test_prompts_of_different_lengths_prefill_together_with_each_ones_own_logits():
    """Three new prompts (40, 70 and 100 tokens, chunks of 16) in one call: their chunks share forwards, and every
    row's logits (and the next step's) equal the transformers forward of that prompt alone."""
    model = make_tiny_model("llama", seed=4)
    prompts = [[(3 * t + 7 * b) % 60 + 2 for t in range(n)] for b, n in enumerate((40, 70, 100))]
    runner = StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16)
    calls = []
    run = runner._run
    runner._run = lambda ids, *args, **kw: calls.append(tuple(ids.shape)) or run(ids, *args, **kw)
    for b in range(3):
        runner.add(f"p{b}")
    got = runner.forward(["p0", "p1", "p2"], prompts, [1, 1, 1])
    nxt = runner.forward(["p0", "p1", "p2"], [[5], [6], [7]], [1, 1, 1])
    for b, prompt in enumerate(prompts):
        ref = ModelRunner(model)
        ref.add("s")
        torch.testing.assert_close(got[b, :1], ref.forward(["s"], [prompt], [1])[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(nxt[b, :1], ref.forward(["s"], [[5 + b]], [1])[0], atol=1e-4, rtol=1e-4)
    prefill = [shape for shape in calls if shape[0] > 1 and shape[1] == 16]
    assert prefill, f"no prefill forward held more than one row: {calls}"


def test_the_same_prompt_in_several_rows_is_computed_once_and_copied():
    """The n choices of one request: three rows with one 60-token prompt (and one other prompt) in a call. The
    shared prompt's chunks run for one row only; every row's logits, now and at the next (different) tokens, equal
    the transformers forward."""
    model = make_tiny_model("llama", seed=5)
    shared, other = [(5 * t) % 60 + 2 for t in range(60)], [(3 * t) % 50 + 4 for t in range(30)]
    runner = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=8), compile=False, prefill_chunk=16)
    fed_rows = []
    run = runner._run
    runner._run = lambda ids, *args, **kw: fed_rows.append(ids.shape[0]) or run(ids, *args, **kw)
    seq_ids = ["c0", "x", "c1", "c2"]
    for s in seq_ids:
        runner.add(s)
    got = runner.forward(seq_ids, [shared, other, shared, shared], [1, 1, 1, 1])
    prefill_calls = len(fed_rows) - 1
    nxt = runner.forward(seq_ids, [[7], [8], [9], [10]], [1, 1, 1, 1])
    for b, (prompt, token) in enumerate(zip([shared, other, shared, shared], [7, 8, 9, 10])):
        ref = ModelRunner(model)
        ref.add("s")
        torch.testing.assert_close(got[b, :1], ref.forward(["s"], [prompt], [1])[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(nxt[b, :1], ref.forward(["s"], [[token]], [1])[0], atol=1e-4, rtol=1e-4)
    # 59 head tokens of the shared prompt in 4 chunks, for one row (grouped with "x"'s 2 chunks where they meet)
    assert sum(fed_rows[:prefill_calls]) <= 4 + 2, f"rows fed per prefill forward: {fed_rows[:prefill_calls]}"


def test_prefill_groups_take_neighbouring_slots_within_the_token_and_padding_limits():
    assert prefill_groups([0, 1, 2], [16, 16, 16], 64) == [[0, 1, 2]]
    assert prefill_groups([0, 1, 3], [16, 16, 16], 64) == [[0, 1], [2]]  # slot 2 is not in the call
    assert prefill_groups([0, 1, 2, 3, 4], [16] * 5, 64) == [[0, 1, 2, 3], [4]]  # at most 64 padded tokens
    assert prefill_groups([0, 1], [16, 2], 64) == [[0], [1]]  # 32 padded tokens for 18 real
    assert prefill_groups([0, 1, 2], [16, 2, 2], 64) == [[0], [1, 2]]
    assert prefill_groups([0, 1], [16, 9], 64) == [[0], [1]]  # 32 for 25: past PREFILL_MAX_PADDING
    assert prefill_groups([0, 1, 2], [16, 15, 14], 64) == [[0, 1, 2]]  # 48 for 45


def test_no_host_sync_inside_a_step():
    runner = StaticRunner(make_tiny_model("llama", seed=0), budget=SLOTS, compile=False)
    runner.add("a")
    runner.add("b")
    step = runner._step

    def guarded(*args):
        with forbid_host_sync(runner.device):
            return step(*args)

    runner._step = guarded
    runner.forward(["a", "b"], [[2, 3, 4], [5]], [1, 1])
    runner.forward(["a", "b"], [[6, 7], [8]], [2, 1])
    with pytest.raises(RuntimeError, match="host sync"), forbid_host_sync(runner.device):
        torch.ones(1).item()  # the guard itself is live


def test_dtype_auto_picks_bf16_only_where_computed_natively(monkeypatch):
    import engine.models.runner as runner_mod

    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(runner_mod, "cpu_computes_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(runner_mod, "cpu_computes_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"


@pytest.mark.slow
def test_compiled_agrees_with_eager():
    model = make_tiny_model("llama", seed=4, layers=1)
    eager = scripted(StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=32), ROUNDS)
    compiled = scripted(StaticRunner(model, budget=SLOTS, compile=True, prefill_chunk=32), ROUNDS)
    assert_same_logits(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_fused_cpu_layer_operators_give_the_aten_layers_logits(family, monkeypatch):
    """engine/models/cpu/csrc/layer_ops.cpp (norms, SwiGLU, RoPE with the cache write) against the ATen code it replaces."""
    import platform

    from engine.models.static import layer_ops

    model = make_tiny_model(family, seed=0)
    runner = StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16)
    m = runner.model
    step = (m.layer_shape, m.cos, m.sin, torch.zeros(1, 1, dtype=torch.long), 0, 64)  # positions, first slot, keys
    if platform.machine() == "x86_64":  # this project's machines: the fused path must be the one taken
        assert layer_ops.LayerOps.for_step(*step).fused is not None
    fused = scripted(runner, ROUNDS)
    monkeypatch.setattr(layer_ops.cpu_extension, "op", lambda name: None)
    assert layer_ops.LayerOps.for_step(*step).fused is None
    aten = scripted(StaticRunner(model, budget=SLOTS, compile=False, prefill_chunk=16), ROUNDS)
    assert_same_logits(fused, aten, atol=1e-4, rtol=1e-4)


def test_runner_compile_picks_cuda_graphs_on_cuda_and_eager_on_cpu_unless_told():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [step_mode(setting, cpu) for setting in ("auto", "on", "off", True, False)] == [
        "eager", "inductor", "eager", "inductor", "eager"]
    assert [step_mode(setting, cuda) for setting in ("auto", "on", "off", True, False)] == [
        "graphs", "graphs", "eager", "graphs", "eager"]
    with pytest.raises(ValueError, match="auto, on or off"):
        step_mode("sometimes", cpu)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_the_cuda_graph_step_forward_matches_transformers(family):
    """The graph path's forward (rows in call order at any slots, padded to batch and width buckets, each row's
    slot, start and key limit as device tensors), run eagerly here: what a captured graph replays on CUDA."""
    model = make_tiny_model(family, seed=0)
    runner = StaticRunner(model, budget=SLOTS, compile="graphs", prefill_chunk=16)
    got = scripted(runner, ROUNDS)
    assert_same_logits(got, reference(model), atol=1e-4, rtol=1e-4)
    assert runner.graphs.eager_steps == len(ROUNDS) and runner.graphs.replays == 0  # nothing captured on a CPU


def test_graph_steps_pad_rows_into_the_scratch_tail_and_make_no_host_sync():
    model = make_tiny_model("llama", seed=2)
    runner = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=8), compile="graphs", prefill_chunk=16)
    for s, prompt in (("a", [2, 3, 4]), ("b", [5, 6]), ("c", [7])):
        runner.add(s)
        runner.forward([s], [prompt], [1])
    forward_rows = runner.model.forward_rows
    seen = []

    def guarded(tokens, rows, layers=None):
        seen.append((tokens.clone(), rows.slots.clone(), rows.starts.clone(), rows.limits.clone()))
        with forbid_host_sync(runner.device):
            return forward_rows(tokens, rows, layers)

    runner.model.forward_rows = guarded
    runner.forward(["c", "a", "b"], [[9, 10], [11], [12, 13, 14]], [2, 1, 3])  # 3 rows -> 4, width 3 -> 4
    tokens, slots, starts, limits = seen[-1]
    assert tokens.shape == (4, 4)
    assert slots.tolist() == [2, 0, 1, 0] and starts.tolist() == [1, 3, 2, runner.max_model_len]
    assert limits.tolist() == [5, 7, 6, 0]  # real rows: start + width; the padding row reads no key
    assert tokens[0].tolist() == [9, 10, 0, 0] and tokens[3].tolist() == [0, 0, 0, 0]
    assert [runner.cached_tokens(s) for s in "abc"] == [[2, 3, 4, 11], [5, 6, 12, 13, 14], [7, 9, 10]]


def test_a_kv_budget_given_as_a_fraction_leaves_room_for_the_graphs(monkeypatch):
    import engine.models.kv_budget as kv_budget
    import engine.models.static.runner as runner
    from engine.models.static.forward import StaticLlama

    monkeypatch.setattr(kv_budget, "free_memory_bytes", lambda device: 10 << 30)
    assert KVBudget(fraction=0.5).bytes_for(torch.device("cpu"), reserve=2 << 30) == 4 << 30
    assert KVBudget(gib=1.0, fraction=0.5).bytes_for(torch.device("cpu"), reserve=2 << 30) == 1 << 30  # as given
    model = make_tiny_model("llama", seed=0)
    budget = KVBudget(fraction=2e-4, max_num_seqs=512)
    eager, graphs = (StaticRunner(model, budget=budget, compile=mode) for mode in ("off", "graphs"))
    # the graphs' reserve is sized for max_num_seqs rows of the widest step and comes out of the free memory first
    reserve = runner.estimate_graph_bytes(model.config, 512, runner.MAX_WIDTH, model.config.vocab_size)
    slot = StaticLlama.slot_bytes(model.config, graphs.model.capacity, graphs.kv_cache_dtype)
    assert eager.capacity == int((10 << 30) * 2e-4) // slot
    assert graphs.capacity == int(((10 << 30) - reserve) * 2e-4) // slot < eager.capacity


def test_graph_stats_count_steps_and_stay_off_where_steps_are_not_graphs():
    model = make_tiny_model("llama", seed=1)
    assert StaticRunner(model, budget=SLOTS, compile="off").graph_stats() is None
    runner = StaticRunner(model, budget=SLOTS, compile="graphs")
    runner.add("a")
    runner.forward(["a"], [[2, 3]], [1])
    runner.forward(["a"], [[4]], [1])
    stats = runner.graph_stats()
    assert stats["eager_steps"] == 2 and stats["replays"] == 0 and stats["captured"] == 0
    assert stats["device_ms_per_step"] is None  # no replay timed on a CPU


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: what was captured is the forward's inputs and output tensors;
    a replay recomputes into that same output from those same inputs (their current contents), as a graph does."""

    capturing = None

    def __init__(self):
        self.args, self.out, self.replays = None, None, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.forward(*self.args))


def test_captured_graph_steps_replay_the_buffers_they_were_captured_with(monkeypatch):
    """GraphSteps.capture and replay, on a CPU with torch.cuda's graph API faked: every captured shape is replayed
    from the staging buffers the step fills, and the logits equal transformers' over mixed rounds."""
    import contextlib

    model = make_tiny_model("llama", seed=7)
    runner = StaticRunner(model, budget=SLOTS, compile="graphs", prefill_chunk=16)
    forward = runner.model.forward_rows

    def recording(tokens, rows, layers=None):
        out = forward(tokens, rows, layers)
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.args, _FakeGraph.capturing.out = (tokens, rows, layers), out
        return out

    @contextlib.contextmanager
    def graph(g, pool=None):
        _FakeGraph.capturing = g
        try:
            yield
        finally:
            _FakeGraph.capturing = None

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    _FakeGraph.forward = staticmethod(forward)
    runner.model.forward_rows = recording
    for name, value in (("CUDAGraph", _FakeGraph), ("graph", graph), ("Stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("current_stream", lambda device=None: Stream()),
                        ("synchronize", lambda device=None: None), ("memory_reserved", lambda device=None: 0),
                        ("graph_pool_handle", lambda: ("pool",))):
        monkeypatch.setattr(torch.cuda, name, value)
    shapes = [(rows, width) for rows in runner.batch_buckets for width in (1, 2, 4)]
    runner.graphs.capture(shapes)
    assert set(runner.graphs.graphs) == {(rows, width, None) for rows, width in shapes}
    got = scripted(runner, ROUNDS)
    assert_same_logits(got, reference(model), atol=1e-4, rtol=1e-4)
    replayed = sum(g.replays for g, _ in runner.graphs.graphs.values())
    assert replayed == runner.graphs.replays > 0 and runner.graphs.stats()["captured"] == len(shapes)
    # the widths captured cover decode and verify rounds; a prompt's wider tail ran eagerly, never captured
    assert runner.graphs.eager_steps > 0 and runner.graphs.replays + runner.graphs.eager_steps == len(ROUNDS)


def test_warm_up_runs_every_cpu_step_shape_the_serving_loop_uses():
    runner = StaticRunner(make_tiny_model("llama", seed=0), budget=SLOTS, compile="off", prefill_chunk=16)
    calls = []
    run = runner._run
    runner._run = lambda ids, *args, **kwargs: calls.append(tuple(ids.shape)) or run(ids, *args, **kwargs)
    assert runner.warm_up(max_k=3) == len(calls) == 2 * len(runner.batch_buckets) + len(runner.chunk_buckets)
    assert {(rows, 4) for rows in runner.batch_buckets} <= set(calls)  # every batch at width K + 1
