"""A round's K for the batch as a whole (engine/spec/plan.py)."""

import pytest

from engine.spec.plan import TIE, RowOutlook, plan_round
from engine.spec.policy import CostProfile, expected_tokens
from tests.engine.spec.test_policy import cpu_like_profile


def best_k_alone(profile: CostProfile, acceptance: float, k_max: int) -> int:
    """The K in 0..k_max with the most expected tokens per second for one request alone (Leviathan et al.'s E over
    the round's cost), ties to the smaller K."""
    best_k, best_rate = 0, 1.0 / profile.round_seconds(1, 0)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / profile.round_seconds(1, k)
        if rate > best_rate * TIE:
            best_k, best_rate = k, rate
    return best_k


def test_a_row_alone_gets_the_k_a_single_request_would_choose():
    profile = cpu_like_profile()
    chosen = set()
    for acceptance in (0.05, 0.3, 0.6, 0.8, 0.95):
        for k_max in (1, 2, 4):
            k = best_k_alone(profile, acceptance, k_max)
            assert plan_round(profile, [RowOutlook(acceptance, k_max)]) == [k], (acceptance, k_max)
            chosen.add(k)
    assert {0, 1, 4} <= chosen, "the cases cover no drafts, a few and the bound"


def test_one_good_row_does_not_make_a_batch_wait_for_a_draft_call_that_pays_only_for_itself():
    # at 8 rows a verify of width 4 costs 25% more than plain, a draft step a little
    profile = CostProfile((1, 8), ((0.040, 0.041, 0.042, 0.043), (0.080, 0.090, 0.095, 0.100)), (0.004, 0.006))
    rows = [RowOutlook(0.95, 3)] + [RowOutlook(0.05, 3)] * 7
    alone = plan_round(profile, [RowOutlook(0.95, 3)], batch=8)  # the good row's own E against the round's cost
    assert alone == [3], "judged alone, the good row's drafts pay for its own round"
    assert plan_round(profile, rows) == [0] * 8, "but the eight rows would wait for them: nobody drafts"
    assert plan_round(profile, [RowOutlook(0.95, 3)] * 8) == [3] * 8, "when all agree, all draft"


def test_rows_that_agree_all_draft_when_drafting_is_nearly_free():
    flat = CostProfile((1, 8), ((0.01, 0.0101, 0.0102), (0.01, 0.0101, 0.0102)), (0.0001, 0.0002))
    assert plan_round(flat, [RowOutlook(0.8, 2)] * 8) == [2] * 8


def test_the_plan_picks_the_rows_whose_drafts_agree_best():
    # verify cost grows with width, drafts are cheap per row: a few good rows pay, bad ones do not
    sizes = (1, 4)
    verify = ((0.040, 0.044, 0.048, 0.052), (0.045, 0.050, 0.055, 0.060))
    profile = CostProfile(sizes, verify, (0.004, 0.008))
    rows = [RowOutlook(0.9, 3), RowOutlook(0.1, 3), RowOutlook(0.95, 3), RowOutlook(0.1, 3)]
    ks = plan_round(profile, rows)
    assert ks[0] > 0 and ks[2] > 0 and ks[1] == 0 and ks[3] == 0, ks


def test_a_row_far_behind_its_draft_joins_only_if_the_rest_of_it_repays_the_stall_for_everyone():
    from engine.spec.policy import worth_starting

    flat = CostProfile((1, 8), ((0.040, 0.041, 0.042, 0.043), (0.080, 0.081, 0.082, 0.083)), (0.004, 0.006),
                       draft_prefill_seconds_per_token=0.002)
    assert plan_round(flat, [RowOutlook(0.95, 3, behind=200, remaining=400)]) == [3], "400 tokens repay reading 200"
    assert plan_round(flat, [RowOutlook(0.95, 3, behind=200, remaining=10)]) == [0], "10 do not"
    # in a batch of 8 that drafts anyway, the same row's reading of its 200 tokens stalls all 8 rows
    late = RowOutlook(0.95, 3, behind=200, remaining=60)
    assert worth_starting(flat, 8, 0.95, 3, context=200, remaining=60), "for itself alone it would pay"
    ks = plan_round(flat, [RowOutlook(0.95, 3, behind=1)] * 7 + [late])
    assert ks == [3] * 7 + [0], ks


