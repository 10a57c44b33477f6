"""engine/proposers/early_exit.py: self-speculative drafting from the target's first layers, inside the verify step."""

import pytest
import torch

from engine import SamplingParams, SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.early_exit import (
    EarlyExitDrafter,
    choose_exit_layer,
    exit_agreement,
    layer_set_candidates,
    layer_set_name,
    skip_block,
    target_text,
)
from engine.spec.target_drafts import DraftFrom
from tests.conftest import make_tiny_model, third_token_marginals, total_variation_bound
from tests.engine.proposers.target_prompts import GREEDY, PROMPTS


def passthrough_model(vocab: int | None = None, seed: int = 0):
    """Four layers whose last two add nothing to the residual (their output projections are zero): an exit after
    two layers is the whole model, as in the synthetic pair the GPU benchmarks use."""
    model = make_tiny_model("llama", seed=seed, layers=4, **({"vocab": vocab} if vocab else {}))
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def model():
    return passthrough_model()


def engine(model, tokenizer, layers, k=3):
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)
    return SpeculativeEngine(runner, tokenizer, None, k, drafter=EarlyExitDrafter(layers) if layers else None)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_greedy_output_equals_plain_decoding_and_an_exact_exit_is_always_accepted(model, tiny_tokenizer, layers):
    spec_engine = engine(model, tiny_tokenizer, layers)
    spec = spec_engine.generate(PROMPTS, GREEDY)
    plain = engine(model, tiny_tokenizer, None).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    stats = spec_engine.stats
    assert stats.num_drafts > 0
    if layers >= 2:  # the last two layers add nothing: the exit is the model
        assert stats.acceptance_rate == 1.0
    else:
        assert stats.acceptance_rate < 1.0, "a real early exit: some drafts rejected, and the output still exact"
    assert spec_engine.target.num_live == 0 and len(spec_engine.verifier.held) == 0


def test_chains_fed_on_the_device_draft_what_host_fed_steps_draft_and_reach_the_host_once(model, monkeypatch):
    """The CUDA-graph path's chains (each step fed the last picks on the device) against the eager path's, rows of
    different k in one batch; while they step, one tensor is read to the host."""
    drafts, transfers = {}, []
    for compile in ("off", "graphs"):
        runner = StaticRunner(model, budget=KVBudget(max_num_seqs=4), compile=compile, prefill_chunk=16)
        rows = []
        for b, prompt in enumerate(PROMPTS[:3]):
            runner.add(f"s{b}")
            last = int(runner.forward([f"s{b}"], [prompt], [1])[0, -1].argmax())
            rows.append(DraftFrom(f"s{b}", b, 0, len(prompt) + 1, last, 3 - b))
        drafter = EarlyExitDrafter(1)
        if compile == "graphs":
            tolist = torch.Tensor.tolist
            monkeypatch.setattr(torch.Tensor, "tolist", lambda t: transfers.append(tuple(t.shape)) or tolist(t))
        drafts[compile] = drafter.draft(runner, rows, None)
        monkeypatch.undo()
    assert [len(d) for d in drafts["off"]] == [3, 2, 1] and drafts["graphs"] == drafts["off"]
    assert transfers == [(6,)]


def test_the_draft_shares_the_targets_cache_nothing_is_prefilled_twice(model, tiny_tokenizer):
    """Every full forward is a verify pass (one a round); the early exit's steps never record tokens as cached."""
    spec_engine = engine(model, tiny_tokenizer, 2)
    runner = spec_engine.target
    rounds = 0

    def counted(outputs):
        nonlocal rounds
        rounds += 1

    spec_engine.generate(PROMPTS[:1], GREEDY, on_round=counted)
    assert runner.forward_calls == rounds
    assert rounds <= 1 + -(-(GREEDY.max_tokens - 1) // 4), "every round after the first emitted K + 1 tokens"


def test_a_seeded_request_gives_the_same_text_with_the_early_exit_as_without(model, tiny_tokenizer):
    params = [SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=7 + i, ignore_eos=True) for i in range(3)]
    plain = engine(model, tiny_tokenizer, None).generate(PROMPTS, params)
    for layers in (1, 2):
        spec = engine(model, tiny_tokenizer, layers).generate(PROMPTS, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain], f"self:{layers}"


