"""Drafts made inside the target worker (`draft: self`, `medusa:DIR`, `eagle3:DIR`) through the served round: one verify call a
round, the router sending each row's K, on tiny models without a cluster (the real worker cores)."""

import asyncio

import pytest
import torch
from transformers import LlamaConfig

from deployments.router.router import Router
from engine import SamplingParams
from engine.proposers.eagle3_checkpoint import save_speculators
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
from engine.proposers.medusa import MedusaConfig, MedusaHeads
from tests.conftest import make_tiny_model
from tests.deployments.conftest import LocalBroker, save_model_pair, tiny_config
from tests.deployments.router.test_router import plain_reference
from tests.deployments.router.test_speculation_policy import (
    generate,
    plain_seeded,
    run_all,
    text,
)

PROMPTS = [[5, 6, 7, 8], [9, 8, 7, 6, 5], [20, 21, 22, 20, 21], [30, 31, 32, 33, 34, 35]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory):
    """A four-layer target whose last two layers add nothing (an exit after two is the model), a Medusa checkpoint
    of random heads and an EAGLE-3 head (speculators' format, random weights) for it."""
    root = tmp_path_factory.mktemp("deep")
    target = make_tiny_model("llama", seed=0, layers=4)
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    dirs = save_model_pair(root, target, make_tiny_model("llama", seed=1))
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(3, 1, 64, target.config.vocab_size))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    heads.save(root / "medusa")
    layer = LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)
    head = Eagle3Head(Eagle3Config(layer, target.config.vocab_size, (1, 2, 3), 64))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    save_speculators(head, root / "eagle3")
    return dirs, root / "medusa", root / "eagle3"


def router_for(dirs, draft, **speculation):
    config = tiny_config(dirs, model={"draft": draft}, speculation=speculation)
    broker = LocalBroker(config)
    return Router(config, broker), broker


@pytest.mark.parametrize("draft, after_reply", [("self:2", False), ("self:1", False), ("medusa", False),
                                                ("eagle3", False), ("self:1", True), ("medusa", True),
                                                ("eagle3", True)])
def test_greedy_served_text_equals_plain_decoding_in_one_call_a_round(deep_dirs, draft, after_reply):
    """`after_reply`: the target drafts after its answer has gone (speculation.draft_after_reply), before its next
    call; several rows share each call, so each drafting reads its own pass's states."""
    dirs, medusa, eagle3 = deep_dirs
    router, broker = router_for(dirs, {"medusa": f"medusa:{medusa}", "eagle3": f"eagle3:{eagle3}"}.get(draft, draft),
                                draft_after_reply=after_reply)
    assert broker.cores["target"].verifier.draft_after_reply is after_reply
    assert "draft" not in broker.cores, "no Draft deployment: the target drafts for itself"
    outs = run_all(router, PROMPTS, [GREEDY] * len(PROMPTS), k=3)
    for prompt, tokens in zip(PROMPTS, outs):
        assert text(router, tokens) == plain_reference(dirs, prompt, 24)
    stats = router.scheduler.stats
    held = broker.cores["target"].verifier.held
    assert stats.spec.num_drafts > 0 and held.used > 0
    assert broker.calls["target"] == stats.timings.rounds, "one call a round"
    if draft == "self:2":
        assert stats.spec.acceptance_rate == 1.0, "the exit is the whole model"
    assert broker.cores["target"].stats()["drafter"]["name"] == draft


def test_a_seeded_request_gives_the_same_served_text_with_every_draft_source(deep_dirs):
    dirs, medusa, eagle3 = deep_dirs
    params = [SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=50 + i, ignore_eos=True)
              for i in range(4)]
    reference = plain_seeded(dirs, PROMPTS, params)
    for draft in ("self:1", f"medusa:{medusa}", f"eagle3:{eagle3}", "ngram", str(dirs[1]), "none"):
        router, _ = router_for(dirs, draft)

        async def batch(router=router):
            return await asyncio.gather(*(generate(router, pr, p, k=3) for pr, p in zip(PROMPTS, params)))

        assert asyncio.run(batch()) == reference, draft


