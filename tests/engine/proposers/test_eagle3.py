"""engine/proposers/eagle3*.py: EAGLE-3 heads as a draft source inside the verify step, against the speculators
package's own model; both checkpoint formats; heads that do not fit the target refused."""

import json

import pytest
import torch
from transformers import LlamaConfig

from engine import SamplingParams, SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.eagle3 import Eagle3Drafter
from engine.proposers.eagle3_checkpoint import (
    Eagle3Error,
    load_eagle3,
    save_speculators,
)
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers
from engine.spec.target_drafts import DraftFrom
from tests.conftest import make_tiny_model

LAYERS = 8  # the default aux layers (2, 4, 5) are distinct from 8 layers on
PROMPTS = [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           [20, 21, 22, 20, 21, 22, 20, 21]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=0, layers=LAYERS)


def random_head(target, draft_vocab=None, seed=0, **flags):
    c = target.config
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, rms_norm_eps=1e-6)
    size = c.vocab_size if draft_vocab is None else len(draft_vocab)
    head = Eagle3Head(Eagle3Config(layer, size, default_aux_layers(LAYERS), c.hidden_size, **flags))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    if draft_vocab is not None:
        head.set_draft_vocab(torch.tensor(draft_vocab))
    return head.eval()


def runner_of(model, chunk=8, compile="off"):
    return StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile=compile, prefill_chunk=chunk)


def aux_states(model, tokens, layers):  # [1, T, len(layers) * H]: the states entering those layers
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def reference_drafts(model, head, tokens, k):
    """The drafts an EAGLE-3 head makes after `tokens` (its last not yet cached), from its whole-sequence forward:
    a draft step j reads step j - 1's state at the same index, which is the inference chain's position t + j."""
    prefix, last = tokens[:-1], tokens[-1]
    aux = aux_states(model, prefix, head.config.aux_layers)
    drafts = []
    embed = model.get_input_embeddings()
    for step in range(k):
        chain = prefix[1:] + [last] + drafts
        with torch.no_grad():
            logits = head(aux, embed(torch.tensor([chain + [0] * (k - len(drafts))])), steps=step + 1)
        drafts.append(int(head.draft_to_target(logits[step][0, len(prefix) - 1].argmax())))
    return drafts


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"norm_output": True}, {"fc_norm": True},
                                   {"norm_before_fc": True}])
def test_the_head_equals_the_speculators_package_eagle3_model(model, flags):
    """Eagle3Head's whole-sequence forward with training-time test (3 steps) gives the logits of the speculators
    package's Eagle3DraftModel (its eager attention) loaded with the same weights."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    vocab = tuple(range(0, model.config.vocab_size, 3))
    head = random_head(model, vocab, **flags)
    layer = LlamaConfig(**head.config.layer.to_dict())
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=len(vocab), target_hidden_size=64,
        eagle_aux_hidden_state_layer_ids=list(head.config.aux_layers), **flags,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    reference = Eagle3DraftModel(config).eval()
    state = {k: v for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach()
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"verifier_norm.weight", "verifier_lm_head.weight"}
    seen = []
    reference.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    tokens = list(range(5, 25))
    t = len(tokens) - 1
    aux = aux_states(model, tokens[:-1], head.config.aux_layers)
    with torch.no_grad():
        reference(hidden_states=aux, input_ids=torch.tensor([tokens[1:]]), document_ids=torch.zeros(1, t,
                                                                                                   dtype=torch.long),
                  ttt_steps=3)
        ours = head(aux, model.get_input_embeddings()(torch.tensor([tokens[1:] + [0, 0]])), steps=3)
    for step in range(3):  # past the end the reference feeds padding tokens: compared where both read real ones
        assert torch.allclose(ours[step][:, :t - step], seen[step][:, :t - step], atol=2e-4), step


@pytest.mark.parametrize("draft_vocab, compile", [(None, "off"), (tuple(range(1, 64, 2)), "off"), (None, "graphs")])
def test_the_served_drafter_drafts_the_heads_own_chain(model, draft_vocab, compile):
    """Eagle3Drafter (the target's aux states kept by its forwards, prompt chunks included, and by the graph step's
    buffer on the CUDA-graph path, run eagerly here; the head's own KV cache caught up over the prompt; K steps on
    its own states) drafts the head's reference chain."""
    runner = runner_of(model, chunk=6, compile=compile)
    head = random_head(model, draft_vocab, seed=3)
    drafter = Eagle3Drafter(head, runner)
    rows, want = [], []
    for b, prompt in enumerate(PROMPTS):
        seq = f"s{b}"
        runner.add(seq)
        last = int(runner.forward([seq], [prompt], [1])[0, -1].argmax())
        rows.append(DraftFrom(seq, b, 0, len(prompt) + 1, last, 4 - b))
        want.append(reference_drafts(model, head, prompt + [last], 4 - b))
    got = drafter.draft(runner, rows, None)
    assert got == want
    assert len({t for d in got for t in d}) > 3  # not a degenerate head
    if draft_vocab is not None:
        assert all(t in draft_vocab for d in got for t in d)


