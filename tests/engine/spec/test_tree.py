"""Token trees (engine/spec/tree.py) and their accept step (engine/spec/accept.tree_verdicts): the structure, EAGLE-2's
reranking, and exactness: greedy, seeded and unseeded rows emit plain decoding's text whatever the tree, and an
unseeded row's tokens follow the target's distribution."""

import collections
import random

import pytest
import torch

from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from engine.spec.accept import RowVerify, verify_rows
from engine.spec.proposal import RowScheme
from engine.spec.tree import Candidate, DraftTree, best_tree, walk

VOCAB = 6


def test_a_tree_knows_its_depths_ancestors_and_paths():
    tree = DraftTree(tokens=(5, 7, 2, 9), parents=(0, 0, 1, 3))  # 0 -> 1 -> 3 -> 4, 0 -> 2
    assert tree.width == 5 and tree.depths == (0, 1, 1, 2, 3) and tree.depth == 3
    assert tree.ancestors == (0b1, 0b11, 0b101, 0b1011, 0b11011)
    assert tree.path(4) == [1, 3, 4] and tree.path_tokens(4) == [5, 2, 9] and tree.path(0) == []
    assert tree.child(0, 7) == 2 and tree.child(1, 7) is None
    assert not tree.is_chain and DraftTree.chain([4, 4, 1]).is_chain
    assert tree.pruned(2) == DraftTree((5, 7), (0, 0))
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2), (0, 2))
    with pytest.raises(ValueError, match="two children"):
        DraftTree((1, 1), (0, 0))


def test_paths_merge_on_their_common_prefixes_within_the_budget():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5], [1, 6, 7]], budget=6)
    assert tree == DraftTree((1, 2, 3, 4, 5, 6), (0, 1, 2, 2, 0, 1))


def test_best_tree_keeps_the_best_nodes_by_path_score_and_their_parents():
    pool = [Candidate(10, -1, 0.6), Candidate(11, -1, 0.3), Candidate(12, 0, 0.5), Candidate(13, 0, 0.05),
            Candidate(14, 2, 0.45), Candidate(15, 1, 0.2), Candidate(16, 4, 0.01)]
    tree, chosen = best_tree(pool, budget=4)
    assert chosen == [0, 1, 2, 4]  # the four best scores; 13, 15, 16 lose
    assert tree == DraftTree((10, 11, 12, 14), (0, 0, 1, 3))
    assert best_tree(pool, budget=1)[0] == DraftTree((10,), (0,))


def test_the_walk_follows_the_targets_choices_until_no_child_holds_one():
    tree = DraftTree(tokens=(5, 7, 2, 9), parents=(0, 0, 1, 3))
    assert walk(tree, [5, 2, 0, 9, 4]).tokens == [5, 2, 9, 4] and walk(tree, [5, 2, 0, 9, 4]).path == [1, 3, 4]
    assert walk(tree, [7, 0, 3, 0, 0]).tokens == [7, 3] and walk(tree, [7, 0, 3, 0, 0]).num_accepted == 1
    assert walk(tree, [1, 0, 0, 0, 0]).tokens == [1] and walk(tree, [1, 0, 0, 0, 0]).path == []


# a toy target: the next token's logits are a fixed function of the whole context
def _toy_logits(context):
    gen = torch.Generator().manual_seed(hash(tuple(context)) % (2 ** 31))
    return torch.randn(VOCAB, generator=gen) * 1.5


def _tree_logits(context, tree):  # [1, N + 1, V]: each node scored after the context and its path
    return torch.stack([_toy_logits(context + tree.path_tokens(i)) for i in range(tree.width)])[None]


def _random_tree(rng, context, params, nodes):
    """A tree whose first branch often holds the target's likely tokens (so walks go deep) and whose others are
    random."""
    paths = []
    for _ in range(3):
        path, ctx = [], list(context)
        for _ in range(rng.randint(1, 4)):
            logits = _toy_logits(ctx)
            token = int(logits.argmax()) if rng.random() < 0.7 else rng.randrange(VOCAB)
            path.append(token)
            ctx.append(token)
        paths.append(path)
    return DraftTree.from_paths(paths, budget=nodes)


def _decode(params, coupled, seed, steps, rng=None, nodes=6):
    """The row's text by plain decoding (rng None: no drafts) or by rounds of random trees."""
    context, out = [1, 2], []
    while len(out) < steps:
        scheme = RowScheme(params.greedy, coupled, seed, len(context))
        if rng is None:
            (verdict,) = verify_rows(_toy_logits(context)[None, None], [RowVerify(params, scheme, ())])
        else:
            tree = _random_tree(rng, context, params, nodes)
            (verdict,) = verify_rows(_tree_logits(context, tree), [RowVerify(params, scheme, tree.tokens, tree=tree)])
            assert verdict.path is not None and len(verdict.path) == verdict.num_accepted
            assert verdict.tokens[:-1] == [tree.tokens[i - 1] for i in verdict.path]
        context += verdict.tokens
        out += verdict.tokens
    return out[:steps]


