"""engine/proposers/medusa.py: Medusa heads as a draft source inside the verify step; their checkpoint format."""

import json

import pytest
import torch

from engine import SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.medusa import (
    MedusaConfig,
    MedusaDrafter,
    MedusaError,
    MedusaHeads,
    load_medusa,
)
from engine.spec.target_drafts import DraftFrom
from tests.conftest import make_tiny_model
from tests.engine.proposers.target_prompts import GREEDY, PROMPTS

HIDDEN = 64


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=0)


def random_heads(vocab, num_layers=1, shared=False, heads=3, seed=0):
    torch.manual_seed(seed)
    medusa = MedusaHeads(MedusaConfig(heads, num_layers, HIDDEN, vocab, shared))
    with torch.no_grad():
        for p in medusa.parameters():
            p.normal_(0, 0.3)
    return medusa


def runner_of(model):
    return StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)


@pytest.mark.parametrize("num_layers,shared", [(1, False), (2, False), (1, True), (0, True)])
def test_greedy_output_equals_plain_decoding(model, tiny_tokenizer, num_layers, shared):
    runner = runner_of(model)
    heads = random_heads(runner.vocab_size, num_layers, shared)
    spec = SpeculativeEngine(runner, tiny_tokenizer, None, 3, drafter=MedusaDrafter(heads, runner.model))
    plain = SpeculativeEngine(runner_of(model), tiny_tokenizer, None, 3)
    assert [c.token_ids for c in spec.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    assert spec.stats.num_drafts > 0 and spec.verifier.held.used > 0


def test_heads_that_predict_the_target_are_accepted(model, tiny_tokenizer):
    """Heads whose drafts are the target's own next tokens (a head trained perfectly) are all accepted: the drafts
    come from the hidden state that predicted the round's last token, head i for the token i + 1 places on."""
    runner = runner_of(model)

    class Oracle:  # stands in for trained heads: drafts the target's greedy continuation
        name, needs_hidden = "oracle", True

        def draft(self, runner_, rows, hidden):
            assert hidden is not None and hidden.shape[0] >= len(rows)
            return [continuation[r.seq_id][r.committed:r.committed + r.k] for r in rows]

    continuation = {}
    plain = SpeculativeEngine(runner_of(model), tiny_tokenizer, None, 3).generate(PROMPTS[:1], GREEDY)[0]
    spec = SpeculativeEngine(runner, tiny_tokenizer, None, 3, drafter=Oracle())
    request = "oracle-0"
    continuation[request] = PROMPTS[0] + plain.token_ids
    spec.add_request(request, PROMPTS[0], GREEDY)
    while spec.has_work():
        spec.step()
    assert spec.stats.acceptance_rate == 1.0 and runner.last_hidden is not None


def test_the_fused_draft_equals_the_heads_own_forward(model):
    """MedusaDrafter (first ResBlocks of all heads in one product, the static runner's kernels) drafts the argmax
    of MedusaHeads.forward, the checkpoint layout's reference computation, for every variant."""
    runner = runner_of(model)
    hidden = torch.randn(2, 3, HIDDEN)
    lm_head = model.get_output_embeddings()
    for num_layers, shared in ((1, False), (2, False), (1, True)):
        heads = random_heads(runner.vocab_size, num_layers, shared, seed=num_layers)
        want = heads(hidden, lm_head).argmax(-1)  # [2, 3, heads]
        rows = [DraftFrom("x", 0, 2, 10, 5, 3), DraftFrom("y", 1, 0, 10, 5, 2)]
        got = MedusaDrafter(heads, runner.model).draft(runner, rows, hidden)
        assert got == [want[0, 2].tolist(), want[1, 0, :2].tolist()]


def test_a_checkpoint_round_trips_in_the_fasterdecoding_layout(tmp_path):
    heads = random_heads(100, num_layers=1)
    heads.save(tmp_path / "medusa", base_model="tiny")
    meta = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert meta["medusa_num_heads"] == 3 and meta["medusa_num_layers"] == 1
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "2.1.weight"} <= keys
    loaded = load_medusa(tmp_path / "medusa", HIDDEN, 100)
    x = torch.randn(4, HIDDEN)
    assert torch.equal(loaded(x), heads(x))
    # FasterDecoding's older .pt form: the same state dict through torch.save
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    torch.save(heads.heads.state_dict(), tmp_path / "pt" / "medusa_lm_head.pt")
    assert torch.equal(load_medusa(tmp_path / "pt", HIDDEN, 100)(x), heads(x))


