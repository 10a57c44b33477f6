"""engine/factory.py: the draft method is one vocabulary, parsed once, and proposers are chosen in one place."""

import pytest

from engine.factory import DraftMethod, EngineConfig, build_proposer
from engine.proposers import DraftModelProposer, NgramProposer


@pytest.mark.parametrize("draft, method", [("ngram", DraftMethod.NGRAM), ("none", DraftMethod.NONE),
                                           ("smollm2", DraftMethod.MODEL), ("/models/draft.gguf", DraftMethod.MODEL)])
def test_a_config_s_draft_names_one_method(draft, method):
    assert DraftMethod.of(draft) is method and EngineConfig(draft=draft).draft_method is method


def test_the_serving_config_parses_the_same_method():
    from deployments.config import SpecServeConfig

    for draft, method in (("ngram", DraftMethod.NGRAM), ("none", DraftMethod.NONE), ("smollm2", DraftMethod.MODEL)):
        model = SpecServeConfig.model_validate({"model": {"draft": draft}}).model
        assert model.draft_method is method and model.uses_draft_model == (method is DraftMethod.MODEL)


def test_proposers_are_built_by_method(tmp_path):
    from engine.loading import load_tokenizer, resolve
    from tests.conftest import make_tiny_model
    from tests.deployments.conftest import save_model_pair

    target, draft = (str(d) for d in save_model_pair(tmp_path, make_tiny_model(seed=0), make_tiny_model(seed=1)))

    tokenizer = load_tokenizer(resolve(target))

    def build(**config):
        return build_proposer(EngineConfig(target=target, **config), tokenizer, len(tokenizer))

    assert build(draft="none") is None
    assert isinstance(build(draft="ngram"), NgramProposer)
    assert isinstance(build(draft=draft, draft_dtype="float32", runner="transformers"), DraftModelProposer)


def test_bf16_models_on_cpu_run_bf16_weights_with_fp32_activations_where_the_operators_load(monkeypatch):
    import torch

    from engine import cpu_extension, factory
    from tests.conftest import make_tiny_model

    bf16, fp32 = make_tiny_model(seed=0).to(torch.bfloat16), make_tiny_model(seed=0)
    monkeypatch.setattr(cpu_extension, "small_gemm", lambda: object())
    assert factory.cpu_step_dtypes(bf16, compile=False) == (torch.float32, torch.bfloat16)
    assert factory.cpu_step_dtypes(fp32, compile=False) == (None, None)
    monkeypatch.setattr(factory, "cpu_computes_bf16", lambda: True)
    assert factory.cpu_step_dtypes(bf16, compile=True) == (None, None)  # compiled steps keep the model's dtype
    monkeypatch.setattr(cpu_extension, "small_gemm", lambda: None)
    assert factory.cpu_step_dtypes(bf16, compile=False) == (None, None)  # native bf16 without the operators
    monkeypatch.setattr(factory, "cpu_computes_bf16", lambda: False)
    assert factory.cpu_step_dtypes(bf16, compile=False) == (torch.float32, None)  # emulated bf16: fp32 steps