def test_the_drafters_measured_costs_plan_k(deep_dirs):
    """The target measures its drafter at start beside its verify passes; the round plan reads both."""
    dirs = deep_dirs[0]
    router, broker = router_for(dirs, "self:2", adaptive=True)
    costs = broker.cores["target"].costs
    assert costs["drafter"]["name"] == "self:2" and all(t > 0 for t in costs["drafter"]["draft_step_seconds"])
    [tokens] = run_all(router, [PROMPTS[0]], [GREEDY])
    assert text(router, tokens) == plain_reference(dirs, PROMPTS[0], 24)
    [(pair, shown)] = router.scheduler.cost_profiles().items()
    assert pair.startswith("None / target-0") and all(t > 0 for t in shown["draft_step_ms"])


def test_rounds_that_draft_inside_the_target_correct_the_drafters_cost_apart_from_the_verify(deep_dirs):
    """The target times its drafting apart: a round's call feeds the verify correction with the rest of its time and
    the draft correction with the drafting (requests pinned to K = 3, so every round after the first drafts)."""
    dirs = deep_dirs[0]
    router, _ = router_for(dirs, "self:2", adaptive=True)

    async def pinned():
        return await generate(router, PROMPTS[0], GREEDY, k=3, adaptive=False)

    assert text(router, asyncio.run(pinned())) == plain_reference(dirs, PROMPTS[0], 24)
    [shown] = router.scheduler.cost_profiles().values()
    observed = shown["observed_over_profile"]
    assert observed["draft"] != 1.0 and observed["verify_wide"] != 1.0, observed
    stats = router.scheduler.stats  # the drafting is a part of the target's compute, counted apart (/stats)
    assert 0 < stats.target_draft_compute_seconds < stats.verify_compute_seconds


@pytest.mark.parametrize("draft", ["self:1", "medusa", "eagle3", "ngram", "model"])
def test_served_trees_keep_greedy_and_seeded_text(deep_dirs, draft):
    """`speculation.tree: on` through the served round: a target drafter's trees are made and verified in the target
    worker (the router sends each row's node budget); n-gram lookup's and a Draft worker's trees travel as tokens and
    parents (the draft model's in the chained call); the texts are plain decoding's, greedy and seeded."""
    dirs, medusa, eagle3 = deep_dirs
    source = {"medusa": f"medusa:{medusa}", "eagle3": f"eagle3:{eagle3}", "model": str(dirs[1])}.get(draft, draft)
    router, broker = router_for(dirs, source, tree="on", tree_nodes=6)
    verifier = broker.cores["target"].verifier
    trees = []
    verify = verifier.verify

    def recording(rows):
        outcome = verify(rows)
        trees.extend(v.depth for v in outcome.verdicts if v is not None and v.depth is not None)
        return outcome

    verifier.verify = recording
    outs = run_all(router, PROMPTS, [GREEDY] * len(PROMPTS), k=3)
    for prompt, tokens in zip(PROMPTS, outs):
        assert text(router, tokens) == plain_reference(dirs, prompt, 24)
    assert trees, "rounds verified trees"
    params = [SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=50 + i, ignore_eos=True)
              for i in range(4)]

    async def batch():
        return await asyncio.gather(*(generate(router, pr, p, k=3) for pr, p in zip(PROMPTS, params)))

    assert asyncio.run(batch()) == plain_seeded(dirs, PROMPTS, params)


def test_a_rows_drafts_are_verified_the_round_after_it_asks_and_the_plan_counts_a_start(deep_dirs):
    """A drafter inside the target drafts a row's next round in the call that asks for K: that round verifies none
    of the row's drafts, the next verifies them, and a round asked plain drops them. The router marks the rows that
    asked, and the plan reads an unmarked row as starting (engine/spec/plan.RowOutlook.starting)."""
    from tests.deployments.router.test_round import _rows

    router, broker = router_for(deep_dirs[0], "self:2")
    [live] = _rows(router, broker, 1)
    round_ = router.scheduler.round
    assert round_.in_target and live.outlook(3, False, drafts_lag=True).starting
    verified = []
    for k in (3, 3, 3, 0, 3, 3):
        result = asyncio.run(round_.run([live], [k]))
        verified.append(len(result.drafts[0]))
        assert live.drafted_last is (k > 0)
        assert live.outlook(3, False, drafts_lag=True).starting is (k == 0)
    assert verified == [0, 3, 3, 0, 0, 3], verified
    assert not live.outlook(3, False, drafts_lag=False).starting, "drafts that do not lag never start"
