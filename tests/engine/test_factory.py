"""engine/factory.py: the draft method is one vocabulary, parsed once, and proposers are chosen in one place."""

import pytest

from engine.factory import DraftMethod, EngineConfig, build_proposer
from engine.proposers.draft_model import DraftModelProposer
from engine.proposers.ngram import NgramProposer


@pytest.mark.parametrize("draft, method", [("ngram", DraftMethod.NGRAM), ("none", DraftMethod.NONE),
                                           ("smollm2", DraftMethod.MODEL), ("/models/draft.gguf", DraftMethod.MODEL),
                                           ("self", DraftMethod.SELF), ("self:4", DraftMethod.SELF),
                                           ("medusa:/heads", DraftMethod.MEDUSA), ("eagle3:/head", DraftMethod.EAGLE3),
                                           ("selfie", DraftMethod.MODEL)])
def test_a_config_s_draft_names_one_method(draft, method):
    assert DraftMethod.of(draft) is method and EngineConfig(draft=draft).draft_method is method


def test_the_serving_config_s_draft_source_is_decided_here():
    from deployments.config import SpecServeConfig

    def source(draft):
        return SpecServeConfig.model_validate({"model": {"draft": draft}}).draft_source()

    ngram = source("ngram")
    assert isinstance(ngram.local, NgramProposer) and not ngram.remote and ngram.drafts
    model = source("smollm2")
    assert model.local is None and model.remote and model.drafts
    assert not source("none").drafts and source("none").local is None
    for inside in ("self", "self:2", "medusa:/heads", "eagle3:/head"):
        own = source(inside)
        assert own.in_target and own.drafts and not own.remote and own.local is None


@pytest.mark.parametrize("draft, message", [("self:0", "layer count"), ("self:x", "layer count"),
                                            ("medusa:", "checkpoint directory"),
                                            ("eagle3:", "checkpoint directory")])
def test_a_malformed_draft_is_refused_naming_the_field(draft, message):
    from engine.factory import parse_draft

    with pytest.raises(ValueError, match=f"model.draft.*{message}"):
        parse_draft(draft)


def test_a_drafter_inside_the_target_needs_the_static_runner_and_an_exit_inside_the_model():
    from engine.factory import build_target_drafter
    from engine.models.kv_budget import KVBudget
    from engine.models.static.runner import StaticRunner
    from engine.models.transformers_runner import ModelRunner
    from engine.proposers.early_exit import EarlyExitDrafter
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama", seed=0, layers=3)
    static = StaticRunner(model, budget=KVBudget(max_num_seqs=2), compile="off")
    assert build_target_drafter(EngineConfig(draft="ngram"), static) is None
    drafter = build_target_drafter(EngineConfig(draft="self:2"), static)
    assert isinstance(drafter, EarlyExitDrafter) and drafter.exit_layers == 2
    with pytest.raises(ValueError, match="num_hidden_layers"):
        build_target_drafter(EngineConfig(draft="self:3"), static)
    skipping = build_target_drafter(EngineConfig(draft="self:skip:1-1"), static)
    assert skipping.exit_layers == (0, 2) and skipping.name == "self:skip:1-1"
    with pytest.raises(ValueError, match="keeps the first and the last"):
        build_target_drafter(EngineConfig(draft="self:skip:1-2"), static)
    with pytest.raises(ValueError, match="self:skip:A-B"):
        build_target_drafter(EngineConfig(draft="self:skip:2"), static)
    with pytest.raises(ValueError, match="static runner"):
        build_target_drafter(EngineConfig(draft="self:1"), ModelRunner(model))
    auto = build_target_drafter(EngineConfig(draft="self", num_speculative_tokens=2), static)
    assert auto.exit_layers in (1, 2) and static.num_live == 0, "chosen by measurement, its slots freed"


