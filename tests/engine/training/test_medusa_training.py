"""engine/training/medusa.py and `specserve train-heads`: tiny heads trained on a tiny target's own answers."""

import json

import pytest
import torch

from engine import SamplingParams, SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.medusa import MedusaDrafter, load_medusa
from engine.training import medusa as training
from engine.training.answers import regenerate
from engine.training.medusa import (
    TrainSettings,
    head_accuracy,
    new_heads,
    train,
)
from tests.conftest import make_tiny_model
from tests.deployments.conftest import save_model_pair

SETTINGS = TrainSettings(num_heads=2, epochs=6, batch_size=64, lr=3e-3, save_every=10)


def prompts(n=40, offset=0):
    return [[2 + (7 * i + offset) % 50, 2 + (11 * i + offset) % 50, 2 + (13 * i + offset) % 50] for i in range(n)]


def bigram_model(seed=5, layers=2):
    """A tiny target whose attention adds nothing (output projections zero): its next token is a function of the
    current one, so its greedy text is a chain the heads can learn exactly (a random model's text has no pattern
    that few examples could teach)."""
    model = make_tiny_model("llama", seed=seed, layers=layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def model():
    return bigram_model()


@pytest.fixture(scope="module")
def answers(model, tiny_tokenizer, tmp_path_factory):
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)
    engine = SpeculativeEngine(runner, tiny_tokenizer, None, 0)
    path = tmp_path_factory.mktemp("data") / "data.pt"
    return regenerate(engine, prompts(), 24, path)


def acceptance(model, tokenizer, heads) -> float:
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)
    engine = SpeculativeEngine(runner, tokenizer, None, 2, drafter=MedusaDrafter(heads, runner.model))
    engine.generate(prompts(8, offset=3), SamplingParams(max_tokens=24, ignore_eos=True))
    return engine.stats.acceptance_rate


def test_trained_heads_accept_far_more_than_untrained_ones(model, tiny_tokenizer, answers, tmp_path):
    report = train(model, answers, tmp_path / "heads", SETTINGS, base_model="tiny")
    assert report["prompts"] == 40 and report["answer_tokens"] == answers.answer_tokens > 0
    trained = load_medusa(tmp_path / "heads", 64, model.config.vocab_size)
    untrained = new_heads(model, SETTINGS)
    held = report["held_out_accuracy"]
    assert held[0] > 0.8 and held[1] > 0.8, held
    before, after = acceptance(model, tiny_tokenizer, untrained), acceptance(model, tiny_tokenizer, trained)
    assert after > before + 0.3, (before, after)
    assert json.loads((tmp_path / "heads" / "training.json").read_text())["held_out_accuracy"] == held


def test_heads_trained_on_a_draft_vocabulary_draft_only_its_tokens(model, tiny_tokenizer, answers, tmp_path):
    settings = TrainSettings(num_heads=2, epochs=6, batch_size=64, lr=3e-3, shared_lm_head=True, draft_vocab=16)
    report = train(model, answers, tmp_path / "heads", settings)
    heads = load_medusa(tmp_path / "heads", 64, model.config.vocab_size)
    vocab = heads.config.draft_vocab
    assert len(vocab) == 16 and report["held_out_accuracy"][0] > 0.5
    counts = torch.bincount(torch.tensor([t for s, p in zip(answers.sequences, answers.prompt_lens) for t in s[p:]]),
                            minlength=64)
    assert set(vocab) == set(counts.argsort(descending=True)[:16].tolist()) or min(counts[list(vocab)]) >= \
        sorted(counts.tolist(), reverse=True)[15], "the answers' most frequent tokens"
    assert acceptance(model, tiny_tokenizer, heads) > 0.3


def test_training_resumes_from_its_checkpoint(model, answers, tmp_path, monkeypatch):
    settings = TrainSettings(num_heads=2, epochs=1, batch_size=64, save_every=5)
    train(model, answers, tmp_path / "heads", settings)
    steps = []
    loss = training.head_loss
    monkeypatch.setattr(training, "head_loss", lambda *a: steps.append(1) or loss(*a))
    train(model, answers, tmp_path / "heads", settings)
    assert steps == [], "the finished run's checkpoint is resumed: no step is taken again"
    state = torch.load(tmp_path / "heads" / "train_state.pt", weights_only=False)
    state["step"] -= 3  # as if stopped three steps before the end
    torch.save(state, tmp_path / "heads" / "train_state.pt")
    train(model, answers, tmp_path / "heads", settings)
    assert len(steps) == 3


def test_regenerated_answers_are_reused_for_the_same_prompts(model, tiny_tokenizer, answers, tmp_path):
    path = tmp_path / "data.pt"
    torch.save({"prompts": prompts(), "max_tokens": 24, "sequences": answers.sequences,
                "prompt_lens": answers.prompt_lens}, path)
    assert regenerate(None, prompts(), 24, path).sequences == answers.sequences, "read back, nothing generated"


def test_accuracy_counts_only_positions_with_a_target():
    class Fixed(torch.nn.Module):
        def forward(self, states, lm_head):
            return torch.nn.functional.one_hot(torch.tensor([[1, 2], [1, 2]]), 4).float()

    targets = torch.tensor([[1, -100], [3, 2]])
    assert head_accuracy(Fixed(), None, torch.zeros(2, 8), targets) == [0.5, 1.0]


def test_the_cli_trains_heads_the_server_loads(tmp_path, tiny_tokenizer):
    from engine.cli import main

    target, _ = save_model_pair(tmp_path, bigram_model(), make_tiny_model("llama", seed=6))
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": f"w{3 + i} w{9 + i} w{5 + 2 * i}"}) + "\n"
                                   for i in range(12)))
    out = tmp_path / "heads"
    assert main(["train-heads", "--target", str(target), "--target-dtype", "float32", "--out", str(out),
                 "--prompts", str(prompt_file), "--max-tokens", "12", "--epochs", "1", "--num-heads", "2",
                 "--shared-lm-head"]) == 0
    heads = load_medusa(out, 64, 64)
    assert heads.config.shared_lm_head and heads.config.num_heads == 2
    assert json.loads((out / "training.json").read_text())["prompts"] == 12
