"""Costs, corrections and acceptance (engine/spec/policy.py) as the round plan (engine/spec/plan.py) reads them, and the
cost measurement behind them (engine/calibration/measure.py)."""

import pytest

from engine import ModelRunner
from engine.calibration.measure import measure_draft_step, measure_verify, monotone, profile_from
from engine.spec.plan import RowOutlook, plan_round
from engine.spec.policy import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    AcceptanceTracker,
    CostCorrection,
    MIN_ROUND_SHARE,
    CostProfile,
    expected_tokens,
    load_adjusted_k,
    worth_starting,
)
from tests.conftest import make_tiny_model


def cpu_like_profile() -> CostProfile:
    """Verify nearly free at batch 1 (memory-bound), linear in rows once compute-bound; draft step ~0.4 target."""
    sizes = (1, 2, 4, 8, 16)
    verify = tuple(tuple(0.040 * max(1.0, b * (w + 1) / 4) for w in range(4)) for b in sizes)
    draft = tuple(0.016 * max(1.0, b / 4) for b in sizes)
    return CostProfile(sizes, verify, draft)


def planned_k(profile: CostProfile, batch: int, acceptance: float, k_max: int) -> int:
    """The K the round plan gives a round of `batch` rows that all accept at `acceptance`."""
    return max(plan_round(profile, [RowOutlook(acceptance, k_max)] * batch))


def last_drafting_batch(profile: CostProfile, acceptance: float, k_max: int) -> int:
    """The largest batch (up to 4x the largest measured) whose plan drafts, 0 for none."""
    return max((b for b in range(1, 4 * profile.batch_sizes[-1] + 1) if planned_k(profile, b, acceptance, k_max)),
               default=0)


def test_expected_tokens_matches_leviathan():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def test_k_shrinks_to_zero_as_the_batch_grows():
    profile = cpu_like_profile()
    ks = [planned_k(profile, batch, 0.8, 4) for batch in (1, 2, 4, 8, 16, 32)]
    assert ks[0] >= 2, ks
    assert ks == sorted(ks, reverse=True), ks
    assert ks[-1] == 0 and ks[-2] == 0, ks
    last = last_drafting_batch(profile, 0.8, 4)
    assert 1 <= last < 4 * profile.batch_sizes[-1]
    assert all(planned_k(profile, b, 0.8, 4) > 0 for b in range(1, last + 1)), "drafting stops once, at one batch"


def test_k_follows_acceptance_and_respects_the_bound():
    profile = cpu_like_profile()
    ks = [planned_k(profile, 1, a, 4) for a in (0.05, 0.3, 0.6, 0.9, 0.99)]
    assert ks[0] == 0 and ks == sorted(ks), ks
    assert max(ks) <= 4
    assert planned_k(profile, 1, 0.99, 2) == 2


def test_free_drafts_and_free_verification_always_speculate():
    sizes = (1, 4)
    flat = CostProfile(sizes, ((0.01, 0.01, 0.01), (0.01, 0.01, 0.01)), (0.0, 0.0))
    assert planned_k(flat, 64, 0.2, 2) == 2


def test_profile_interpolates_extrapolates_and_round_trips(tmp_path):
    profile = cpu_like_profile()
    assert profile.verify(3, 0) == pytest.approx((profile.verify(2, 0) + profile.verify(4, 0)) / 2)
    assert profile.verify(32, 3) > profile.verify(16, 3)
    assert profile.verify(4, 5) > profile.verify(4, 3) and profile.verify(1, 5) >= profile.verify(1, 3)
    assert profile.draft(8, 3) == pytest.approx(3 * profile.draft_step_seconds[3])
    path = tmp_path / "costs.json"
    profile.to_json(path, machine="test")
    assert CostProfile.from_json(path) == profile
    with pytest.raises(ValueError):
        CostProfile((4, 1), profile.verify_seconds[:2], profile.draft_step_seconds[:2])


def _next_k(profile, tracker, batch, k_max):
    """One request's K from its tracker, as the round plan gives it to a row alone (engine/spec/plan.py)."""
    row = RowOutlook(tracker.acceptance, k_max, wants_probe=tracker.wants_probe)
    return plan_round(profile, [row], batch)[0]