def test_nothing_outside_the_factory_branches_on_the_draft_method():
    from tests import REPO

    users = sorted(str(path.relative_to(REPO)) for package in ("engine", "deployments")
                   for path in (REPO / package).rglob("*.py") if "DraftMethod" in path.read_text())
    assert users == ["engine/factory.py"], users


def test_proposers_are_built_by_method(tmp_path):
    from engine.models.loading import load_tokenizer, resolve
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

    from engine import factory
    from engine.models.cpu import extension as cpu_extension
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


def test_the_kv_cache_holds_the_models_weight_dtype_unless_configured():
    import pytest
    import torch

    from engine import factory
    from engine.models.static.forward import StaticLlama
    from tests.conftest import make_tiny_model

    bf16, fp32 = make_tiny_model(seed=0).to(torch.bfloat16), make_tiny_model(seed=0)
    assert factory.kv_cache_dtype_for(bf16, "auto") == torch.bfloat16
    assert factory.kv_cache_dtype_for(fp32, "auto") == torch.float32
    assert factory.kv_cache_dtype_for(bf16, "float32") == torch.float32
    assert factory.kv_cache_dtype_for(fp32, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        factory.kv_cache_dtype_for(fp32, "float16")
    logits = {}
    for setting, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        runner = factory.make_runner(bf16, factory.EngineConfig(runner="static", max_model_len=64, kv_cache_gib=0.01,
                                                                kv_cache_dtype=setting))
        assert runner.kv_cache_dtype == want and runner.model.k_cache_0.dtype == want
        assert runner.model.cache_bytes() == runner.capacity * StaticLlama.slot_bytes(
            bf16.config, runner.model.k_cache_0.shape[2], want)
        runner.add("s")
        runner.forward(["s"], [list(range(3, 40))], [1])
        logits[setting] = runner.forward(["s"], [[7]], [1])
    # keys and values rounded to bf16: the logits move by about bf16's precision, not more
    torch.testing.assert_close(logits["auto"], logits["float32"], atol=0.05, rtol=0.02)
    assert not torch.equal(logits["auto"], logits["float32"])


def test_the_in_process_engine_captures_graph_steps_and_leaves_other_runners_alone(monkeypatch):
    from engine import factory
    from engine.models.static.runner import KVBudget, StaticRunner
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama", seed=0)
    warmed = []
    monkeypatch.setattr(StaticRunner, "warm_up", lambda self, k, progress=None, exit_layers=None: warmed.append((self, k)) or 0)
    graphs = StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=2), compile="graphs")
    eager = StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=2), compile="off")
    assert factory.capture_graphs(graphs, 3) and warmed == [(graphs, 3)]
    assert not factory.capture_graphs(eager, 3) and not factory.capture_graphs(None, 3) and len(warmed) == 1


def test_an_eagle3_draft_loads_its_head_inside_the_target(tmp_path):
    from engine.factory import build_target_drafter
    from engine.models.kv_budget import KVBudget
    from engine.models.static.runner import StaticRunner
    from engine.proposers.eagle3 import Eagle3Drafter
    from engine.proposers.eagle3_checkpoint import Eagle3Error, save_speculators
    from tests.conftest import make_tiny_model
    from tests.engine.proposers.test_eagle3 import LAYERS, random_head

    model = make_tiny_model("llama", seed=0, layers=LAYERS)
    save_speculators(random_head(model), tmp_path / "head")
    static = StaticRunner(model, budget=KVBudget(max_num_seqs=2), compile="off")
    drafter = build_target_drafter(EngineConfig(draft=f"eagle3:{tmp_path / 'head'}"), static)
    assert isinstance(drafter, Eagle3Drafter) and static.model.aux_layers == (2, 4, 5)
    shallow = StaticRunner(make_tiny_model("llama", seed=0, layers=4), budget=KVBudget(max_num_seqs=2),
                           compile="off")
    with pytest.raises(Eagle3Error, match="num_hidden_layers"):
        build_target_drafter(EngineConfig(draft=f"eagle3:{tmp_path / 'head'}"), shallow)
