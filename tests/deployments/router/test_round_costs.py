"""deployments/router/round_costs.py: which costs a pairing's K is chosen by, and what rounds feed back into them."""

from types import SimpleNamespace

import pytest

from deployments.router.round_costs import (
    PLAIN_SAMPLE_EVERY,
    PLAIN_SAMPLE_FIRST,
    PLAIN_SAMPLE_ROUNDS,
    RoundCosts,
    pair_key,
)
from deployments.transport.messages import CostObservation
from engine.calibration.measure import profile_from

BATCHES = [1, 2, 4]
TARGET = SimpleNamespace(key="t1", costs={"batch_sizes": BATCHES, "verify_seconds": [[0.05, 0.06]] * 3})
DRAFT = SimpleNamespace(key="d1", costs={"batch_sizes": BATCHES, "draft_step_seconds": [0.01, 0.012, 0.02],
                                         "draft_prefill_seconds_per_token": 0.001})


def call(tokens):  # what observe looks at: the tokens the call carries
    return SimpleNamespace(seq=SimpleNamespace(tokens=tokens))


def test_measured_costs_are_corrected_by_steady_rounds_only():
    costs = RoundCosts(adaptive=True, remote_draft=True)
    before = costs.policy_profile(DRAFT, TARGET)
    assert before == costs.measured(DRAFT, TARGET) and costs.corrects
    costs.observe(CostObservation(DRAFT, TARGET, "verify", [call(list(range(40)))], 1, 10.0))  # a prefill: left out
    assert costs.policy_profile(DRAFT, TARGET) == before
    costs.observe(CostObservation(DRAFT, TARGET, "verify", [call([5, 6])], 1, 2 * before.verify(1, 1)))
    costs.observe(CostObservation(DRAFT, TARGET, "draft", [call([5, 6])], 1, 3 * before.draft(1, 1)))
    costs.observe_overhead(DRAFT, TARGET, 0.004)
    costs.observe_overhead(DRAFT, TARGET, 0.007, drafted=True)
    after = costs.policy_profile(DRAFT, TARGET)
    assert after.verify(1, 1) == pytest.approx(2 * before.verify(1, 1))
    assert after.draft(1, 1) == pytest.approx(3 * before.draft(1, 1))
    assert after.round_overhead_seconds == pytest.approx(0.004)
    assert after.round_seconds(1, 1) == pytest.approx(after.draft(1, 1) + 0.003 + after.verify(1, 1) + 0.004)
    shown = costs.shown()["d1 / t1"]
    # only a drafting round's verify was seen: its ratio stands for plain passes too
    assert shown["observed_over_profile"] == {"draft": 3.0, "verify": 2.0, "verify_wide": 2.0,
                                              "draft_overhead_ms": 3.0, "round_overhead_ms": 4.0}
    other = SimpleNamespace(key="t2", costs=TARGET.costs)  # another pairing keeps its own correction
    assert costs.policy_profile(DRAFT, other) == before and pair_key(DRAFT, other) == ("d1", "t2")



def test_a_pairing_that_sees_no_round_decoded_ahead_samples_plain_rounds_to_learn_their_cost():
    """Only plain rounds answered from a step decoded ahead show what plain decoding costs once it goes on; a pairing
    that sees none runs a few plain rounds after PLAIN_SAMPLE_FIRST rounds, then after every PLAIN_SAMPLE_EVERY
    rounds without one."""
    costs = RoundCosts(adaptive=True, remote_draft=True)

    def rounds(n, drafted=True):
        for _ in range(n):
            assert costs.plain_sample(DRAFT, TARGET) == 0
            costs.observe_overhead(DRAFT, TARGET, 0.002, drafted=drafted)

    def sample():
        left = []
        while costs.plain_sample(DRAFT, TARGET):
            left.append(costs.plain_sample(DRAFT, TARGET))
            costs.observe_overhead(DRAFT, TARGET, -0.004, ahead=len(left) > 1)  # the first computed when asked
        return left

    rounds(PLAIN_SAMPLE_FIRST // 2)
    rounds(PLAIN_SAMPLE_FIRST // 2, drafted=False)  # plain rounds computed when asked teach nothing of ahead ones
    assert sample() == list(range(PLAIN_SAMPLE_ROUNDS, 0, -1))  # the last round of a sample is marked 1
    assert costs.policy_profile(DRAFT, TARGET, ahead=True).round_overhead_seconds == pytest.approx(-0.004)
    rounds(PLAIN_SAMPLE_EVERY)
    assert len(sample()) == PLAIN_SAMPLE_ROUNDS
    rounds(PLAIN_SAMPLE_EVERY - 1)
    costs.observe_overhead(DRAFT, TARGET, -0.001, ahead=True)  # a round decoded ahead restarts the count
    rounds(PLAIN_SAMPLE_EVERY - 1)
    other = SimpleNamespace(key="t2", costs=TARGET.costs)
    assert costs.plain_sample(DRAFT, other) == 0  # per pairing
    given = RoundCosts(adaptive=True, remote_draft=True, calibration=profile_from(BATCHES, [[0.1, 0.2]] * 3,
                                                                                 [0.05] * 3))
    for _ in range(PLAIN_SAMPLE_FIRST + 1):
        given.observe_overhead(DRAFT, TARGET, 0.002, drafted=True)
    assert given.plain_sample(DRAFT, TARGET) == 0  # a calibration file's costs are taken as given

def test_a_calibration_file_is_taken_as_given_and_no_policy_means_no_costs():
    calibration = profile_from(BATCHES, [[0.1, 0.2]] * 3, [0.05] * 3)
    costs = RoundCosts(adaptive=True, remote_draft=True, calibration=calibration)
    costs.observe(CostObservation(DRAFT, TARGET, "verify", [call([5, 6])], 1, 9.0))
    assert costs.policy_profile(DRAFT, TARGET) == calibration and not costs.corrects
    assert list(costs.shown()) == ["calibration file"]
    assert RoundCosts(adaptive=False, remote_draft=True).policy_profile(DRAFT, TARGET) is None


def test_a_draft_model_pairing_without_draft_costs_has_no_profile():
    costs = RoundCosts(adaptive=True, remote_draft=True)
    assert costs.policy_profile(SimpleNamespace(key="d2", costs=None), TARGET) is None
    ngram = RoundCosts(adaptive=True, remote_draft=False)
    assert ngram.policy_profile(None, TARGET).draft(1, 3) == 0.0  # n-gram drafts cost nothing


def test_stats_say_which_operator_computes_each_sides_bf16_products():
    chosen = {"by_class": {"1 row": "amx"}, "mixed": False, "reason": "r", "ms": {}}
    target = SimpleNamespace(key="t3", costs={**TARGET.costs, "bf16_products": chosen})
    costs = RoundCosts(adaptive=True, remote_draft=True)
    costs.measured(DRAFT, target)
    assert costs.shown()["d1 / t3"]["bf16_products"] == {"target": chosen, "draft": None}
