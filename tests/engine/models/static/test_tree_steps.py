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


def tree_rounds(verify, want, n, offer, seq="a"):
    """Rounds from PROMPT until `n` tokens are out: round r offers the tree `offer(r, next three wanted tokens)` (None:
    no drafts) through `verify(rows) -> verdict`. The tokens out, the verdicts and the next round's delta."""
    out, verdicts, delta = [], [], first_delta(seq, PROMPT)
    while len(out) < n:
        tree = offer(len(verdicts), want[len(out):len(out) + 3])
        verdict = verify([VerifyRow(delta) if tree is None else VerifyRow(delta, tree.tokens, tree=tree)])
        verdicts.append(verdict)
        out += verdict.tokens
        delta = SeqDelta(seq, len(PROMPT) + len(out) - len(verdict.tokens), verdict.tokens)
    return out, verdicts, delta


def wrong(tokens):
    return [(t + 1) % 60 for t in tokens]


def test_verify_with_trees_emits_plain_greedy_decoding(model):
    """Rounds of trees holding the right continuation on one branch among wrong ones, and trees that miss."""
    want = greedy_continuation(model, PROMPT, 24)
    verifier = TargetVerifier(_runner(model), None)

    def offer(r, nxt):
        if r % 3 == 2:
            return DraftTree.from_paths([wrong(nxt), [wrong(nxt)[0], nxt[1]]])  # misses at the root
        return DraftTree.from_paths([[nxt[0], wrong(nxt)[1]], wrong(nxt)[:2], nxt])  # the right path: the last branch

    out, verdicts, _ = tree_rounds(lambda rows: verifier.verify(rows).verdicts[0], want, 20, offer)
    assert out[:20] == want[:20]
    assert sum(v.num_accepted for v in verdicts) >= len(verdicts)  # the right branch was taken where offered


def test_a_side_that_does_not_sample_keeps_the_same_path_from_the_committed_tokens(model):
    """A tensor-parallel rank other than 0 computes every tree step but gets no verdict: it keeps the accepted path
    when the row's next call brings the committed tokens (walking the tree by them). Its cache then holds what the
    sampling side's holds, and both score the next step alike."""
    want = greedy_continuation(model, PROMPT, 16)
    sampler, follower = TargetVerifier(_runner(model), None), TargetVerifier(_runner(model), None, samples=False)

    def both(rows):
        verdict = sampler.verify(rows).verdicts[0]
        assert follower.verify(rows) is None
        return verdict

    out, _, delta = tree_rounds(both, want, 12, lambda r, nxt: DraftTree.from_paths(
        [wrong(nxt), nxt, [nxt[0], (nxt[1] + 2) % 60]]))
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
    plain = TargetVerifier(_runner(model, weight_dtype=torch.bfloat16, dtype=torch.float32), None)
    want, _, _ = tree_rounds(lambda rows: plain.verify(rows).verdicts[0], [], 40, lambda r, nxt: None, seq="p")
    tree_rounds(lambda rows: verifier.verify(rows).verdicts[0], want, 30,
                lambda r, nxt: DraftTree.from_paths([wrong(nxt), nxt]))
    verifier.release("a")
    text = PROMPT + want[:30]
    runner.add("b")
    hit = runner.forward(["b"], [text], [1])[0, 0]
    assert runner.last_prefix_hits, "the released sequence's prefix was reused"
    plain = _plain_logits(runner, "c", text[:-1], [text[-1]])[-1]
    _same(hit, plain)
