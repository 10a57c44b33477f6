"""The draft model's steps fed on the device (StaticRunner.forward_fed): the same drafts and proposals as the step loop
that reads each token on the host, round after round, with the runner's token record settled, for greedy, seeded
and unseeded sampled rows; rows with different k or logits processors keep that loop."""

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.models.static.runner import PENDING, KVBudget, StaticRunner
from engine.proposers.base import DraftRequest
from engine.proposers.draft_model import DraftModelProposer
from engine.request.settings import SequenceSettings
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(temperature=0.0)


def _request(seq_id: str, tokens: list[int], k: int, params: SamplingParams = GREEDY, seed: int = 0,
             coupled: bool = False) -> DraftRequest:
    """A draft request; `coupled`: the request brought `seed` (Gumbel-coupled drafts), else its seed was drawn."""
    params = dataclasses.replace(params, seed=seed if coupled else None)
    return DraftRequest(seq_id, list(tokens), k, SequenceSettings.of(params, seed, len(tokens)))


class HostFedRunner(StaticRunner):
    """The same graph-step runner, whose drafts take the host's step loop."""

    takes_device_tokens = False


def proposer(cls, model) -> DraftModelProposer:
    # the graph step's forward (run eagerly off CUDA; Triton's kernels in its interpreter where it is set)
    return DraftModelProposer(cls(model, budget=KVBudget(gib=0.05, max_num_seqs=4), compile="graphs",
                                  prefill_chunk=16), target_vocab_size=model.config.vocab_size)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=7)


ROWS = {"greedy": [(GREEDY, False), (GREEDY, False)],
        "sampled": [(SamplingParams(temperature=0.9, top_k=20), False), (SamplingParams(temperature=0.7), False)],
        "seeded": [(SamplingParams(temperature=0.9, top_p=0.8), True), (SamplingParams(temperature=1.0), True)],
        "mixed": [(GREEDY, False), (SamplingParams(temperature=0.9), True)]}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_fed_drafts_equal_the_host_loops_round_after_round(model, kind):
    fed, host = proposer(StaticRunner, model), proposer(HostFedRunner, model)
    assert fed.runner.takes_device_tokens and not host.runner.takes_device_tokens
    calls = []
    forward_fed = fed.runner.forward_fed
    fed.runner.forward_fed = lambda *a: calls.append(1) or forward_fed(*a)
    committed = {"a": [5, 6, 7, 8], "b": [20, 21, 22, 23, 24, 25]}
    for round_ in range(4):
        requests = [_request(seq_id, tokens, 3, params, seed=11 * b + round_, coupled=coupled)
                    for b, ((seq_id, tokens), (params, coupled)) in enumerate(zip(committed.items(), ROWS[kind]))]
        got, want = fed.propose(requests), host.propose(requests)
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.num_tokens, want.num_tokens)
        assert (got.proposals is None) == (want.proposals is None) == (kind != "sampled")
        for mine, theirs in zip(got.proposals or [], want.proposals or []):
            assert torch.equal(mine.token_ids, theirs.token_ids) and torch.equal(mine.probs, theirs.probs)
        for seq_id in committed:
            record = fed.runner._seqs[seq_id].tokens
            assert PENDING not in record and record == host.runner._seqs[seq_id].tokens
        # the target accepts a different share of each row's drafts every round, then adds its own token
        for b, seq_id in enumerate(committed):
            accepted = (round_ + b) % 4
            committed[seq_id] += got.token_ids[b, :accepted].tolist() + [(round_ * 7 + b) % 60 + 2]
    assert len(calls) == 4 * 2, "two fed steps a round (k = 3)"


def test_a_stop_between_fed_steps_ends_the_round_and_leaves_no_pending_token(model):
    fed = proposer(StaticRunner, model)
    requests = [_request("a", [5, 6, 7], 3)]
    got = fed.propose(requests, stop=lambda: True)
    assert got.num_tokens.tolist() == [1] and got.token_ids[0, 1:].tolist() == [-1, -1]
    assert fed.runner._seqs["a"].tokens == [5, 6, 7]  # the one pick was never fed