def test_a_chains_steps_feed_each_other_on_the_device_and_reach_the_host_once(model, monkeypatch):
    """K steps, one transfer of the drafts: a GPU runs the head's steps back to back, not waiting for each pick."""
    runner = runner_of(model)
    drafter = Eagle3Drafter(random_head(model, seed=3), runner)
    rows = []
    for b, prompt in enumerate(PROMPTS[:2]):
        runner.add(f"s{b}")
        last = int(runner.forward([f"s{b}"], [prompt], [1])[0, -1].argmax())
        rows.append(DraftFrom(f"s{b}", b, 0, len(prompt) + 1, last, 4))
    transfers, chaining = [], []  # the tensors read to the host while the chains step (after the catch-up)
    tolist, chains = torch.Tensor.tolist, drafter._chains
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (chaining and transfers.append(tuple(t.shape))) or tolist(t))
    monkeypatch.setattr(drafter, "_chains", lambda *a: chaining.append(drafter.steps) or chains(*a))
    drafts = drafter.draft(runner, rows, None)
    assert [len(d) for d in drafts] == [4, 4] and transfers == [(2, 4)]
    assert drafter.steps - chaining[0] == 3  # after the catch-up, a step per draft but the last


@pytest.mark.parametrize("flags", [{}, {"norm_output": True}])
def test_greedy_and_seeded_output_equal_plain_decoding(model, tiny_tokenizer, flags):
    runner = runner_of(model)
    spec = SpeculativeEngine(runner, tiny_tokenizer, None, 3,
                             drafter=Eagle3Drafter(random_head(model, **flags), runner))
    plain = SpeculativeEngine(runner_of(model), tiny_tokenizer, None, 3)
    assert [c.token_ids for c in spec.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    assert spec.stats.num_drafts > 0 and spec.verifier.held.used > 0
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    assert [c.token_ids for c in spec.generate(PROMPTS, seeded)] == \
        [c.token_ids for c in plain.generate(PROMPTS, seeded)]


def test_a_speculators_checkpoint_round_trips_and_the_package_loads_it(model, tmp_path):
    from speculators.models.eagle3.core import Eagle3DraftModel

    model.save_pretrained(tmp_path / "target")
    head = random_head(model, tuple(range(0, 64, 2)), norm_before_residual=True)
    save_speculators(head, tmp_path / "head", verifier=str(tmp_path / "target"))
    meta = json.loads((tmp_path / "head" / "config.json").read_text())
    assert meta["speculators_model_type"] == "eagle3" and meta["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    loaded = load_eagle3(tmp_path / "head", 64, model.config.vocab_size, LAYERS)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "head"))
    assert theirs.config.draft_vocab_size == 32 and theirs.config.norm_before_residual
    assert torch.equal(theirs.fc.weight, head.fc.weight) and torch.equal(theirs.d2t, head.d2t)
    assert torch.equal(theirs.layers[0].self_attn.q_proj.weight, head.layer.self_attn.q_proj.weight)


def test_eagles_own_format_loads_as_the_speculators_converter_reads_it(model, tmp_path):
    """A checkpoint in EAGLE's layout (midlayer.*, pytorch_model.bin, a LlamaConfig plus draft_vocab_size) loads to
    the same head as the speculators package's converter makes of it."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    head = random_head(model, tuple(range(0, 64, 2)))
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    layer = head.config.layer.to_dict()
    (eagle / "config.json").write_text(json.dumps({**layer, "architectures": ["LlamaForCausalLMEagle3"],
                                                   "draft_vocab_size": 32}))
    torch.save({k.replace("layers.0.", "midlayer."): v for k, v in head.state_dict().items()},
               eagle / "pytorch_model.bin")
    ours = load_eagle3(eagle, 64, model.config.vocab_size, LAYERS)
    model.save_pretrained(tmp_path / "target")
    Eagle3Converter().convert(eagle, tmp_path / "converted", base_model=str(tmp_path / "target"), validate=False)
    converted = load_eagle3(tmp_path / "converted", 64, model.config.vocab_size, LAYERS)
    aux = torch.randn(1, 6, 3 * 64)
    embeds = torch.randn(1, 7, 64)
    with torch.no_grad():
        want = head(aux, embeds, steps=2)
        for loaded in (ours, converted):
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(loaded(aux, embeds, steps=2), want))


def test_heads_that_do_not_fit_the_target_are_refused_naming_the_field(model, tmp_path):
    save_speculators(random_head(model), tmp_path / "h")
    with pytest.raises(Eagle3Error, match="vocab_size"):
        load_eagle3(tmp_path / "h", 64, 999, LAYERS)
    with pytest.raises(Eagle3Error, match="target_hidden_size"):
        load_eagle3(tmp_path / "h", 32, model.config.vocab_size, LAYERS)
    with pytest.raises(Eagle3Error, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3(tmp_path / "h", 64, model.config.vocab_size, 4)
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    meta["transformer_layer_config"]["num_hidden_layers"] = 2
    (tmp_path / "h" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(Eagle3Error, match="num_hidden_layers"):
        load_eagle3(tmp_path / "h", 64, model.config.vocab_size, LAYERS)
    with pytest.raises(Eagle3Error, match="config.json"):
        load_eagle3(tmp_path / "missing", 64, model.config.vocab_size, LAYERS)
