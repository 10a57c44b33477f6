"""engine/training/eagle3.py and `specserve train-heads --method eagle3`: a tiny EAGLE-3 head trained with
training-time test on a tiny target's own answers."""

import dataclasses
import json

import pytest
import torch

from engine import SamplingParams, SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.eagle3 import Eagle3Drafter
from engine.proposers.eagle3_checkpoint import load_eagle3
from engine.training import eagle3 as training
from engine.training.answers import regenerate
from engine.training.eagle3 import (
    Eagle3Settings,
    TrainingSequence,
    aux_states,
    batch_of,
    new_head,
    step_loss,
    step_losses,
    train,
)
from tests.conftest import make_tiny_model
from tests.deployments.conftest import save_model_pair
from tests.engine.training.test_medusa_training import bigram_model, prompts

LAYERS = 8
SETTINGS = Eagle3Settings(ttt_steps=3, draft_vocab=0, epochs=8, batch_size=4, lr=3e-3, save_every=10)


@pytest.fixture(scope="module")
def model():
    model = bigram_model(layers=LAYERS)  # attention adds nothing: a chain a head learns from few examples
    with torch.no_grad():  # logits 4x sharper, as confident as a trained LM's (the greedy text is the same)
        model.model.norm.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def answers(model, tiny_tokenizer, tmp_path_factory):
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)
    engine = SpeculativeEngine(runner, tiny_tokenizer, None, 0)
    return regenerate(engine, prompts(), 24, tmp_path_factory.mktemp("data") / "data.pt")


def accepted_per_round(model, tokenizer, head) -> float:
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)
    engine = SpeculativeEngine(runner, tokenizer, None, 3, drafter=Eagle3Drafter(head, runner))
    plain = SpeculativeEngine(StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off"), tokenizer,
                              None, 0)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts(8, offset=3), params)] == \
        [c.token_ids for c in plain.generate(prompts(8, offset=3), params)]
    return engine.stats.acceptance_rate


@pytest.mark.parametrize("labels", ["distribution", "tokens"])
def test_a_trained_head_is_accepted_far_more_than_an_untrained_one(model, tiny_tokenizer, answers, tmp_path,
                                                                   labels):
    report = train(model, answers, tmp_path / "head", dataclasses.replace(SETTINGS, labels=labels))
    trained = load_eagle3(tmp_path / "head", 64, 64, LAYERS)
    untrained = new_head(model, None)
    assert accepted_per_round(model, tiny_tokenizer, trained) > accepted_per_round(
        model, tiny_tokenizer, untrained) + 0.3
    held = report["held_out"]
    assert held["mean_accepted_length_k4"] > 2.0 and len(held["step_accuracy"]) == 4
    assert report["answer_tokens"] == answers.answer_tokens


def test_distribution_labels_are_the_targets_own_scores_of_each_steps_token(model):
    sequence = [3, 17, 9, 40, 22, 5, 31, 12]
    vocab = (2, 5, 9, 12, 17, 22, 31, 40)  # a draft vocabulary: the LM head's rows of these
    head = new_head(model, vocab)
    aux, final = aux_states(model, sequence, head.config.aux_layers, final=True)
    batch = batch_of([TrainingSequence(aux, sequence, 2, final)], 3, vocab, 64)
    with torch.no_grad():
        expected = model(torch.tensor([sequence])).logits[0][:, list(vocab)]
    for j, (_, labels, scored) in enumerate(step_losses(head, model.get_input_embeddings(), batch, 3)):
        # step j at position i drafts the token at i + 2 + j, which the target scored at i + 1 + j
        reach = len(sequence) - 1 - j
        torch.testing.assert_close(scored[0, :reach], expected[1 + j:], atol=0.05, rtol=0.02)
        assert labels[0, :reach - 1].tolist() == [vocab.index(t) for t in sequence[2 + j:]]  # the prompt's 2


def test_a_peaked_distribution_gives_the_tokens_loss():
    logits = torch.randn(1, 4, 6)
    labels = torch.tensor([[2, -100, 5, 0]])
    peaked = torch.nn.functional.one_hot(labels.clamp(min=0), 6).float() * 1e4
    torch.testing.assert_close(step_loss(logits, labels, peaked), step_loss(logits, labels, None))
    assert step_loss(logits, torch.full((1, 4), -100), peaked).item() == 0.0
    with pytest.raises(ValueError, match="labels"):
        Eagle3Settings(labels="soft")


def test_training_resumes_from_its_checkpoint(model, answers, tmp_path, monkeypatch):
    settings = Eagle3Settings(ttt_steps=2, draft_vocab=20, epochs=2, batch_size=8, save_every=3, labels="distribution")
    calls = []
    real = training.loss_of

    def counting(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(training, "loss_of", counting)
    with pytest.raises(KeyboardInterrupt):
        train(model, answers, tmp_path, settings)
    saved = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert saved["step"] == 3
    calls.clear()
    monkeypatch.setattr(training, "loss_of", real)
    report = train(model, answers, tmp_path, settings)
    head = load_eagle3(tmp_path, 64, 64, LAYERS)
    assert head.config.draft_vocab_size == 20 and report["steps"] == 2 * -(-36 // 8)


def test_the_cli_trains_a_head_the_server_loads(tmp_path):
    from engine.cli import main

    target, _ = save_model_pair(tmp_path, bigram_model(layers=LAYERS), make_tiny_model("llama", seed=6))
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": f"w{3 + i} w{9 + i} w{5 + 2 * i}"}) + "\n"
                                   for i in range(12)))
    out = tmp_path / "head"
    assert main(["train-heads", "--method", "eagle3", "--target", str(target), "--target-dtype", "float32",
                 "--out", str(out), "--prompts", str(prompt_file), "--max-tokens", "12", "--epochs", "1",
                 "--draft-vocab", "30"]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["speculators_model_type"] == "eagle3"
    assert meta["speculators_config"]["verifier"]["name_or_path"] == str(target)  # what `vllm serve OUT` loads
    assert 0 < load_eagle3(out, 64, 64, LAYERS).config.draft_vocab_size <= 30  # the answers hold fewer tokens
    assert json.loads((out / "training.json").read_text())["prompts"] == 12