def test_tracker_drops_a_failing_request_to_zero_then_probes():
    profile = cpu_like_profile()
    tracker = AcceptanceTracker()
    assert _next_k(profile, tracker, 1, 4) > 0  # the prior lets a new request speculate
    for _ in range(6):
        tracker.record(3, 0)
    assert tracker.acceptance < 0.1
    ks = []
    for _ in range(7 * PROBE_EVERY + 3):
        k = _next_k(profile, tracker, 1, 4)
        ks.append(k)
        tracker.record(k, 0)
    assert set(ks) == {0, 1}, ks
    # a probe after PROBE_EVERY rounds at K = 0; each failed probe doubles the wait before the next
    probes = [i for i, k in enumerate(ks) if k == 1]
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY + 1 + PROBE_EVERY, 6 * PROBE_EVERY + 2 + PROBE_EVERY], ks
    for _ in range(8):
        tracker.record(1, 1)
    assert _next_k(profile, tracker, 1, 4) >= 2, "a request whose drafts start agreeing gets K back"


def test_probe_waits_back_off_and_reset_once_drafting_goes_on():
    tracker = AcceptanceTracker()
    waits = []
    for _ in range(5):  # probes that fail: one round with a draft, then none
        tracker.record(0, 0)
        waits.append(tracker.probe_every)
        for _ in range(tracker.probe_every - 1):
            tracker.record(0, 0)
        assert tracker.wants_probe
        tracker.record(1, 0)
        assert not tracker.wants_probe
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, MAX_PROBE_EVERY, MAX_PROBE_EVERY]
    assert tracker.probe_every == MAX_PROBE_EVERY
    for _ in range(MAX_PROBE_EVERY - 1):
        tracker.record(0, 0)
    assert tracker.probe_due_next and not tracker.wants_probe
    tracker.record(0, 0)
    tracker.record(1, 1)  # the probe agreed and the plan drafts on: the next stop probes after PROBE_EVERY again
    tracker.record(2, 2)
    assert tracker.probe_every == PROBE_EVERY
    for _ in range(PROBE_EVERY):
        tracker.record(0, 0)
    assert tracker.wants_probe
    # a stretch of drafting that the plan ends is no failed probe
    tracker.record(1, 1)
    tracker.record(1, 1)
    tracker.record(0, 0)
    assert tracker.probe_every == PROBE_EVERY


def test_no_probe_when_the_load_alone_keeps_k_at_zero():
    profile = cpu_like_profile()
    tracker = AcceptanceTracker()
    for _ in range(3 * PROBE_EVERY):
        assert _next_k(profile, tracker, 64, 4) == 0
        tracker.record(0, 0)


def test_fixed_threshold_fallback():
    assert load_adjusted_k(3, 4, 4) == 3 and load_adjusted_k(3, 5, 4) == 0 and load_adjusted_k(3, 99, None) == 3


def test_measured_costs_have_the_profile_shape():
    runner = ModelRunner(make_tiny_model("llama"))
    verify = measure_verify(runner, max_k=2, batch_sizes=(1, 2, 4), reps=1)
    steps = measure_draft_step(runner, batch_sizes=(1, 2, 4), reps=1)
    assert len(verify) == 3 and all(len(row) == 3 for row in verify) and len(steps) == 3
    assert all(t > 0 for row in verify for t in row) and all(t > 0 for t in steps)
    assert runner.num_live == 0, "calibration sequences are released"
    profile = profile_from((1, 2, 4), verify, steps)
    assert profile.max_k == 2


def test_a_timing_inflated_by_other_work_gives_way_to_a_bigger_pass():
    measured = [[0.244, 0.046, 0.060], [0.044, 0.051, 0.066], [0.049, 2.1, 0.115]]
    assert monotone(measured) == [[0.044, 0.046, 0.060], [0.044, 0.051, 0.066], [0.049, 0.115, 0.115]]
    profile = profile_from((1, 2, 4), measured, [0.030, 0.027, 0.038])
    assert profile.draft_step_seconds == (0.027, 0.027, 0.038)


