"""Model sources: local directory, local HF cache, GGUF file; clear errors; no pickles; tokenizer checks."""

import shutil

import pytest
import torch

from engine import DraftModelProposer, IncompatibleDraftError, ModelRunner, SamplingParams, SpeculativeEngine
from engine.models.loading import ModelLoadError, eos_token_ids, load_causal_lm, load_tokenizer, resolve
from engine.proposers.base import check_tokenizers_compatible
from tests.conftest import make_tiny_model, make_tiny_tokenizer


@pytest.fixture()
def tiny_dir(tmp_path, tiny_tokenizer):
    model = make_tiny_model("llama")
    model.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_local_directory(tiny_dir):
    path, model = tiny_dir
    loaded = load_causal_lm(resolve(str(path)), "float32")
    ids = torch.tensor([[2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert load_tokenizer(resolve(str(path))).decode([5, 6]) == "w5 w6"


def test_local_hf_cache(tiny_dir, tmp_path, monkeypatch):
    path, _ = tiny_dir
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abc"
    shutil.copytree(path, snapshot)
    (cache / "models--acme--tiny" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    assert resolve("acme/tiny").directory == snapshot


def test_uncached_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="local Hugging Face cache"):
        resolve("acme/not-here")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="model file missing: .*nothing.gguf"):
        resolve(str(tmp_path / "nothing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve(str(tmp_path / "empty"))


def test_pickled_weights_are_refused(tiny_dir):
    path, model = tiny_dir
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="does not load pickled"):
        load_causal_lm(resolve(str(path)))


def test_corrupt_weights_fail_naming_the_directory(tiny_dir):
    path, _ = tiny_dir
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=str(path)):
        load_causal_lm(resolve(str(path)))


def test_different_tokenizers_are_refused(tiny_tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, **{f"x{i}": i for i in range(2, 64)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    with pytest.raises(IncompatibleDraftError, match="tokenizers differ"):
        check_tokenizers_compatible(tiny_tokenizer, other)
    check_tokenizers_compatible(tiny_tokenizer, make_tiny_tokenizer(72))  # padding rows only: accepted


def test_draft_with_padded_vocabulary_is_exact(tiny_tokenizer):
    target = make_tiny_model("llama", vocab=64, seed=0)
    draft = make_tiny_model("llama", vocab=72, seed=0)  # same family, embedding table padded to 72 rows
    with torch.no_grad():
        for name, p in draft.named_parameters():
            src = dict(target.named_parameters())[name]
            p[: src.shape[0]].copy_(src) if p.shape != src.shape else p.copy_(src)
    runner = ModelRunner(target)
    engine = SpeculativeEngine(runner, tiny_tokenizer, DraftModelProposer(ModelRunner(draft), runner.vocab_size), 3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    spec = engine.generate([[2, 3, 4]], params)[0]
    plain = engine.generate([[2, 3, 4]], params, k=0)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate > 0.5
    assert all(t < 64 for t in spec.token_ids)


def test_eos_ids_are_the_generation_configs_and_the_tokenizers(tiny_dir, tiny_tokenizer, tmp_path):
    path, model = tiny_dir
    model.generation_config.eos_token_id = [3, 4]
    model.generation_config.save_pretrained(path)
    assert eos_token_ids(path, tiny_tokenizer) == {1, 3, 4}  # the tiny tokenizer's </s> is id 1
    assert eos_token_ids(path) == {3, 4}
    (tmp_path / "bare").mkdir()  # no generation_config.json
    assert eos_token_ids(tmp_path / "bare", tiny_tokenizer) == {1}
    assert eos_token_ids(tmp_path / "bare") == frozenset()
