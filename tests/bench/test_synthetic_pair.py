"""bench/synthetic_pair.py: the draft is the target's first layers, so their logits agree until noise is added;
the weights give varied text; the presets have the sizes they are named for."""

import json

import pytest
import torch

from bench.synthetic_pair import SHAPES, layer_params, llama_config, param_counts, write_heads, write_pair
from tests.conftest import make_tiny_tokenizer


def _load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _prompts(n: int = 4, length: int = 12) -> torch.Tensor:
    return torch.randint(100, SHAPES["tiny"].vocab, (n, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exact_pair(tmp_path_factory):
    """Noise 0, the pair's own word-level tokenizer (the default), small shards so the index path is used."""
    return write_pair(SHAPES["tiny"], tmp_path_factory.mktemp("pairs"), noise=0.0, seed=0, shard_bytes=32 << 10)


def test_draft_logits_equal_the_targets_with_no_noise(exact_pair):
    target, draft = (_load(d) for d in exact_pair)
    assert target.config.num_hidden_layers == 4 and draft.config.num_hidden_layers == 1
    with torch.no_grad():
        lt, ld = target(_prompts()).logits, draft(_prompts()).logits
    torch.testing.assert_close(ld, lt)


def test_noise_lowers_greedy_agreement(tmp_path):
    target, draft = (_load(d) for d in write_pair(SHAPES["tiny"], tmp_path, noise=0.5, seed=0,
                                                  tokenizer=make_tiny_tokenizer()))
    with torch.no_grad():
        agree = (target(_prompts()).logits.argmax(-1) == draft(_prompts()).logits.argmax(-1)).float().mean()
    assert agree < 0.9  # control: with no noise it is 1 (the test above)


def test_greedy_text_is_not_one_token_repeated(exact_pair):
    target = _load(exact_pair[0])
    with torch.no_grad():
        out = target.generate(_prompts(1), attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=32,
                              do_sample=False, pad_token_id=0)
    assert len(set(out[0, 12:].tolist())) >= 16


def test_the_pair_is_a_loadable_model_directory_with_a_tokenizer_of_its_vocabulary(exact_pair):
    from transformers import AutoTokenizer

    target, draft = exact_pair
    for directory in exact_pair:
        assert (directory / "model.safetensors.index.json").is_file()  # several shards, read through the index
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert len(tokenizer) == SHAPES["tiny"].vocab and tokenizer.eos_token_id == 1
        ids = tokenizer("w5 w300 w511", add_special_tokens=False).input_ids
        assert ids == [5, 300, 511] and tokenizer.decode(ids) == "w5 w300 w511"
    meta = json.loads((target.parent / "pair.json").read_text())
    assert meta["noise"] == 0.0 and meta["params"] == param_counts(SHAPES["tiny"])


def test_a_complete_pair_is_reused_not_rewritten(exact_pair):
    weights = sorted(exact_pair[0].glob("*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in weights]
    again = write_pair(SHAPES["tiny"], exact_pair[0].parent.parent, noise=0.0, seed=0)
    assert again == exact_pair and [p.stat().st_mtime_ns for p in weights] == stamps


def test_heads_beside_the_pair_load_as_the_target_side_sources_would_and_are_written_once(exact_pair):
    """The random Medusa and EAGLE-3 heads bench/gpu_serve.py serves as `medusa:DIR` and `eagle3:DIR`."""
    from engine.proposers.eagle3_checkpoint import load_eagle3
    from engine.proposers.medusa import load_medusa

    shape, target = SHAPES["tiny"], exact_pair[0]
    dirs = write_heads(shape, target)
    assert dirs == {"medusa": target.parent / "medusa", "eagle3": target.parent / "eagle3"}
    medusa = load_medusa(dirs["medusa"], shape.hidden, shape.vocab)
    assert medusa.config.num_heads == 4 and medusa.config.shared_lm_head
    eagle3 = load_eagle3(dirs["eagle3"], shape.hidden, shape.vocab, shape.layers)
    assert len(set(eagle3.config.aux_layers)) == 3 and eagle3.config.draft_vocab_size == shape.vocab // 2
    written = (dirs["eagle3"] / "model.safetensors").stat().st_mtime_ns
    assert write_heads(shape, target) == dirs and (dirs["eagle3"] / "model.safetensors").stat().st_mtime_ns == written


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_counts_match_transformers_models_of_the_configs(name):
    from transformers import LlamaForCausalLM

    shape, counts = SHAPES[name], param_counts(SHAPES[name])
    for layers, key in ((shape.layers, "target"), (shape.draft_layers, "draft")):
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(shape, layers))
        assert sum(p.numel() for p in model.parameters()) == counts[key]  # tied weights counted once


def test_presets_have_the_sizes_they_are_named_for():
    big, mid = param_counts(SHAPES["8b"]), param_counts(SHAPES["1.5b"])
    assert big["target"] == pytest.approx(8.03e9, rel=0.005)  # Llama-3.1-8B, its 128,256-token vocabulary included
    assert layer_params(SHAPES["8b"]) * 32 == pytest.approx(6.98e9, rel=0.01)
    assert 0.9e9 < big["draft_read"] < 1.2e9  # a ~1B-cost draft
    assert mid["target"] == pytest.approx(1.56e9, rel=0.01)
    assert mid["draft"] == pytest.approx(0.22e9, rel=0.02)
    assert mid["target_read"] == mid["target"]  # tied: the head is the embedding table, read every step