def test_observed_round_costs_correct_a_profile_that_was_measured_too_slow():
    measured = cpu_like_profile().scaled(draft=3.0, verify=1.0)  # the draft was timed on a busy machine
    assert planned_k(measured, 1, 0.9, 4) == 0
    correction = CostCorrection()
    true = cpu_like_profile()
    for _ in range(4):  # a few probing rounds report what one K=1 draft and its verify really took
        correction.observe_draft(measured, 1, 1, true.draft(1, 1))
        correction.observe_verify(measured, 1, 1, true.verify(1, 1))
    assert correction.draft == pytest.approx(1 / 3) and correction.verify == pytest.approx(1.0)
    assert planned_k(correction.apply(measured), 1, 0.9, 4) == planned_k(true, 1, 0.9, 4) > 0


def test_plain_and_drafting_passes_are_corrected_apart_once_both_are_seen():
    """At long contexts a verify pass over drafts costs more against a decode step than the start-up profile
    (short contexts) says: each kind of pass gets its own ratio, and drafting stops where it no longer pays."""
    base = cpu_like_profile()
    profile = CostProfile(base.batch_sizes, base.verify_seconds, (0.0,) * 5)  # n-gram drafts: no draft model
    batch, acceptance = 1, 0.5
    assert planned_k(profile, batch, acceptance, 4) > 0
    correction = CostCorrection()
    correction.observe_verify(profile, batch, 1, 2.5 * profile.verify(batch, 1))
    assert correction.verify == correction.verify_wide == pytest.approx(2.5)  # one kind seen: it stands for both
    assert planned_k(correction.apply(profile), batch, acceptance, 4) > 0  # everything dearer alike: still drafts
    for _ in range(20):
        correction.observe_verify(profile, batch, 0, 1.0 * profile.verify(batch, 0))
        correction.observe_verify(profile, batch, 1, 2.5 * profile.verify(batch, 1))
    assert correction.verify == pytest.approx(1.0) and correction.verify_wide == pytest.approx(2.5)
    corrected = correction.apply(profile)
    assert corrected.verify(batch, 0) == pytest.approx(profile.verify(batch, 0))
    assert corrected.verify(batch, 2) == pytest.approx(2.5 * profile.verify(batch, 2))
    assert planned_k(corrected, batch, acceptance, 4) == 0
    cheap = CostCorrection()  # wide passes observed cheaper than plain ones never cost less than a plain pass
    cheap.observe_verify(profile, batch, 0, 2.0 * profile.verify(batch, 0))
    cheap.observe_verify(profile, batch, 1, 0.1 * profile.verify(batch, 1))
    assert cheap.apply(profile).verify(batch, 1) >= cheap.apply(profile).verify(batch, 0)


def test_a_request_starts_drafting_only_if_the_rest_of_it_repays_the_draft_prefill():
    base = cpu_like_profile()
    profile = CostProfile(base.batch_sizes, base.verify_seconds, base.draft_step_seconds,
                          draft_prefill_seconds_per_token=0.002)
    k = planned_k(profile, 1, 0.9, 4)
    assert k > 0
    assert worth_starting(profile, 1, 0.9, k, context=100, remaining=500)
    assert not worth_starting(profile, 1, 0.9, k, context=100, remaining=3)
    assert not worth_starting(profile, 1, 0.9, 0, context=1, remaining=500)
    assert worth_starting(base, 1, 0.9, k, context=10_000, remaining=2), "no prefill cost: nothing to repay"


def test_round_overhead_counts_against_plain_decoding_too():
    base = cpu_like_profile()
    correction = CostCorrection()
    for _ in range(3):
        correction.observe_overhead(0.030)
    assert correction.overhead == pytest.approx(0.030)
    corrected = correction.apply(base)
    assert corrected.round_seconds(1, 0) == pytest.approx(base.round_seconds(1, 0) + 0.030)
    # a fixed cost per round favours fewer, longer rounds: speculation pays at a lower acceptance
    lowest = lambda p: min(a / 100 for a in range(1, 100) if planned_k(p, 1, a / 100, 4) > 0)  # noqa: E731
    assert lowest(corrected) < lowest(base)