def test_heads_that_do_not_fit_the_target_are_refused_naming_the_field(tmp_path):
    random_heads(100).save(tmp_path / "m")
    with pytest.raises(MedusaError, match="vocab_size"):
        load_medusa(tmp_path / "m", HIDDEN, 120)
    with pytest.raises(MedusaError, match="hidden_size"):
        load_medusa(tmp_path / "m", 32, 100)
    with pytest.raises(MedusaError, match="config.json"):
        load_medusa(tmp_path / "missing", HIDDEN, 100)


@pytest.mark.parametrize("shared", [True, False])
def test_heads_with_a_draft_vocabulary_draft_its_tokens_mapped_to_the_targets(model, tiny_tokenizer, tmp_path,
                                                                               shared):
    """A draft vocabulary (the LM heads' rows of some tokens only): drafts are the argmax over those rows, mapped back
    to the target's ids, read through the static runner's packed or dense LM head; greedy output stays plain's."""
    runner = runner_of(model)
    vocab = tuple(range(3, 60, 2))
    heads = MedusaHeads(MedusaConfig(2, 1, HIDDEN, runner.vocab_size, shared, vocab))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    heads.save(tmp_path / "m")
    loaded = load_medusa(tmp_path / "m", HIDDEN, runner.vocab_size)
    assert loaded.config.draft_vocab == vocab
    rows = torch.nn.Linear(HIDDEN, len(vocab), bias=False)
    rows.weight = torch.nn.Parameter(model.get_output_embeddings().weight[list(vocab)])
    hidden = torch.randn(1, 1, HIDDEN)
    want = torch.tensor(vocab)[loaded(hidden, rows).argmax(-1)][0, 0].tolist()
    drafter = MedusaDrafter(loaded, runner.model)
    assert drafter.draft(runner, [DraftFrom("x", 0, 0, 10, 5, 2)], hidden) == [want]
    spec = SpeculativeEngine(runner, tiny_tokenizer, None, 2, drafter=drafter)
    plain = SpeculativeEngine(runner_of(model), tiny_tokenizer, None, 2)
    assert [c.token_ids for c in spec.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    (tmp_path / "m" / "config.json").write_text(json.dumps({**json.loads((tmp_path / "m" / "config.json").read_text()),
                                                             "draft_vocab": [1, 2, 999]}))
    with pytest.raises(MedusaError, match="vocab_size"):
        load_medusa(tmp_path / "m", HIDDEN, runner.vocab_size)


def test_the_engine_marks_rows_that_asked_for_drafts_and_plans_their_start(model, tiny_tokenizer):
    """In-process as served: a row's drafts from a drafter inside the target are verified the round after it asks,
    so the plan reads a row that asked for none last round as starting (engine/spec/plan.RowOutlook.starting)."""
    runner = runner_of(model)
    spec = SpeculativeEngine(runner, tiny_tokenizer, None, 3, drafter=MedusaDrafter(random_heads(runner.vocab_size),
                                                                                   runner.model))
    spec.add_request("a", PROMPTS[0], GREEDY)
    row = spec._rows["a"]
    assert row.outlook(3, False, drafts_lag=True).starting
    spec.step()
    assert row.drafted_last and not row.outlook(3, False, drafts_lag=True).starting
    assert spec.verifier.held.missed == 1 and spec.verifier.held.used == 0, "the first round verifies none"
    spec.step()
    assert spec.verifier.held.used == 1
