"""Token trees through the in-process engine (engine/speculative.py) from every draft source it has: n-gram lookup's
several matches, a draft model, the target's first layers and an EAGLE-3 head (their chain with its best alternatives
beside it),
Medusa heads (every path through their best candidates). Greedy and seeded texts equal plain decoding's, and trees
were really verified (and their branches taken)."""

import pytest

from engine import DraftModelProposer, NgramProposer, SamplingParams, SpeculativeEngine
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.proposers.eagle3 import Eagle3Drafter
from engine.proposers.early_exit import EarlyExitDrafter
from engine.proposers.medusa import MedusaDrafter
from engine.spec.plan import TreeSettings
from engine.spec.tree import DraftTree
from tests.conftest import make_tiny_model
from tests.engine.proposers.test_eagle3 import LAYERS, random_head
from tests.engine.proposers.test_early_exit import passthrough_model
from tests.engine.proposers.test_medusa import random_heads

PROMPTS = [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 20, 21, 22, 20, 21],
           [30, 31, 30, 32, 30, 31, 33, 30, 31]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    return {"passthrough": passthrough_model(seed=1), "eagle3": make_tiny_model("llama", seed=0, layers=LAYERS)}


def runner_of(model):
    return StaticRunner(model, budget=KVBudget(max_num_seqs=8), compile="off", prefill_chunk=16)


def source(name, runner, model):
    """(proposer, drafter) of a draft source over `runner`."""
    if name == "ngram":
        return NgramProposer(min_n=1, max_n=3), None
    if name == "model":
        return DraftModelProposer(runner_of(make_tiny_model("llama", seed=1)), runner.vocab_size), None
    if name == "self":
        return None, EarlyExitDrafter(1)
    if name == "medusa":
        return None, MedusaDrafter(random_heads(runner.vocab_size), runner.model)
    return None, Eagle3Drafter(random_head(model, seed=3), runner)


@pytest.mark.parametrize("name", ["ngram", "model", "self", "medusa", "eagle3"])
def test_trees_from_every_source_keep_greedy_and_seeded_text(models, tiny_tokenizer, name):
    model = models["eagle3" if name == "eagle3" else "passthrough"]  # a head's aux layers need 8 layers
    runner = runner_of(model)
    proposer, drafter = source(name, runner, model)
    spec = SpeculativeEngine(runner, tiny_tokenizer, proposer, 3, drafter=drafter, tree=TreeSettings("on", 6))
    plain = SpeculativeEngine(runner_of(model), tiny_tokenizer, None, 3)
    rounds = []  # the trees verified: a proposer's travel in the rows, a target drafter's are taken where held
    verify, take = spec.verifier.verify, spec.verifier.held.take

    def verify_recording(rows):
        rounds.extend(row.tree for row in rows if row.tree is not None)
        return verify(rows)

    def take_recording(*args):
        held = take(*args)
        if isinstance(held, DraftTree):
            rounds.append(held)
        return held

    spec.verifier.verify, spec.verifier.held.take = verify_recording, take_recording
    assert [c.token_ids for c in spec.generate(PROMPTS, GREEDY)] == \
        [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    assert [c.token_ids for c in spec.generate(PROMPTS, SEEDED)] == \
        [c.token_ids for c in plain.generate(PROMPTS, SEEDED)]
    assert rounds and any(not tree.is_chain for tree in rounds), "real trees were verified"
    assert spec.stats.num_accepted_tokens > 0
    assert runner.num_live == 0


def test_ngram_lookup_merges_several_matches_into_a_tree():
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 5, 1, 2]
    tree = NgramProposer(min_n=2, max_n=2).lookup_tree(tokens, k=3, budget=8)
    # the latest match of [1, 2] first: 3 7 5, then 4 8 1, then 3 9 1 (sharing its 3 with the first)
    assert tree.path_tokens(3) == [3, 7, 5]
    assert {tuple(tree.path_tokens(i)) for i in range(1, len(tree) + 1) if tree.depths[i] == 3} == {
        (3, 7, 5), (4, 8, 1), (3, 9, 1)}
    assert len(tree) == 8