def test_what_a_drafting_round_spends_outside_the_workers_counts_against_drafting():
    """n-gram drafts cost the models nothing, but the router's lookups and the extra hops do: a round that drafts
    is priced with the overhead drafting rounds were seen to have over plain ones."""
    base = cpu_like_profile()
    profile = CostProfile(base.batch_sizes, base.verify_seconds, (0.0,) * 5)  # n-gram drafts
    correction = CostCorrection()
    correction.observe_overhead(0.002, drafted=True)
    assert correction.overhead == pytest.approx(0.002) and correction.draft_overhead == 0.0  # one kind: no difference
    for _ in range(20):
        correction.observe_overhead(0.001)
        correction.observe_overhead(0.021, drafted=True)
    assert correction.overhead == pytest.approx(0.001, abs=1e-4)
    assert correction.draft_overhead == pytest.approx(0.020, abs=1e-3)
    corrected = correction.apply(profile)
    assert corrected.round_seconds(1, 0) == pytest.approx(profile.verify(1, 0) + correction.overhead)
    assert corrected.round_seconds(1, 2) == pytest.approx(profile.verify(1, 2) + correction.overhead
                                                          + correction.draft_overhead)
    assert corrected.round_seconds(4, 2, drafting=0) == pytest.approx(profile.verify(4, 2) + correction.overhead)
    assert planned_k(correction.apply(profile), 1, 0.2, 4) == 0 < planned_k(profile, 1, 0.2, 4)



def test_plain_rounds_decoded_ahead_cost_less_than_their_verify_and_the_plan_weighs_drafting_against_that():
    """Where the target decodes plain rows ahead, a plain round's step computes while the router delivers the one
    before: its overhead is a credit (below zero). The round before settles whether a plain round is one: for rows
    it marked ahead, plain decoding is priced at the credit (drafting would drop the step computed), so a drafter
    that pays against the verify pass may not; for the others a plain round is computed when asked."""
    base = cpu_like_profile()
    correction = CostCorrection()
    for _ in range(20):
        correction.observe_overhead(0.004)  # plain rounds computed when asked
        correction.observe_overhead(0.002, drafted=True)
    assert correction.overhead == pytest.approx(0.004, abs=1e-4) and not correction.seen_ahead
    assert correction.plain_overhead(ahead=True) == correction.overhead  # none decoded ahead seen yet
    assert correction.draft_overhead == 0.0  # drafting rounds are no dearer than plain ones computed when asked
    for _ in range(20):
        correction.observe_overhead(-0.030, ahead=True)  # 30 ms of each 40 ms step hidden
    assert correction.seen_ahead and correction.overhead == pytest.approx(0.004, abs=1e-4)
    assert correction.plain_overhead(ahead=True) == pytest.approx(-0.030, abs=1e-3)
    assert correction.draft_overhead_over(ahead=True) == pytest.approx(0.032, abs=1e-3)  # what drafting gives up
    marked = correction.apply(base, ahead=True)
    assert marked.round_seconds(1, 0) == pytest.approx(base.verify(1, 0) - 0.030, abs=1e-3)
    assert marked.round_seconds(1, 2) == pytest.approx(base.round_seconds(1, 2) + 0.002, abs=1e-3)
    assert planned_k(marked, 1, 0.6, 4) == 0 < planned_k(correction.apply(base), 1, 0.6, 4)
    # a credit never makes a round free: at least MIN_ROUND_SHARE of its verify pass
    deep = CostCorrection()
    deep.observe_overhead(-1.0, ahead=True)
    assert deep.apply(base, ahead=True).round_seconds(1, 0) == pytest.approx(MIN_ROUND_SHARE * base.verify(1, 0))

def test_a_round_costs_drafts_only_for_the_rows_that_draft():
    profile = CostProfile(batch_sizes=(1, 4), verify_seconds=((0.010, 0.012), (0.020, 0.024)),
                          draft_step_seconds=(0.003, 0.006), round_overhead_seconds=0.001)
    assert profile.round_seconds(4, 1) == pytest.approx(0.006 + 0.024 + 0.001)  # all four draft
    assert profile.round_seconds(4, 1, drafting=1) == pytest.approx(0.003 + 0.024 + 0.001)
    assert profile.round_seconds(4, 1, drafting=0) == pytest.approx(0.024 + 0.001)  # verify only
    assert profile.round_seconds(4, 0) == pytest.approx(0.020 + 0.001)


