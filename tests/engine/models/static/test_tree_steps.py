"""Tree steps of the static runner (engine/spec/tree.py): every node is scored as plain decoding of its path scores it
(the same bits on the CPU operators), the accepted path's keys and values move into place, and the verify step
(engine/spec/verify.py) with trees emits plain greedy decoding's tokens."""

import pytest
import torch

from engine.models.cpu import extension as cpu_extension
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.request.delta import SeqDelta, first_delta
from engine.spec.tree import DraftTree
from engine.spec.verify import TargetVerifier, VerifyRow
from tests.conftest import make_tiny_model

PROMPT = [5, 9, 12, 7, 30, 2, 44]
SLOTS = KVBudget(max_num_seqs=4)
FUSED = cpu_extension.op("cache_attention") is not None


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=4)


def _runner(model, **kw):
    return StaticRunner(model, budget=SLOTS, compile="off", prefill_chunk=16, **kw)


def _plain_logits(runner, seq, prompt, path):  # [len(path) + 1, V]: each step's logits decoding the path
    runner.add(seq)
    out = [runner.forward([seq], [prompt], [1])[0, 0]]
    for token in path:
        out.append(runner.forward([seq], [[token]], [1])[0, 0])
    return torch.stack(out)


def _same(a, b):
    if FUSED:  # the CPU operators: a node's arithmetic is its path's, bit for bit
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", [None, torch.bfloat16])
def test_every_node_is_scored_as_decoding_its_path(model, weights):
    runner = _runner(model, weight_dtype=weights, dtype=torch.float32)
    tree = DraftTree(tokens=(3, 8, 3, 21, 9, 50), parents=(0, 0, 1, 1, 3, 2))
    runner.add("t")
    runner.forward(["t"], [PROMPT[:-1]], [1])
    logits = runner.forward(["t"], [[PROMPT[-1], *tree.tokens]], [tree.width], trees=[tree])[0]  # [N + 1, V]
    for node in (0, 2, 4, 5, 6):
        path = tree.path_tokens(node)
        seq = f"plain{node}"
        plain = _plain_logits(runner, seq, PROMPT, path)
        _same(logits[node], plain[-1])
        runner.release(seq)


def test_the_accepted_path_moves_into_place_and_decoding_goes_on_as_plain(model):
    runner = _runner(model)
    tree = DraftTree(tokens=(3, 8, 3, 21, 9, 50), parents=(0, 0, 1, 1, 3, 2))
    runner.add("t")
    runner.forward(["t"], [PROMPT[:-1]], [1])
    runner.forward(["t"], [[PROMPT[-1], *tree.tokens]], [tree.width], trees=[tree])
    runner.keep_path("t", tree.width, [1, 3, 5])  # 3 -> 3 -> 9
    assert runner.cached_tokens("t") == PROMPT + [3, 3, 9]
    after = runner.forward(["t"], [[17, 4]], [2])[0]
    plain = _plain_logits(runner, "p", PROMPT, [3, 3, 9, 17, 4])
    _same(after, plain[-2:])


def test_tree_and_chain_rows_share_a_step(model):
    runner = _runner(model)
    tree = DraftTree(tokens=(3, 8, 40), parents=(0, 0, 2))
    for seq in ("t", "c"):
        runner.add(seq)
        runner.forward([seq], [PROMPT[:-1]], [1])
    logits = runner.forward(["t", "c"], [[PROMPT[-1], *tree.tokens], [PROMPT[-1], 8, 40]], [4, 3],
                            trees=[tree, None])
    _same(logits[0, 3], logits[1, 2])  # the tree's 8 -> 40 is the chain's
    _same(logits[0, 2], logits[1, 1])


