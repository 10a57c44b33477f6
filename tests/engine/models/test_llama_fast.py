"""The lean Llama-family forward gives the transformers forward's logits, float and int8."""

import pytest
import torch

from engine.models.llama_fast import supports
from engine.models.quantize import quantize_int8_weight_only
from engine.models.transformers_runner import ModelRunner
from tests.conftest import make_tiny_model


def run(runner):
    runner.add("a")
    runner.add("b")
    first = runner.forward(["a", "b"], [[2, 3, 4, 5, 6, 7], [9, 8]], [2, 1])
    second = runner.forward(["a", "b"], [[11, 12], [13]], [2, 1])
    return first, second


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fast_path_matches_transformers(family):
    model = make_tiny_model(family, seed=0)
    fast = ModelRunner(model)
    assert fast._fast is not None
    slow = ModelRunner(model, fast_path=False)
    for got, want in zip(run(fast), run(slow)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_fast_path_with_int8_weights():
    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))
    assert supports(model)
    fast, slow = ModelRunner(model), ModelRunner(model, fast_path=False)
    for got, want in zip(run(fast), run(slow)):
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_other_families_keep_the_transformers_path():
    assert not supports(make_tiny_model("gpt2"))
    assert not supports(make_tiny_model("gemma"))


def test_int8_prefill_takes_the_dense_path_with_the_same_logits(monkeypatch):
    import engine.models.llama_fast as llama_fast

    model = quantize_int8_weight_only(make_tiny_model("llama", seed=0))
    prompt = [(5 * t) % 60 + 2 for t in range(llama_fast.INT8_KERNEL_MAX_ROWS + 9)]

    def prefill_logits():
        runner = ModelRunner(model)
        runner.add("s")
        return runner.forward(["s"], [prompt], [4])

    dense = prefill_logits()
    monkeypatch.setattr(llama_fast, "INT8_KERNEL_MAX_ROWS", 10**9)
    kernel = prefill_logits()
    torch.testing.assert_close(dense, kernel, atol=0.05, rtol=0.05)