# ---- start-up measurement within the runner's capacity (engine/calibration/measure.py)
# -----------------------------------
def _static_runner(max_num_seqs: int):
    import torch

    from engine.models.static.runner import KVBudget, StaticRunner

    return StaticRunner(make_tiny_model("llama"), budget=KVBudget(gib=1.0, max_num_seqs=max_num_seqs), compile=False,
                        dtype=torch.float32)


@pytest.mark.parametrize("slots, sizes", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (32, [1, 2, 4, 8, 16])])
def test_costs_are_measured_at_the_batch_sizes_the_runner_holds(slots, sizes):
    from engine.calibration.measure import measure_draft_costs, measure_target_costs

    runner = _static_runner(slots)
    assert runner.capacity == slots
    target = measure_target_costs(runner, max_k=2, reps=1)
    draft = measure_draft_costs(runner, reps=1)
    assert target["batch_sizes"] == sizes == draft["batch_sizes"]
    assert len(target["verify_seconds"]) == len(sizes) and all(len(row) == 3 for row in target["verify_seconds"])
    assert len(draft["draft_step_seconds"]) == len(sizes) and draft["draft_prefill_seconds_per_token"] > 0
    assert runner.num_live == 0, "calibration sequences are released"


def test_a_measurement_past_the_free_slots_is_refused_before_it_adds_a_sequence():
    from engine.calibration.measure import measurable_batch_sizes, measure_prefill
    from engine.models.runner import KVCacheFull

    runner = _static_runner(2)
    with pytest.raises(KVCacheFull, match="2 free KV-cache slot"):
        measure_verify(runner, max_k=1, batch_sizes=(1, 2, 4), reps=1)
    assert runner.num_live == 0
    runner.add("live")
    assert measurable_batch_sizes(runner) == [1], "a live sequence's slot is not measured with"
    runner.add("live-2")
    with pytest.raises(KVCacheFull, match="raise runner.max_num_seqs"):
        measure_prefill(runner, reps=1)
    assert ModelRunner(make_tiny_model("llama")).capacity is None
    assert measurable_batch_sizes(ModelRunner(make_tiny_model("llama"))) == [1, 2, 4, 8, 16], "a growing cache"


def linear_costs(sizes, max_k: int = 3) -> dict:
    """Measured-like costs that are exactly linear in the batch: a fixed part plus a part per token computed."""
    return {"batch_sizes": list(sizes),
            "verify_seconds": [[0.010 + 0.0008 * b * (w + 1) for w in range(max_k + 1)] for b in sizes],
            "draft_step_seconds": [0.003 + 0.0004 * b for b in sizes], "draft_prefill_seconds_per_token": 1e-4}


def test_a_profile_of_few_batch_sizes_extrapolates_to_the_ks_a_full_one_picks():
    from engine.calibration.measure import profile_from_costs

    full = profile_from_costs(linear_costs((1, 2, 4, 8, 16)), linear_costs((1, 2, 4, 8, 16)))
    two = profile_from_costs(linear_costs((1, 2)), linear_costs((1, 2)))
    assert two.batch_sizes == (1, 2)
    for a in (0.5, 0.8, 0.95):
        full_ks = [planned_k(full, b, a, 3) for b in range(1, 33)]
        assert [planned_k(two, b, a, 3) for b in range(1, 33)] == full_ks
        assert full_ks[0] > 0 and full_ks[-1] == 0, "drafting pays at one row, not at 32 (the profile is sensible)"
    assert two.verify(8, 2) == pytest.approx(full.verify(8, 2))
    one = profile_from_costs(linear_costs((1,)), linear_costs((1,)))  # a runner of one slot
    assert one.verify(4, 0) == pytest.approx(4 * one.verify(1, 0)), "one point: taken per row"
    assert planned_k(one, 1, 0.8, 3) > 0
    assert {planned_k(one, b, 0.8, 3) for b in range(1, 17)} == {planned_k(one, 1, 0.8, 3)}, \
        "costs per row alike at every batch: the same plan at every batch"