def greedy_continuation(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_verify_with_trees_emits_plain_greedy_decoding(model):
    """Rounds of trees holding the right continuation on one branch among wrong ones, and trees that miss."""
    want = greedy_continuation(model, PROMPT, 24)
    verifier = TargetVerifier(_runner(model), None)
    out, delta = [], first_delta("a", PROMPT)
    rounds = accepted = 0
    while len(out) < 20:
        nxt = want[len(out):len(out) + 3]
        wrong = [(t + 1) % 60 for t in nxt]
        if rounds % 3 == 2:
            tree = DraftTree.from_paths([wrong, [wrong[0], nxt[1]]])  # misses at the root
        else:
            tree = DraftTree.from_paths([[nxt[0], wrong[1]], wrong[:2], nxt])  # the right path is the last branch
        outcome = verifier.verify([VerifyRow(delta, tree.tokens, tree=tree)])
        verdict = outcome.verdicts[0]
        accepted += verdict.num_accepted
        out += verdict.tokens
        delta = SeqDelta("a", len(PROMPT) + len(out) - len(verdict.tokens), verdict.tokens)
        rounds += 1
    assert out[:20] == want[:20]
    assert accepted >= rounds  # the right branch was taken where it was offered


def test_a_side_that_does_not_sample_keeps_the_same_path_from_the_committed_tokens(model):
    """A tensor-parallel rank other than 0 computes every tree step but gets no verdict: it keeps the accepted path
    when the row's next call brings the committed tokens (walking the tree by them). Its cache then holds what the
    sampling side's holds, and both score the next step alike."""
    want = greedy_continuation(model, PROMPT, 16)
    sampler, follower = TargetVerifier(_runner(model), None), TargetVerifier(_runner(model), None, samples=False)
    delta = first_delta("a", PROMPT)
    out = []
    while len(out) < 12:
        nxt = want[len(out):len(out) + 3]
        tree = DraftTree.from_paths([[(t + 1) % 60 for t in nxt], nxt, [nxt[0], (nxt[1] + 2) % 60]])
        rows = [VerifyRow(delta, tree.tokens, tree=tree)]
        verdict = sampler.verify(rows).verdicts[0]
        assert follower.verify(rows) is None
        out += verdict.tokens
        delta = SeqDelta("a", len(PROMPT) + len(out) - len(verdict.tokens), verdict.tokens)
    last = [VerifyRow(delta)]
    sampler.verify(last)
    follower.verify(last)
    assert sampler.runner.cached_tokens("a") == follower.runner.cached_tokens("a") == PROMPT + out
    assert out == want[:len(out)]


def test_a_sequence_decoded_with_trees_leaves_a_prefix_the_cache_can_serve(model):
    """With the prefix cache, a released sequence's keys and values serve the next that starts the same way: after
    tree rounds they are the accepted path's, so a later prompt over that text scores as plain decoding does."""
    runner = _runner(model, weight_dtype=torch.bfloat16, dtype=torch.float32)  # bf16 products: exact prefix hits
    if runner.prefix_cache is None:
        pytest.skip("no layout-invariant forward here (the prefix cache needs AVX512_BF16)")
    verifier = TargetVerifier(runner, None)
    plain, want = TargetVerifier(_runner(model, weight_dtype=torch.bfloat16, dtype=torch.float32), None), []
    delta = first_delta("p", PROMPT)
    while len(want) < 40:  # plain greedy decoding on the same kernels
        tokens = plain.verify([VerifyRow(delta)]).verdicts[0].tokens
        delta = SeqDelta("p", len(PROMPT) + len(want), tokens)
        want += tokens
    delta, out = first_delta("a", PROMPT), []
    while len(out) < 30:
        nxt = want[len(out):len(out) + 3]
        tree = DraftTree.from_paths([[(t + 1) % 60 for t in nxt], nxt])
        verdict = verifier.verify([VerifyRow(delta, tree.tokens, tree=tree)]).verdicts[0]
        out += verdict.tokens
        delta = SeqDelta("a", len(PROMPT) + len(out) - len(verdict.tokens), verdict.tokens)
    verifier.release("a")
    text = PROMPT + want[:30]
    runner.add("b")
    hit = runner.forward(["b"], [text], [1])[0, 0]
    assert runner.last_prefix_hits, "the released sequence's prefix was reused"
    plain = _plain_logits(runner, "c", text[:-1], [text[-1]])[-1]
    _same(hit, plain)