def _biased():
    from engine.request.builtin_processors import LogitBias
    from engine.request.logits_processing import RowProcessing

    return RowProcessing((LogitBias((5,), (2.0,)),), [9, 8], 2)


@pytest.mark.parametrize("change", [{"k": 2}, {"processing": _biased()}], ids=["mixed-k", "processed"])
def test_rows_that_differ_keep_the_host_loop(model, change):
    fed = proposer(StaticRunner, model)
    fed.runner.forward_fed = None  # any call would fail
    requests = [_request("a", [5, 6, 7], 3), dataclasses.replace(_request("b", [9, 8], 3),
                                                                              **change)]
    got = fed.propose(requests)
    assert got.num_tokens.tolist() == [3, change.get("k", 3)]


class GuessFrom:
    """A second-stage lookup that guesses from a table of known continuations (right where the table holds the
    draft's own picks), or a fixed wrong guess."""

    def __init__(self, table=None, wrong=False):
        self.table, self.wrong, self.asked = table or {}, wrong, 0

    def lookup(self, tokens, k):
        self.asked += 1
        if self.wrong:
            return [1] * k
        for prefix, continuation in self.table.items():
            if list(tokens[:len(prefix)]) == list(prefix) and len(tokens) >= len(prefix):
                done = len(tokens) - len(prefix)
                return continuation[done:done + k]
        return []


@pytest.mark.parametrize("kind", sorted(ROWS))
@pytest.mark.parametrize("guess", ["right", "wrong", "ngram"])
def test_the_second_stage_makes_the_same_drafts_in_fewer_passes(model, kind, guess):
    """Staged speculative decoding's second stage: a pass checks the lookup's guess of the draft's next tokens and
    keeps its picks up to the first miss. Drafts are the step loop's and each compact proposal is the distribution its
    draft was drawn from (the step loop's up to a wider pass's rounding), for every scheme."""
    from engine.proposers.ngram import NgramProposer

    def eager():  # bf16 products on the CPU operators: a wide pass scores each position as a step does
        return DraftModelProposer(StaticRunner(model, budget=KVBudget(gib=0.05, max_num_seqs=4), compile="off",
                                               prefill_chunk=16, weight_dtype=torch.bfloat16, dtype=torch.float32),
                                  target_vocab_size=model.config.vocab_size)

    host, staged = eager(), eager()
    committed = {"a": [5, 6, 7, 8, 5, 6, 7], "b": [20, 21, 22, 23, 20, 21]}
    requests = [_request(seq_id, tokens, 4, params, seed=11 * b, coupled=coupled)
                for b, ((seq_id, tokens), (params, coupled)) in enumerate(zip(committed.items(), ROWS[kind]))]
    want = host.propose(requests)
    table = {tuple(r.tokens): want.token_ids[b].tolist() for b, r in enumerate(requests)}
    staged.lookup = {"right": GuessFrom(table), "wrong": GuessFrom(wrong=True), "ngram": NgramProposer(1, 3)}[guess]
    got = staged.propose(requests)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.num_tokens, want.num_tokens)
    assert (got.proposals is None) == (want.proposals is None)
    from engine.models.static.prefix_cache import why_layout_variant
    exact = why_layout_variant(host.runner.model) is None  # else a wider pass may round its sums differently
    for mine, theirs in zip(got.proposals or [], want.proposals or []):
        if exact:
            assert torch.equal(mine.token_ids, theirs.token_ids) and torch.equal(mine.probs, theirs.probs)
        else:
            assert torch.equal(mine.token_ids[:, :8], theirs.token_ids[:, :8])
            torch.testing.assert_close(mine.probs[:, :8], theirs.probs[:, :8], rtol=1e-3, atol=1e-5)
    passes, made = staged.lookup_steps
    assert made == 8
    if guess == "right":
        assert passes == 1, "a guess that holds makes all four drafts in one pass"
    if guess == "wrong":
        assert passes == 4
    for seq_id in committed:  # the cache keeps the drafts but the last (not fed yet), as the step loop's
        assert staged.runner._seqs[seq_id].tokens == host.runner._seqs[seq_id].tokens