def test_extrapolation_never_makes_a_bigger_batch_cheaper():
    profile = CostProfile((1, 2), ((0.020, 0.030), (0.012, 0.018)), (0.004, 0.002))  # not monotone (hand-edited)
    assert profile.verify(16, 0) == pytest.approx(0.012) and profile.draft(16, 1) == pytest.approx(0.002)
    assert planned_k(profile, 64, 0.8, 1) in (0, 1)


def test_draft_and_target_measured_at_different_sizes_combine_at_the_targets():
    from engine.calibration.measure import profile_from_costs

    target, draft = linear_costs((1, 2, 4, 8, 16)), linear_costs((1, 2))  # the draft's KV cache holds two
    profile = profile_from_costs(target, draft)
    assert profile.batch_sizes == (1, 2, 4, 8, 16)
    assert profile.draft_step_seconds == pytest.approx(tuple(0.003 + 0.0004 * b for b in (1, 2, 4, 8, 16)))
    assert profile.draft_prefill_seconds_per_token == 1e-4
    small_target = profile_from_costs(linear_costs((1, 2)), linear_costs((1, 2, 4, 8, 16)))
    assert small_target.batch_sizes == (1, 2) and small_target.draft_step_seconds == pytest.approx((0.0034, 0.0038))


def test_costs_measured_on_two_slots_give_a_policy_for_bigger_batches():
    from engine.calibration.measure import measure_draft_costs, measure_target_costs, profile_from_costs

    target = measure_target_costs(_static_runner(2), max_k=2, reps=1)
    draft = measure_draft_costs(_static_runner(1), reps=1)
    profile = profile_from_costs(target, draft)
    assert profile.batch_sizes == (1, 2)
    for batch in (3, 8, 16):
        assert profile.verify(batch, 2) >= profile.verify(2, 2) > 0 and profile.draft(batch, 1) >= profile.draft(1, 1)
        assert 0 <= planned_k(profile, batch, 0.8, 2) <= 2


def test_cost_measurement_waits_for_cuda_work_before_stopping_the_clock(monkeypatch):
    """A CUDA forward returns once its kernels are queued: the measurement synchronizes the logits' device."""
    from types import SimpleNamespace

    import torch

    import engine.calibration.measure as calibrate

    synced = []
    monkeypatch.setattr(calibrate.torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda_logits = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    calibrate.finished(cuda_logits)
    calibrate.finished(torch.zeros(1))  # CPU: computed when forward returns, nothing to wait for
    assert synced == [cuda_logits.device]


def test_a_target_drafters_tree_drafting_is_measured_beside_its_chain_and_reaches_the_profile():
    """With trees on, the target measures its drafter's tree rounds too (an EAGLE-3 head's expansion costs more
    than its chain); the profile the round plan reads carries them, and verify widths up to the tree's nodes."""
    from engine.calibration.measure import measure_target_costs, profile_from_costs
    from engine.proposers.eagle3 import Eagle3Drafter
    from tests.engine.proposers.test_eagle3 import LAYERS, random_head

    model = make_tiny_model("llama", seed=0, layers=LAYERS)
    from engine.models.static.runner import KVBudget, StaticRunner
    runner = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=2), compile=False)
    costs = measure_target_costs(runner, max_k=2, reps=1, drafter=Eagle3Drafter(random_head(model), runner),
                                 widest=6, tree_nodes=6)
    assert len(costs["verify_seconds"][0]) == 7, "verify widths 1..7: the tree's nodes and its root"
    drafter = costs["drafter"]
    assert len(drafter["tree_draft_seconds"]) == len(drafter["batch_sizes"])
    assert all(t > 0 for t in drafter["tree_draft_seconds"])
    profile = profile_from_costs(costs, drafter)
    assert profile.tree_draft_seconds is not None and profile.tree_draft(1, 2) >= profile.draft(1, 2)
