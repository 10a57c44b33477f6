"""engine/training/sampled_prompts.py and `specserve make-prompts`: user prompts sampled from the target's own user
turn (Magpie)."""

import json

import pytest

from engine import SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.training.prompts import training_prompts
from engine.training.sampled_prompts import (
    MIN_CHARS,
    pre_query_ids,
    sample_prompts,
    write_prompts,
)
from tests.conftest import BYTE_VOCAB, make_byte_tokenizer, make_tiny_model

HOT = 4.0  # a random model's next token is peaked; hot sampling ends about half the turns within 200 tokens
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def engine():
    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    runner = StaticRunner(make_tiny_model("llama", vocab=BYTE_VOCAB, seed=3), budget=KVBudget(max_num_seqs=16),
                          compile="off", prefill_chunk=64)
    return SpeculativeEngine(runner, tokenizer, None, 0, eos_token_ids=[tokenizer.eos_token_id])


def test_the_pre_query_is_the_template_up_to_the_users_message(engine):
    tokenizer = engine.tokenizer
    assert tokenizer.decode(pre_query_ids(tokenizer)) == "<user>"
    plain = make_byte_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        pre_query_ids(plain)


def test_prompts_are_distinct_finished_turns_the_same_for_a_seed_and_never_an_excluded_one(engine, tmp_path):
    first = sample_prompts(engine, 3, seed=7, max_tokens=200, temperature=HOT)
    assert len(first) == 3 and len(set(first)) == 3
    assert all(len(p) >= MIN_CHARS and p == p.strip() for p in first)
    assert sample_prompts(engine, 3, seed=7, max_tokens=200, temperature=HOT) == first  # each row seeded
    others = sample_prompts(engine, 3, seed=7, max_tokens=200, temperature=HOT, exclude={"  " + first[0].casefold() + " "})
    assert first[0] not in others and others[:2] == first[1:]
    write_prompts(first, tmp_path / "p.jsonl")
    assert training_prompts(tmp_path / "p.jsonl") == [[{"role": "user", "content": p}] for p in first]
    assert all(json.loads(line) == {"prompt": p} for line, p in zip((tmp_path / "p.jsonl").read_text().splitlines(),
                                                                     first))


def test_the_cli_writes_a_prompt_file_train_heads_reads(tmp_path):
    from engine.cli import main
    from tests.deployments.conftest import save_model_pair

    target, _ = save_model_pair(tmp_path, make_tiny_model("llama", vocab=BYTE_VOCAB, seed=3),
                                make_tiny_model("llama", vocab=BYTE_VOCAB, seed=4), make_byte_tokenizer())
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "made.jsonl"
    assert main(["make-prompts", "--target", str(target), "--target-dtype", "float32", "--out", str(out),
                 "--count", "2", "--max-tokens", "200", "--temperature", str(HOT), "--chat-template", str(template)]) == 0
    made = training_prompts(out)
    assert len(made) == 2 and all(len(m[0]["content"]) >= MIN_CHARS for m in made)
    assert main(["make-prompts", "--target", str(target), "--target-dtype", "float32", "--out", str(out),
                 "--count", "2", "--max-tokens", "200", "--temperature", str(HOT), "--chat-template", str(template)]) == 0
    assert training_prompts(out) == made  # seed 0 both times