@pytest.mark.parametrize("params,coupled", [
    (SamplingParams(), False),  # greedy
    (SamplingParams(temperature=0.9, seed=3), True),  # seeded: Gumbel coupling
    (SamplingParams(temperature=1.1, top_k=4), False),  # unseeded: the counter-uniform draw
])
def test_tree_rounds_emit_plain_decodings_text(params, coupled):
    for seed in range(4):
        plain = _decode(params, coupled, seed, 24)
        rng = random.Random(seed)
        assert _decode(params, coupled, seed, 24, rng) == plain


def test_an_unseeded_rows_first_two_tokens_follow_the_targets_distribution():
    """Over many seeds, the pair emitted by one tree round (when the walk accepts a draft) or two (when it stops at
    the root) is distributed as the target's own two-step distribution: a chi-square test at 1e-3."""
    params = SamplingParams(temperature=1.0)
    context = [3]
    p0 = torch.softmax(_toy_logits(context), -1)
    joint = {(a, b): float(p0[a] * torch.softmax(_toy_logits(context + [a]), -1)[b])
             for a in range(VOCAB) for b in range(VOCAB)}
    top = p0.argsort(descending=True).tolist()
    tree = DraftTree((top[0], top[1], top[2]), (0, 0, 1))  # two candidates at the root, one grandchild
    counts = collections.Counter()
    trials = 6000
    for seed in range(trials):
        scheme = RowScheme(False, False, seed, len(context))
        (verdict,) = verify_rows(_tree_logits(context, tree), [RowVerify(params, scheme, tree.tokens, tree=tree)])
        tokens = list(verdict.tokens)
        if len(tokens) < 2:  # one more plain step from the same seed's stream
            scheme = RowScheme(False, False, seed, len(context) + 1)
            (more,) = verify_rows(_toy_logits(context + tokens)[None, None], [RowVerify(params, scheme, ())])
            tokens += more.tokens
        counts[tuple(tokens[:2])] += 1
    chi2 = sum((counts[k] - trials * p) ** 2 / (trials * p) for k, p in joint.items() if trials * p >= 5)
    dof = sum(1 for p in joint.values() if trials * p >= 5) - 1
    # the chi-square quantile at 1 - 1e-3 is below dof + 5 sqrt(2 dof) for these sizes
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)


def test_tree_rows_report_logprobs_at_the_nodes_they_were_chosen_at():
    params = SamplingParams(temperature=1.0, seed=7, logprobs=2)
    context = [4, 4]
    tree = DraftTree.chain([int(_toy_logits(context).argmax())])
    logits = _tree_logits(context, tree)
    (verdict,) = verify_rows(logits, [RowVerify(params, RowScheme(False, True, 7, 2), tree.tokens, tree=tree)])
    dist = logits_to_probs(logits, BatchSampling.from_params([params]))[0].log()
    at = [0, *verdict.path]
    assert [lp.logprob for lp in verdict.logprobs] == pytest.approx(
        [float(dist[n, t]) for n, t in zip(at, verdict.tokens)])


def test_tree_and_chain_rows_share_a_call():
    tree = DraftTree((1, 2), (0, 0))
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    rows = [RowVerify(greedy, RowScheme(True, False, 0, 5), (1, 2), tree=tree),
            RowVerify(greedy, RowScheme(True, False, 0, 5), (int(logits[1, 0].argmax()),))]
    tree_verdict, chain_verdict = verify_rows(logits, rows)
    assert tree_verdict.tokens[0] == int(logits[0, 0].argmax()) and tree_verdict.path is not None
    assert chain_verdict.num_accepted == 1 and chain_verdict.path is None


def test_a_chain_with_siblings_keeps_the_best_alternatives_by_path_score():
    from engine.spec.tree import chain_with_siblings
    steps = [[(10, 0.6), (11, 0.3)], [(20, 0.5), (21, 0.4)], [(30, 0.9), (31, 0.05)]]
    tree = chain_with_siblings(steps, budget=4)
    # path scores: 10 .6, 11 .3, 20 .3, 21 .24, 30 .27, 31 .015: the best four are 10, 11, 20, 30
    assert tree == DraftTree((10, 11, 20, 30), (0, 0, 1, 3))
    assert chain_with_siblings(steps, budget=15).depth == 3 and len(chain_with_siblings(steps, 15)) == 6


def test_medusa_trees_expand_every_heads_candidates_best_first():
    from engine.spec.tree import independent_heads
    steps = [[(1, 0.7), (2, 0.2)], [(3, 0.5), (4, 0.5)]]
    tree = independent_heads(steps, budget=4)
    # scores: 1 .7, 1-3 .35, 1-4 .35, 2 .2, 2-3 .1: four nodes
    assert sorted(zip(tree.tokens, tree.parents)) == sorted([(1, 0), (3, 1), (4, 1), (2, 0)])
    assert len(independent_heads(steps, budget=15)) == 6