def test_unseeded_sampling_keeps_the_targets_distribution(tiny_tokenizer):
    """The 3rd token's marginal over many unseeded requests equals the target's exact one (one-hot drafts through
    the rejection rule), with an exit that disagrees often."""
    vocab = 8
    target = make_tiny_model("llama", vocab=vocab, seed=3, layers=3)
    exact, _ = third_token_marginals(target, target, [2, 3, 4], vocab)
    n = 3000
    spec = engine(target, tiny_tokenizer, 1, k=2)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = [o for _ in range(n // 8) for o in spec.generate([[2, 3, 4]] * 8, params)]
    got = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=vocab).float() / n
    assert 0.5 * (got - exact).abs().sum() < total_variation_bound(vocab, n)
    assert 0.05 < spec.stats.acceptance_rate < 0.95, "both acceptances and rejections happened"


def test_exit_agreement_measures_each_exit_against_the_whole_model(model):
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=2), compile="off", prefill_chunk=16)
    text = target_text(runner, PROMPTS[1], tokens=24)
    assert len(text) == len(PROMPTS[1]) + 24 and runner.num_live == 0
    agreement = exit_agreement(runner, text, [1, 2, 3], first=len(PROMPTS[1]) - 1)
    assert agreement[2] == agreement[3] == 1.0 and agreement[1] < 1.0
    assert runner.num_live == 0, "the measurement's slots are free again"


def test_the_exit_with_the_most_tokens_per_second_is_chosen():
    verify = [1.0, 1.1, 1.2, 1.3]  # seconds at K = 0..3
    # a shallow exit that rarely agrees loses to a deeper one that agrees, then to a cheaper one as costs shift
    assert choose_exit_layer({1: 0.1, 4: 0.9}, {1: 0.1, 4: 0.4}, verify, 3)[0] == 4
    assert choose_exit_layer({1: 0.1, 4: 0.9}, {1: 0.1, 4: 5.0}, verify, 3)[0] == 1
    layers, k = choose_exit_layer({2: 1.0}, {2: 0.01}, verify, 3)
    assert (layers, k) == (2, 3), "perfect agreement at a small cost: the longest K"


def middle_passthrough_model():
    """Four layers whose middle two add nothing to the residual: skipping them is the whole model, while the exit
    after as many layers (the first two) is not."""
    model = make_tiny_model("llama", seed=0, layers=4)
    with torch.no_grad():
        for layer in model.model.layers[1:3]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def test_a_skipped_middle_block_drafts_exactly_and_its_exact_skip_is_always_accepted(tiny_tokenizer):
    """Draft & Verify's self-speculation: the layers but a skipped middle block draft, over the same KV cache."""
    model = middle_passthrough_model()
    skipping = engine(model, tiny_tokenizer, skip_block(4, 1, 2))
    exiting = engine(model, tiny_tokenizer, 2)
    plain = engine(model, tiny_tokenizer, None).generate(PROMPTS, GREEDY)
    for spec_engine in (skipping, exiting):
        assert [c.token_ids for c in spec_engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in plain]
    assert skipping.stats.num_drafts > 0 and skipping.stats.acceptance_rate == 1.0
    assert exiting.stats.acceptance_rate < 1.0, "the exit with as many layers is not the model"
    assert skipping.verifier.drafter.name == "self:skip:1-2"


def test_a_layer_set_step_equals_the_model_without_those_layers():
    """The step through a layer set is the whole forward of the model with the skipped layers removed."""
    import copy

    model = make_tiny_model("llama", seed=3, layers=4)
    reduced = copy.deepcopy(model)
    reduced.model.layers = torch.nn.ModuleList([reduced.model.layers[i] for i in (0, 3)])
    for index, layer in enumerate(reduced.model.layers):
        layer.self_attn.layer_idx = index
    reduced.config.num_hidden_layers = 2
    prompt = [5, 9, 2, 7, 11, 3]
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=2), compile="off", prefill_chunk=16)
    runner.add("a")
    ids = torch.tensor([prompt])
    starts = torch.zeros(1, dtype=torch.long)
    slot = runner._seqs["a"].slot
    with torch.inference_mode():
        skipped = runner.model.forward(ids, starts, slot, runner._kv_len(len(prompt)), num_layers=(0, 3))
        expected = reduced(ids).logits.float()
    torch.testing.assert_close(skipped, expected, rtol=1e-4, atol=1e-4)


def test_self_candidates_include_skipped_middle_blocks_when_asked_and_names_read_back():
    assert layer_set_candidates(30) == [4, 8, 11, 15, 19, 22], "`self` measures the exits"
    candidates = layer_set_candidates(30, skips=True)
    assert 15 in candidates and skip_block(30, 7, 21) in candidates  # 15 layers: the first 7 and the last 8
    assert len(skip_block(30, 7, 21)) == 15
    assert all(len(c) < 30 for c in candidates if isinstance(c, tuple))
    assert layer_set_name(skip_block(30, 7, 14)) == "skip:7-14" and layer_set_name(4) == "4"
    with pytest.raises(ValueError, match="keeps the first and the last"):
        skip_block(30, 0, 5)
    with pytest.raises(ValueError, match="keeps the first and the last"):
        skip_block(30, 10, 29)