def test_probes_happen_where_they_are_cheap_and_never_on_a_busy_batch_that_drafts_nothing():
    profile = cpu_like_profile()
    prober = RowOutlook(0.05, 3, wants_probe=True)
    assert plan_round(profile, [prober]) == [1], "alone: a probe is one cheap draft step"
    assert plan_round(profile, [prober] + [RowOutlook(0.05, 3)] * 15) == [0] * 16, "16 rows wait for nobody"
    flat = CostProfile((1, 8), ((0.01, 0.0101, 0.0102, 0.0103),) * 2, (0.0001, 0.0002))
    ks = plan_round(flat, [RowOutlook(0.9, 3)] * 7 + [prober])
    assert ks[:7] == [3] * 7 and ks[7] == 1, "the round drafts anyway: the probe rides along"
    far_behind = RowOutlook(0.05, 3, behind=500, remaining=10, wants_probe=True)
    slow_prefill = CostProfile(flat.batch_sizes, flat.verify_seconds, flat.draft_step_seconds, 0.01)
    assert plan_round(slow_prefill, [RowOutlook(0.9, 3)] * 7 + [far_behind])[7] == 0, "no long catch-up on a hunch"


def test_pinned_rows_get_their_k_and_the_plan_accounts_for_their_draft_call():
    profile = cpu_like_profile()
    rows = [RowOutlook(0.05, 3, fixed=True)] + [RowOutlook(0.9, 3)] * 3
    ks = plan_round(profile, rows)
    assert ks[0] == 3
    assert plan_round(profile, [RowOutlook(0.05, 2, fixed=True)] * 16) == [2] * 16


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32])
def test_the_plan_is_never_expected_to_be_slower_than_plain_decoding(batch):
    from engine.spec.policy import expected_tokens

    profile = cpu_like_profile()
    rows = [RowOutlook(a, 4) for a in [0.2, 0.5, 0.7, 0.9, 0.95, 0.99, 0.6, 0.3] * 4][:batch]
    ks = plan_round(profile, rows)
    tokens = sum(expected_tokens(r.acceptance, k) for r, k in zip(rows, ks))
    drafting = sum(1 for k in ks if k)
    rate = tokens / profile.round_seconds(batch, max(ks), drafting=drafting)
    assert rate >= batch / profile.round_seconds(batch, 0)


def _tree_rows(acceptances, tree_acceptance=None, grammar=False):
    from engine.request.grammar import GrammarSpec
    from engine.request.sampling import SamplingParams
    from engine.request.sequence import SequenceState
    from engine.spec.plan import SpecRow
    from engine.spec.policy import AcceptanceTracker

    params = SamplingParams(grammar=GrammarSpec("regex", "a+") if grammar else None)
    rows = []
    for i, a in enumerate(acceptances):
        seq = SequenceState.create(f"r{i}", [1, 2, 3], params, 3, 256, frozenset(), None)
        row = SpecRow(seq, AcceptanceTracker(prior=a))
        if tree_acceptance is not None:
            row.tree_tracker = AcceptanceTracker(prior=tree_acceptance)
            row.tree_tracker.record(3, 3 if tree_acceptance > 0.5 else 0)
        rows.append(row)
    return rows


# verify passes over widths 1..16: nearly free at one row (memory-bound), steep at eight
TREE_PROFILE = CostProfile((1, 8), (tuple(0.010 + 0.0001 * w for w in range(16)),
                                    tuple(0.020 + 0.004 * w for w in range(16))), (0.001, 0.002))


def test_trees_are_planned_where_verifying_more_positions_is_nearly_free_and_chains_under_load():
    from engine.spec.plan import TreeSettings, plan_trees
    auto = TreeSettings("auto", 8)
    rows = _tree_rows([0.6])
    assert plan_trees(TREE_PROFILE, rows, [3], 1, auto) == [8], "one row: nine positions cost what four do"
    rows = _tree_rows([0.6] * 8)
    assert plan_trees(TREE_PROFILE, rows, [3] * 8, 8, auto) == [0] * 8, "eight rows: a wide verify costs too much"
    assert plan_trees(TREE_PROFILE, rows, [3] * 8, 8, TreeSettings("on", 5)) == [5] * 8
    assert plan_trees(TREE_PROFILE, rows, [3] * 8, 8, TreeSettings("off", 5)) == [0] * 8


