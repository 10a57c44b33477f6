"""engine/spec/verify.py: the one verify step (the in-process engine's and the target worker's), on a tiny model."""

import pytest
import torch

from engine import ModelRunner
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


def test_a_target_drafter_drafts_the_next_round_from_the_verify_pass(model):
    """The seam for drafts made inside the target: called after the accept step with the rows, their verdicts and
    the verify pass's logits; its drafts come back in the same outcome."""
    seen = []

    class ArgmaxDrafter:
        def draft(self, rows, verdicts, logits):
            seen.append((len(rows), [v.num_accepted for v in verdicts], tuple(logits.shape)))
            return [[int(logits[b, v.num_accepted].argmax())] for b, v in enumerate(verdicts)]

    verifier = TargetVerifier(ModelRunner(model), None, drafter=ArgmaxDrafter())
    outcome = verifier.verify([VerifyRow(first_delta("a", PROMPT), [4, 4])])
    assert seen == [(1, [outcome.verdicts[0].num_accepted], (1, 3, model.config.vocab_size))]
    assert outcome.next_drafts == [[outcome.verdicts[0].tokens[-1]]], "greedy: the bonus token is the logits' argmax"
