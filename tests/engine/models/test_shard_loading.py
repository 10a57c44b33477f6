"""Loading a tensor-parallel rank's shard straight from safetensors: the same tensors as slicing the full model,
only the shard's bytes read, and (2 gloo ranks) the same logits as the unsharded model."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import engine.models.shard_loading as shard_loading
from engine.models.loading import load_causal_lm, resolve
from engine.models.shard_loading import load_shard, rank_device
from engine.models.tensor_parallel import (
    COLUMNS,
    ROWS,
    ColumnParallelLinear,
    TensorParallelError,
    full_num_parameters,
    num_parameters,
    split_part,
)
from engine.models.transformers_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.engine.spawn_ranks import TEST_TIMEOUT_S, run_ranks

# spawned ranks: pytest's limit as their hang guard (tests/engine/spawn_ranks.py)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)
CASES = ["llama", "llama-sharded", "llama-tied", "qwen2"]
WORLD = 2


def _tied_llama():
    from transformers import LlamaForCausalLM

    config = make_tiny_model("llama").config
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-models")
    dirs = {case: root / case for case in CASES}
    make_tiny_model("llama", seed=0).save_pretrained(dirs["llama"], safe_serialization=True)
    make_tiny_model("llama", seed=1).save_pretrained(dirs["llama-sharded"], safe_serialization=True,
                                                     max_shard_size="60KB")
    _tied_llama().save_pretrained(dirs["llama-tied"], safe_serialization=True)
    make_tiny_model("qwen2", seed=2).save_pretrained(dirs["qwen2"], safe_serialization=True)
    # the cases are what they claim to be
    index = json.loads((dirs["llama-sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from safetensors import safe_open

    with safe_open(str(dirs["llama-tied"] / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    return dirs


class _CountingSlice:
    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        t = self.inner[index]
        self.counter.append(t.numel())
        return t


class _CountingFile:
    """safe_open that records how many elements every read returned."""

    def __init__(self, real_safe_open, counter, *args, **kwargs):
        self.inner, self.counter = real_safe_open(*args, **kwargs), counter

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _CountingSlice(self.inner.get_slice(name), self.counter)

    def get_tensor(self, name):
        t = self.inner.get_tensor(name)
        self.counter.append(t.numel())
        return t


@pytest.fixture
def elements_read(monkeypatch):
    counter: list[int] = []
    real = shard_loading.safe_open

    monkeypatch.setattr(shard_loading, "safe_open", lambda *args, **kwargs: _CountingFile(real, counter, *args,
                                                                                            **kwargs))
    return counter


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_slices_of_the_full_model_and_reads_nothing_else(case, model_dirs, elements_read):
    resolved = resolve(str(model_dirs[case]))
    full = load_causal_lm(resolved)
    full_q = full.model.layers[0].self_attn.q_proj.weight.shape
    for rank in range(WORLD):
        elements_read.clear()
        shard = load_shard(resolved, "float32", "cpu", rank, WORLD)
        # the rank read exactly the elements it holds: never a full tensor it then sliced
        assert sum(elements_read) == num_parameters(shard), case
        assert num_parameters(shard) < 0.55 * num_parameters(full)
        assert full_num_parameters(shard, WORLD) == num_parameters(full)
        assert shard.model.layers[0].self_attn.q_proj.weight.shape == (full_q[0] // WORLD, full_q[1])
        for mine, theirs in zip(shard.model.layers, full.model.layers):
            for owner, ref, columns, row in ((mine.self_attn, theirs.self_attn, ("q_proj", "k_proj", "v_proj"),
                                              "o_proj"),
                                             (mine.mlp, theirs.mlp, ("gate_proj", "up_proj"), "down_proj")):
                for name in columns:
                    module, full_module = getattr(owner, name), getattr(ref, name)
                    assert isinstance(module, ColumnParallelLinear)
                    assert torch.equal(module.weight, split_part(full_module.weight, ROWS, rank, WORLD))
                    assert (module.bias is None) == (full_module.bias is None)
                    if module.bias is not None:  # qwen2's q/k/v biases split with their rows
                        assert torch.equal(module.bias, split_part(full_module.bias, ROWS, rank, WORLD))
                assert torch.equal(getattr(owner, row).weight,
                                   split_part(getattr(ref, row).weight, COLUMNS, rank, WORLD))
            assert torch.equal(mine.input_layernorm.weight, theirs.input_layernorm.weight)
            assert torch.equal(mine.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
        embed = shard.get_input_embeddings().weight
        assert torch.equal(embed, split_part(full.get_input_embeddings().weight, ROWS, rank, WORLD))
        assert torch.equal(shard.lm_head.weight, split_part(full.lm_head.weight, ROWS, rank, WORLD))
        assert (shard.lm_head.weight is embed) == (case == "llama-tied")
        assert torch.equal(shard.model.norm.weight, full.model.norm.weight)
        # not in the checkpoint: recomputed as from_pretrained does
        assert torch.equal(shard.model.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)
        assert not any(t.is_meta for t in [*shard.parameters(), *shard.buffers()])


def test_bfloat16_shards_equal_the_bfloat16_full_model(model_dirs):
    resolved = resolve(str(model_dirs["qwen2"]))
    full = load_causal_lm(resolved, "bfloat16")
    shard = load_shard(resolved, "bfloat16", "cpu", 1, WORLD)
    assert {p.dtype for p in shard.parameters()} == {torch.bfloat16}
    attn, ref = shard.model.layers[1].self_attn, full.model.layers[1].self_attn
    assert torch.equal(attn.k_proj.bias, split_part(ref.k_proj.bias, ROWS, 1, WORLD))
    assert torch.equal(attn.o_proj.weight, split_part(ref.o_proj.weight, COLUMNS, 1, WORLD))
    assert shard.model.rotary_emb.inv_freq.dtype == full.model.rotary_emb.inv_freq.dtype


def test_int8_and_unknown_dtypes_and_non_llama_models_are_refused_before_reading(model_dirs, tmp_path,
                                                                                  elements_read):
    resolved = resolve(str(model_dirs["llama"]))
    with pytest.raises(TensorParallelError, match="int8 is not supported for tensor-parallel targets"):
        load_shard(resolved, "int8", "cpu", 0, WORLD)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_shard(resolved, "float8", "cpu", 0, WORLD)
    make_tiny_model("gpt2").save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    with pytest.raises(TensorParallelError, match="Llama-style"):
        load_shard(resolve(str(tmp_path / "gpt2")), "float32", "cpu", 0, WORLD)
    with pytest.raises(TensorParallelError, match="tp_size 3 must divide"):
        load_shard(resolved, "float32", "cpu", 0, 3)
    assert elements_read == []


def test_rank_device_picks_this_process_gpu(monkeypatch):
    assert rank_device("cpu") == torch.device("cpu")
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # Ray: the actor sees its one GPU
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # torchrun: every GPU visible
    assert rank_device("cuda") == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 0), torch.device("cuda", 3), torch.device("cuda", 1)]
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(RuntimeError, match="LOCAL_RANK 4 names no CUDA device"):
        rank_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_shard_loads_straight_onto_the_gpu(model_dirs):
    resolved = resolve(str(model_dirs["llama-tied"]))
    full = load_causal_lm(resolved)
    shard = load_shard(resolved, "float32", "cuda", 1, WORLD)
    assert {t.device.type for t in [*shard.parameters(), *shard.buffers()]} == {"cuda"}
    assert torch.cuda.current_device() == 0
    assert torch.equal(shard.model.layers[0].mlp.down_proj.weight.cpu(),
                       split_part(full.model.layers[0].mlp.down_proj.weight, COLUMNS, 1, WORLD))
    assert torch.equal(shard.model.rotary_emb.inv_freq.cpu(), full.model.rotary_emb.inv_freq)


@pytest.mark.slow
def test_the_default_gguf_model_loads_as_shards():
    """SmolLM2-135M (9 heads, 3 key/value heads, tied embeddings) splits 3 ways; a GGUF source loads through the
    safetensors directory engine/models/loading.py converted it to."""
    resolved = resolve("smollm2")
    full = load_causal_lm(resolved)
    shard = load_shard(resolved, "float32", "cpu", 2, 3)
    assert shard.lm_head.weight is shard.get_input_embeddings().weight
    assert torch.equal(shard.model.layers[5].self_attn.v_proj.weight,
                       split_part(full.model.layers[5].self_attn.v_proj.weight, ROWS, 2, 3))
    assert full_num_parameters(shard, 3) == num_parameters(full)


# ---- two gloo ranks: the same logits as the unsharded model ----------------------------------------------------
PROMPTS = {"a": [2, 3, 4, 5, 6, 7], "b": [9, 8, 7]}
NEXT = {"a": [11, 12], "b": [13]}


def _logits(model, vocab):
    runner = ModelRunner(model, vocab_size=vocab)
    runner.add("a")
    runner.add("b")
    first = runner.forward(["a", "b"], [PROMPTS["a"], PROMPTS["b"]], [2, 1])
    return first, runner.forward(["a", "b"], [NEXT["a"], NEXT["b"]], [2, 1])


def _rank_worker(rank, world, port, dirs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case, directory in dirs.items():
            model = load_shard(resolve(str(directory)), "float32", "cpu", rank, world)
            results[(case, rank)] = _logits(model, model.config.vocab_size)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_logits(model_dirs):
    return run_ranks(_rank_worker, WORLD, dict(model_dirs))


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_loading_their_shards_match_the_full_model(case, model_dirs, two_rank_logits):
    full = load_causal_lm(resolve(str(model_dirs[case])))
    expected = _logits(full, full.config.vocab_size)
    for rank in range(WORLD):
        for got, want in zip(two_rank_logits[(case, rank)], expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