def test_measured_tree_acceptance_decides_and_some_rows_never_take_trees():
    from engine.spec.plan import TreeSettings, plan_trees
    auto = TreeSettings("auto", 8)
    assert plan_trees(TREE_PROFILE, _tree_rows([0.6], tree_acceptance=0.2), [3], 1, auto) == [0], \
        "trees that were measured worse than the chain are not planned"
    assert plan_trees(TREE_PROFILE, _tree_rows([0.6], tree_acceptance=0.9), [3], 1, auto) == [8]
    assert plan_trees(TREE_PROFILE, _tree_rows([0.6], grammar=True), [3], 1, TreeSettings("on", 8)) == [0], \
        "a grammar's history differs per node: chains"
    assert plan_trees(TREE_PROFILE, _tree_rows([0.6, 0.6]), [0, 3], 2, TreeSettings("on", 8)) == [0, 8], \
        "a row that does not draft gets no tree"
    with pytest.raises(ValueError, match="tree_nodes"):
        TreeSettings("on", 16)


def test_a_tree_expansion_that_costs_more_than_it_gains_keeps_chains():
    import dataclasses

    from engine.spec.plan import TreeSettings, plan_trees
    auto = TreeSettings("auto", 8)
    rows = _tree_rows([0.6], tree_acceptance=0.9)
    assert plan_trees(TREE_PROFILE, rows, [3], 1, auto) == [8]
    slow = dataclasses.replace(TREE_PROFILE, tree_draft_seconds=(0.02, 0.03))  # drafting a tree costs a verify pass
    assert slow.tree_draft(1, 3) == 0.02 and TREE_PROFILE.tree_draft(1, 3) == TREE_PROFILE.draft(1, 3)
    assert plan_trees(slow, rows, [3], 1, auto) == [0]


def test_a_tree_holds_no_more_nodes_a_level_than_a_drafter_offers():
    from engine.spec.plan import TreeSettings, plan_trees
    from engine.spec.tree import TOP_CANDIDATES
    rows = _tree_rows([0.6, 0.6])
    assert plan_trees(TREE_PROFILE, rows, [1, 3], 2, TreeSettings("on", 15)) == [TOP_CANDIDATES, 3 * TOP_CANDIDATES]


def test_a_request_that_turned_trees_off_keeps_chains():
    from engine.spec.options import SpeculationOptions
    from engine.spec.plan import TreeSettings, plan_trees
    rows = _tree_rows([0.6, 0.6])
    rows[0].options = SpeculationOptions(tree=False)
    assert plan_trees(TREE_PROFILE, rows, [3, 3], 2, TreeSettings("on", 8)) == [0, 8]


def test_a_tree_takes_no_more_positions_than_the_context_window_has_left():
    from engine.spec.plan import TreeSettings, plan_trees
    rows = _tree_rows([0.6])
    rows[0].seq.max_model_len = rows[0].seq.num_tokens + 5
    assert plan_trees(TREE_PROFILE, rows, [3], 1, TreeSettings("on", 8)) == [5]


def test_a_row_whose_drafts_lag_a_round_starts_only_where_its_stretch_repays_the_empty_first_round():
    from engine.spec.plan import START_HORIZON

    profile = cpu_like_profile()
    # the lowest acceptance at which a row alone drafts (K = 1) once it drafts, and one that a start needs
    grid = [a / 200 for a in range(1, 200)]
    going_on = next(a for a in grid if plan_round(profile, [RowOutlook(a, 1)]) == [1])
    starting = next(a for a in grid if plan_round(profile, [RowOutlook(a, 1, starting=True)]) == [1])
    assert starting > going_on, (going_on, starting)
    # the start counts (H - 1) / H of the extra tokens: E(a, 1) - 1 = a, so it needs H / (H - 1) the acceptance
    assert starting == pytest.approx(going_on * START_HORIZON / (START_HORIZON - 1), abs=0.011), (going_on, starting)
    between = (going_on + starting) / 2
    assert plan_round(profile, [RowOutlook(between, 1)]) == [1], "a row that drafts goes on"
    assert plan_round(profile, [RowOutlook(between, 1, starting=True)]) == [0], "one that does not, does not start"
    assert plan_round(profile, [RowOutlook(0.99, 3, starting=True, remaining=1)]) == [0], "one token left: no start"
    assert RowOutlook(0.5, 3, starting=True, remaining=2).gain_share() == 0.5
    assert RowOutlook(0.5, 3, remaining=2).gain_share() == 1.0
