"""engine/spec/verify.py: the one verify step (the in-process engine's and the target worker's), on a tiny model."""

import pytest
import torch

from engine import ModelRunner
from engine.models.kv_budget import KVBudget
from engine.models.static.runner import StaticRunner
from engine.request.delta import SeqDelta, first_delta
from engine.request.grammar import GrammarSpec
from engine.request.sampling import SamplingParams
from engine.spec.verify import TargetVerifier, VerifyRow
from tests.conftest import make_tiny_model

PROMPT = [5, 9, 12, 7, 30, 2]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=3)


def greedy_continuation(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_drafts_the_target_agrees_with_are_accepted_then_the_next_delta_continues(model):
    want = greedy_continuation(model, PROMPT, 7)
    verifier = TargetVerifier(ModelRunner(model), None)
    wrong = (want[1] + 1) % 60
    outcome = verifier.verify([VerifyRow(first_delta("a", PROMPT), want[:3]),
                               VerifyRow(first_delta("b", PROMPT), [want[0], wrong])])
    assert outcome.verdicts[0].tokens == want[:4] and outcome.verdicts[0].num_accepted == 3
    assert outcome.verdicts[1].tokens == want[:2] and outcome.verdicts[1].num_accepted == 1, "recovered at the miss"
    later = verifier.verify([VerifyRow(SeqDelta("a", len(PROMPT), want[:4]), want[4:6])])
    assert later.verdicts[0].tokens == want[4:7] and later.verdicts[0].num_accepted == 2, "settings kept from the first"
    assert verifier.known.tokens["a"] == PROMPT + want[:4]
    verifier.release("a")
    assert "a" not in verifier.known.tokens and not verifier.runner.has("a")


def test_a_row_whose_grammar_cannot_be_served_fails_alone(model):
    want = greedy_continuation(model, PROMPT, 1)
    verifier = TargetVerifier(ModelRunner(model), None)  # no grammar compiler here
    constrained = first_delta("g", PROMPT, SamplingParams(grammar=GrammarSpec("regex", "[ab]+")))
    outcome = verifier.verify([VerifyRow(constrained), VerifyRow(first_delta("p", PROMPT))])
    assert outcome.verdicts[0] is None and "grammar compiler" in str(outcome.failed[0])
    assert list(outcome.failed) == [0] and outcome.verdicts[1].tokens == want


def test_a_side_that_does_not_sample_computes_and_answers_nothing(model):
    verifier = TargetVerifier(ModelRunner(model), None, samples=False)
    assert verifier.verify([VerifyRow(first_delta("a", PROMPT), [3])]) is None
    assert verifier.runner.has("a") and verifier.known.tokens["a"] == PROMPT


class ScriptedDrafter:
    """Drafts `script[i]` on its i-th call, recording what it was given."""

    name = "scripted"
    needs_hidden = False
    collective = False

    def __init__(self, script):
        self.script, self.seen = list(script), []

    def draft(self, runner, rows, hidden):
        self.seen.append([(r.seq_id, r.position, r.committed, r.last, r.k) for r in rows])
        drafts = self.script.pop(0)
        return [drafts[: r.k] for r in rows]


def test_a_target_drafter_drafts_after_the_accept_step_and_its_drafts_are_verified_next_call(model):
    """The seam for drafts made inside the target: the drafter runs after the accept step, from where the row's last
    token was predicted; the row's next call verifies those drafts (made after exactly its committed tokens)."""
    want = greedy_continuation(model, PROMPT, 8)
    drafter = ScriptedDrafter([want[1:4], [want[5], (want[6] + 1) % 60, 0], [0, 0]])
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=4), compile="off", prefill_chunk=16)
    verifier = TargetVerifier(runner, None, drafter=drafter)
    first = verifier.verify([VerifyRow(first_delta("a", PROMPT), target_k=3)])
    assert first.drafts == {0: []} and first.verdicts[0].tokens == want[:1], "no drafts held yet: a plain round"
    assert drafter.seen == [[("a", 0, len(PROMPT) + 1, want[0], 3)]] and first.draft_seconds > 0, "timed apart"
    assert runner.cached_tokens("a") == PROMPT, "rolled back to the committed tokens before drafting"
    second = verifier.verify([VerifyRow(SeqDelta("a", len(PROMPT), want[:1]), target_k=3)])
    assert second.drafts == {0: want[1:4]} and second.verdicts[0].tokens == want[:5][1:], "all three accepted"
    assert drafter.seen[1] == [("a", 3, len(PROMPT) + 5, want[4], 3)]
    third = verifier.verify([VerifyRow(SeqDelta("a", len(PROMPT) + 1, want[1:5]), target_k=2)])
    assert third.drafts == {0: [want[5], (want[6] + 1) % 60]}, "cut to this round's K"
    assert third.verdicts[0].tokens == want[5:7] and third.verdicts[0].num_accepted == 1
    assert verifier.held.stats() == {"held": 1, "used": 2, "missed": 1}


def test_drafting_after_the_reply_hands_the_drafting_to_the_caller_with_the_same_drafts(model):
    """`draft_after_reply`: the step answers first and hands the drafting over (`draft_next`); run before the next
    step, it drafts from the same state as drafting inside the step would, and its time is reported by the next
    step."""
    want = greedy_continuation(model, PROMPT, 8)
    script = [want[1:4], [want[5], 0, 0], [0, 0, 0]]
    outcomes = {}
    for after in (False, True):
        drafter = ScriptedDrafter(list(script))
        runner = StaticRunner(model, budget=KVBudget(max_num_seqs=4), compile="off", prefill_chunk=16)
        verifier = TargetVerifier(runner, None, drafter=drafter, draft_after_reply=after)
        first = verifier.verify([VerifyRow(first_delta("a", PROMPT), target_k=3)])
        if after:
            assert first.draft_next is not None and drafter.seen == [] and len(verifier.held) == 0, "not yet"
            assert first.draft_seconds == 0
            first.draft_next()
        else:
            assert first.draft_next is None
        second = verifier.verify([VerifyRow(SeqDelta("a", len(PROMPT), want[:1]), target_k=3)])
        assert second.draft_seconds > 0, "the drafting's time, reported by the step after it"
        if after:
            second.draft_next()
        outcomes[after] = (first.verdicts[0].tokens, second.drafts, second.verdicts[0].tokens, drafter.seen,
                           verifier.held.stats())
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][1] == {0: want[1:4]}


def test_held_drafts_made_after_other_tokens_are_not_verified(model):
    """A stale guess (the router committed other tokens than the drafter assumed) costs a round without drafts."""
    want = greedy_continuation(model, PROMPT, 4)
    drafter = ScriptedDrafter([[7, 7, 7], [8, 8, 8]])
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=4), compile="off", prefill_chunk=16)
    verifier = TargetVerifier(runner, None, drafter=drafter)
    verifier.verify([VerifyRow(first_delta("a", PROMPT), target_k=3)])
    other = (want[0] + 1) % 60  # not the token the target sampled: the router committed something else
    outcome = verifier.verify([VerifyRow(SeqDelta("a", len(PROMPT), [other]), target_k=3)])
    assert outcome.drafts == {0: []} and outcome.verdicts[0].num_accepted == 0
    assert verifier.held.missed == 2 and verifier.held.used == 0
    verifier.release("a")
    assert len(verifier.held) == 0, "a released sequence's drafts go with it"
