"""`specserve generate` (engine/cli.py) on a tiny model directory: it builds its engine with the factory's
`build_engine`, so the CLI runs what the config says (speculation limit, EOS ids), not a second assembly."""

from __future__ import annotations

import json

import pytest

from engine import cli
from engine.factory import EngineConfig, build_engine
from engine.models.loading import eos_token_ids, resolve
from tests.conftest import make_tiny_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny"
    model = make_tiny_model("llama")
    model.generation_config.eos_token_id = [7, 9]  # besides the tokenizer's </s> (id 1)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def test_cli_builds_its_engine_with_the_factory(tiny_dir, monkeypatch, capsys):
    built = []

    def recording_build_engine(config, **kwargs):
        built.append((config, build_engine(config, **kwargs)))
        return built[-1][1]

    monkeypatch.setattr(cli, "build_engine", recording_build_engine)
    assert cli.main(["generate", "--prompt", "w2 w3 w4 w2 w3", "--target", str(tiny_dir), "--target-dtype",
                     "float32", "--draft", "ngram", "--k", "2", "--max-tokens", "6", "--json"]) == 0
    (config, engine), = built
    assert config.max_batch_for_speculation == EngineConfig.max_batch_for_speculation is not None
    assert engine.max_batch_for_speculation == config.max_batch_for_speculation
    assert config.num_speculative_tokens == engine.num_speculative_tokens == 2
    assert engine.eos_token_ids == {1, 7, 9} == eos_token_ids(resolve(str(tiny_dir)).directory, engine.tokenizer)
    out = json.loads(capsys.readouterr().out)
    assert 1 <= out["tokens"] <= 6 and len(out["completions"]) == 1


def test_build_engine_reports_each_model_before_it_loads(tiny_dir):
    seen = []
    build_engine(EngineConfig(target=str(tiny_dir), target_dtype="float32", draft=str(tiny_dir),
                              draft_dtype="float32"), on_loading=lambda role, source: seen.append((role, source)))
    assert seen == [("target", str(tiny_dir)), ("draft", str(tiny_dir))]
