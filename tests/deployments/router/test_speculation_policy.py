"""Overlapped drafting and adaptive K in the router's rounds, on tiny models without a cluster."""

import asyncio
import dataclasses

import pytest
import torch

from deployments.router.round_costs import PLAIN_SAMPLE_FIRST, PLAIN_SAMPLE_ROUNDS
from deployments.router.router import Router
from engine import SamplingParams
from engine.spec.options import SpeculationOptions
from engine.spec.policy import PROBE_EVERY
from tests.conftest import make_tiny_model, perturbed_copy, third_token_marginals, total_variation_bound
from tests.deployments.conftest import LocalBroker, save_model_pair, tiny_config, write_profile
from tests.deployments.router.test_router import plain_reference

PROMPTS = [[5, 6, 7, 8], [9, 8, 7, 6, 5], [20, 21, 22, 20, 21], [30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def unrelated_draft_dirs(tmp_path_factory):
    """A draft that shares the tokenizer but not the weights: it almost never agrees with the target."""
    return save_model_pair(tmp_path_factory.mktemp("unrelated"), make_tiny_model("llama", seed=0),
                     make_tiny_model("llama", seed=99))


def router_for(dirs, **speculation) -> tuple[Router, LocalBroker]:
    config = tiny_config(dirs, speculation=speculation)
    broker = LocalBroker(config)
    return Router(config, broker), broker


async def generate(router, prompt, params, k=None, adaptive=None, overlap=None) -> list[int]:
    tokens = []
    async for out in router.scheduler.generate(prompt, params, SpeculationOptions(k, adaptive, overlap)):
        tokens.extend(out.new_token_ids)
    return tokens


def text(router, tokens) -> str:
    return router.tokenizer.decode(tokens, skip_special_tokens=True)


def run_all(router, prompts, params, k=None, limit=48):
    async def go():
        gate = asyncio.Semaphore(limit)

        async def one(prompt, p):
            async with gate:
                return await generate(router, prompt, p, k)

        return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))

    return asyncio.run(go())


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_overlap_keeps_greedy_output_and_uses_drafts_made_ahead(tiny_model_dirs):
    router, broker = router_for(tiny_model_dirs, overlap=True)
    outputs = run_all(router, PROMPTS, [GREEDY] * len(PROMPTS))
    for prompt, tokens in zip(PROMPTS, outputs):
        assert text(router, tokens) == plain_reference(tiny_model_dirs, prompt, 24)
    st = router.scheduler.stats
    assert st.ahead_drafts > 0 and 0 < st.ahead_used <= st.ahead_drafts
    assert broker.cores["draft"].proposer.runner.num_live == 0, "caches freed, ahead drafts included"


def test_overlap_cancels_ahead_drafts_no_row_can_use(unrelated_draft_dirs):
    router, broker = router_for(unrelated_draft_dirs, overlap=True)
    [tokens] = run_all(router, [PROMPTS[0]], [GREEDY])
    assert text(router, tokens) == plain_reference(unrelated_draft_dirs, PROMPTS[0], 24)
    st = router.scheduler.stats
    assert broker.cancels > 0 and st.ahead_cancelled > 0
    assert broker.cores["draft"].cancelled_drafts == st.ahead_cancelled


@pytest.mark.parametrize("seeded", [True, False], ids=["gumbel", "rejection"])
def test_overlap_keeps_the_target_distribution_when_sampling(tmp_path, seeded):
    """The 3rd token is verified against a draft made ahead whenever round 1's guess came true: its marginal
    must still be the target's exact one (same check as the engine's losslessness test)."""
    vocab = 8
    target = make_tiny_model("llama", vocab=vocab, seed=3)
    draft = perturbed_copy(target, 0.08, seed=4)
    dirs = save_model_pair(tmp_path, target, draft)
    # top-k 2 makes the draft's guess of the bonus token right often, so many 3rd tokens take the ahead path
    exact, draft_marginal = third_token_marginals(target, draft, [2, 3, 4], vocab, top_k=2)
    router, _ = router_for(dirs, overlap=True, num_speculative_tokens=1, max_batch_for_speculation=64)
    n = 3000
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True, seed=i if seeded else None)
              for i in range(n)]
    outputs = run_all(router, [[2, 3, 4]] * n, params)
    got = torch.bincount(torch.tensor([t[2] for t in outputs]), minlength=vocab).float() / n
    bound = total_variation_bound(vocab, n)
    assert 0.5 * (got - exact).abs().sum() < bound
    assert 0.5 * (draft_marginal - exact).abs().sum() > 2 * bound, "the draft differs enough to be detectable"
    st = router.scheduler.stats
    assert st.ahead_used > n // 4, "a good share of 3rd tokens came from drafts made ahead"


@pytest.mark.parametrize("seeded", [True, False], ids=["gumbel", "rejection"])
def test_chained_rounds_keep_the_target_distribution_when_sampling(tmp_path, seeded):
    """Sampled rows' drafts and compact proposals go from the draft worker straight to the target worker, which
    samples (a chained round): the 3rd token's marginal must be the target's exact one."""
    vocab = 8
    target = make_tiny_model("llama", vocab=vocab, seed=3)
    draft = perturbed_copy(target, 0.08, seed=4)
    dirs = save_model_pair(tmp_path, target, draft)
    exact, draft_marginal = third_token_marginals(target, draft, [2, 3, 4], vocab, top_k=0)
    router, broker = router_for(dirs, num_speculative_tokens=2, max_batch_for_speculation=64)
    n = 3000
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i if seeded else None)
              for i in range(n)]
    outputs = run_all(router, [[2, 3, 4]] * n, params)
    got = torch.bincount(torch.tensor([t[2] for t in outputs]), minlength=vocab).float() / n
    bound = total_variation_bound(vocab, n)
    assert 0.5 * (got - exact).abs().sum() < bound
    assert 0.5 * (draft_marginal - exact).abs().sum() > 2 * bound, "the draft differs enough to be detectable"
    assert router.scheduler.stats.chained_rounds == broker.chained > 0, "the rounds were chained"


def test_adaptive_k_switches_off_under_load_and_back_on(tiny_model_dirs, tmp_path):
    router, _ = router_for(tiny_model_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 2))
    busy = run_all(router, PROMPTS, [GREEDY] * 4)  # 4 live sequences > knee: plain rounds while all four live
    drafted_busy = router.scheduler.stats.spec.num_drafts
    quiet = run_all(router, PROMPTS[:2], [GREEDY] * 2)
    for prompt, tokens in zip(PROMPTS, busy):
        assert text(router, tokens) == plain_reference(tiny_model_dirs, prompt, 24)
    assert busy[:2] == quiet
    assert drafted_busy == 0
    assert router.scheduler.stats.spec.num_drafts > 0


def test_adaptive_k_drops_a_failing_request_to_zero_and_probes(unrelated_draft_dirs, tmp_path):
    router, broker = router_for(unrelated_draft_dirs, adaptive=True,
                                calibration=write_profile(tmp_path / "c.json", 8))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    [tokens] = run_all(router, [PROMPTS[1]], [params])
    assert text(router, tokens) == plain_reference(unrelated_draft_dirs, PROMPTS[1], 100)
    spec = router.scheduler.stats.spec
    assert spec.acceptance_rate < 0.3
    # after a few failing rounds it drafts only to probe: about one round in PROBE_EVERY + 1
    assert spec.num_drafts <= 6 + spec.rounds // PROBE_EVERY, spec.as_dict()
    assert spec.rounds > 60


def test_adaptive_k_uses_costs_the_replicas_measured(tiny_model_dirs):
    router, broker = router_for(tiny_model_dirs, adaptive=True)
    assert broker.cores["target"].costs["verify_seconds"] and broker.cores["draft"].costs["draft_step_seconds"]
    [tokens] = run_all(router, [PROMPTS[0]], [GREEDY])
    assert text(router, tokens) == plain_reference(tiny_model_dirs, PROMPTS[0], 24)
    [(pair, shown)] = router.scheduler.cost_profiles().items()
    assert pair == "draft-0 / target-0" and shown["batch_sizes"] == [1, 2, 4, 8, 16]
    assert len(shown["verify_ms"]) == 5 and all(t > 0 for t in shown["draft_step_ms"])
    assert set(shown["bf16_products"]) == {"target", "draft"}  # which operator computes bf16 products, each side


def test_a_calibration_file_that_is_not_a_profile_is_refused(tiny_model_dirs, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a readable cost profile"):
        tiny_config(tiny_model_dirs, speculation={"calibration": str(bad)})


def test_a_request_can_pin_its_k_past_the_policy(tiny_model_dirs, tmp_path):
    router, _ = router_for(tiny_model_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 1))

    async def go():
        pinned = generate(router, PROMPTS[0], GREEDY, k=2, adaptive=False)
        others = [generate(router, p, GREEDY) for p in PROMPTS[1:3]]
        return await asyncio.gather(pinned, *others)

    outputs = asyncio.run(go())
    for prompt, tokens in zip(PROMPTS, outputs):
        assert text(router, tokens) == plain_reference(tiny_model_dirs, prompt, 24)
    spec = router.scheduler.stats.spec
    assert spec.num_drafts > 0 and spec.num_draft_tokens == 2 * spec.num_drafts, "only the pinned request drafted"


def test_a_request_can_turn_overlap_off(tiny_model_dirs):
    router, _ = router_for(tiny_model_dirs, overlap=True)

    async def go():
        return await generate(router, PROMPTS[0], GREEDY, overlap=False)

    tokens = asyncio.run(go())
    assert text(router, tokens) == plain_reference(tiny_model_dirs, PROMPTS[0], 24)
    assert router.scheduler.stats.ahead_drafts == 0


def test_a_new_request_starts_from_the_acceptance_its_predecessors_saw(unrelated_draft_dirs, tmp_path):
    router, _ = router_for(unrelated_draft_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 8))
    assert router.scheduler.population.acceptance == pytest.approx(0.7)
    run_all(router, [PROMPTS[1]], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)])
    assert router.scheduler.population.acceptance < 0.3


def test_a_request_far_behind_resumes_drafting_only_if_the_rest_repays_the_catch_up(tiny_model_dirs, tmp_path):
    from types import SimpleNamespace

    from deployments.router.live import LiveRequest
    from engine.request.sequence import SequenceState
    from engine.spec.policy import AcceptanceTracker

    # 1 s per 100 tokens of draft prefill; drafting saves about 4.3 ms per token at one row and the prior acceptance
    router, _ = router_for(tiny_model_dirs, adaptive=True,
                           calibration=write_profile(tmp_path / "c.json", 8, prefill_per_token=0.01))
    lease = SimpleNamespace(key="x", costs=None)

    def row(max_tokens, generated, draft_sent, tracker=None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seq = SequenceState.create("r", [5, 6, 7, 8], params, 3, 512, frozenset(), router.tokenizer)
        seq.commit([9] * generated, 0, 0)
        return LiveRequest(seq=seq, queue=None, target=lease, draft=lease, draft_sent=draft_sent,
                     tracker=tracker or AcceptanceTracker())

    ks = router.scheduler._ks
    assert ks([row(200, 40, 44)]) == [3], "in step with its draft: drafts"
    assert ks([row(200, 40, 4)]) == [3], "40 tokens to catch up, 160 left to repay them"
    assert ks([row(50, 40, 4)]) == [0], "40 tokens to catch up, 10 left: not worth it"
    failing = AcceptanceTracker(prior=0.01)
    failing.rounds_without_drafts = PROBE_EVERY
    assert ks([row(50, 40, 4, failing)]) == [0], "a probe would stall 0.4 s for at most 10 tokens"
    assert ks([row(400, 40, 4, failing)]) == [1], "with 360 tokens left, a probe is worth its catch-up"


def test_k_is_chosen_for_the_batch_that_requests_waiting_for_leases_are_about_to_make(tiny_model_dirs, tmp_path):
    from types import SimpleNamespace

    from deployments.router.live import LiveRequest
    from engine.request.sequence import SequenceState

    router, _ = router_for(tiny_model_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 2))
    lease = SimpleNamespace(key="x", costs=None)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    seq = SequenceState.create("r", [5, 6, 7, 8], params, 3, 512, frozenset(), router.tokenizer)
    row = LiveRequest(seq=seq, queue=None, target=lease, draft=lease)
    assert router.scheduler._ks([row]) == [3], "alone: drafting pays"
    router.scheduler.admission.waiting = 3  # admitted, taking leases: next round has 4 rows, past the knee (2)
    assert router.scheduler._ks([row]) == [0]


def test_a_request_the_plan_never_gives_drafts_never_holds_a_draft_lease(tiny_model_dirs, tmp_path):
    # drafting never pays in this profile (verifying extra tokens is ruinous at every batch size)
    router, broker = router_for(tiny_model_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 0))
    outputs = run_all(router, PROMPTS, [GREEDY] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outputs):
        assert text(router, out) == plain_reference(tiny_model_dirs, prompt, 24)
    assert broker.leases_taken == {"draft": 0, "target": len(PROMPTS)}
    assert router.scheduler.stats.spec.num_draft_tokens == 0


def test_a_drafting_request_takes_its_draft_lease_at_its_first_drafting_round(tiny_model_dirs, tmp_path):
    router, broker = router_for(tiny_model_dirs, adaptive=True, calibration=write_profile(tmp_path / "c.json", 8))
    tokens = asyncio.run(generate(router, PROMPTS[0], GREEDY))
    assert text(router, tokens) == plain_reference(tiny_model_dirs, PROMPTS[0], 24)
    assert broker.leases_taken["draft"] == 1 and router.scheduler.stats.spec.num_draft_tokens > 0
    assert broker.open_leases == {"draft": 0, "target": 0}, "both closed at the end"


def test_without_a_draft_lease_a_request_decodes_plainly_then_tries_again(tiny_model_dirs, monkeypatch):
    from deployments.router import recovery

    monkeypatch.setattr(recovery, "DRAFT_LEASE_RETRY_S", 0.0)
    router, broker = router_for(tiny_model_dirs)  # fixed K: every round wants drafts
    broker.refuse_draft_leases = 2
    tokens = asyncio.run(generate(router, PROMPTS[1], GREEDY))
    assert text(router, tokens) == plain_reference(tiny_model_dirs, PROMPTS[1], 24)
    assert broker.leases_taken["draft"] == 1, "the third try got one"
    stats = router.scheduler.stats.spec
    assert stats.num_draft_tokens > 0 and stats.rounds > stats.num_drafts, "plain rounds first, then drafts"


SEEDED = [SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=500 + i, ignore_eos=True) for i in range(8)]


def plain_seeded(dirs, prompts, params) -> list[list[int]]:
    """The in-process engine's plain decoding (K = 0) with each request's seed: what any served round must give."""
    from engine.factory import build_engine

    engine = build_engine(tiny_config(dirs).engine_config())
    return [c.token_ids for c in engine.generate(prompts, params, k=0)]


@pytest.mark.parametrize("draft", ["perturbed", "unrelated"])
def test_a_seeded_request_gives_the_same_served_text_for_any_k_batch_policy_overlap_and_draft_failure(
        tiny_model_dirs, unrelated_draft_dirs, tmp_path, draft):
    """Drafter invariance through the served round (in-process leases, the real worker cores): the target samples
    by Gumbel coupling at its device, so a seed's text is plain decoding's, chained or not, with drafts made ahead
    or not, K pinned or adaptive, alone or in a batch of 8, and after the Draft worker dies mid-request."""
    dirs = tiny_model_dirs if draft == "perturbed" else unrelated_draft_dirs
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    reference = plain_seeded(dirs, prompts, SEEDED)
    profile = write_profile(tmp_path / "c.json", 8)
    for overlap in (False, True):  # a server that drafts ahead makes no chained rounds: one router each
        router, broker = router_for(dirs, adaptive=True, calibration=profile, num_speculative_tokens=3,
                                    overlap=overlap)
        for k in (0, 1, 3):
            got = asyncio.run(generate(router, prompts[0], SEEDED[0], k=k, adaptive=False))
            assert got == reference[0], f"K = {k}, overlap {overlap}"
        assert asyncio.run(generate(router, prompts[0], SEEDED[0], k=3, adaptive=True)) == reference[0], "adaptive"

        async def batch(adaptive):
            return await asyncio.gather(*(generate(router, pr, p, k=3, adaptive=adaptive)
                                          for pr, p in zip(prompts, SEEDED)))

        assert asyncio.run(batch(False)) == reference, f"batch 8, overlap {overlap}"
        assert asyncio.run(batch(True)) == reference, f"batch 8, adaptive K, overlap {overlap}"
        stats = router.scheduler.stats
        assert stats.spec.num_drafts > 0 and (stats.ahead_drafts > 0 if overlap else stats.chained_rounds > 0)
    broker.fail_at_call["draft"] = broker.calls["draft"] + 3  # the Draft worker dies mid-request
    assert asyncio.run(generate(router, prompts[0], SEEDED[0], k=3, adaptive=False)) == reference[0]
    assert broker.keys["draft"] != "draft-0", "the Draft replica was replaced mid-request"


def test_rounds_the_load_leaves_plain_decode_ahead_and_drafting_resumes_exactly(tiny_model_dirs):
    """Above `max_batch_for_speculation` live requests the rounds draft nothing: the target decodes their rows'
    next tokens ahead (as for requests that never draft), and once the load falls the last request drafts again;
    every text stays plain decoding's."""
    router, broker = router_for(tiny_model_dirs, max_batch_for_speculation=1)
    lengths = [40, 12, 12, 12]
    outputs = run_all(router, PROMPTS, [dataclasses.replace(GREEDY, max_tokens=n) for n in lengths])
    for prompt, tokens, n in zip(PROMPTS, outputs, lengths):
        assert text(router, tokens) == plain_reference(tiny_model_dirs, prompt, n)
    ahead = broker.cores["target"].ahead.stats
    assert ahead.used > 0, "plain rounds were answered from steps decoded ahead"
    assert router.scheduler.stats.spec.num_draft_tokens > 0, "the last request drafted once alone"


def test_a_request_that_drafts_every_round_samples_plain_rounds_decoded_ahead(tiny_model_dirs):
    """With costs where drafting always pays, a request's rounds all draft; after PLAIN_SAMPLE_FIRST of them the
    router runs PLAIN_SAMPLE_ROUNDS plain rounds (deployments/router/round_costs.py), those after the first answered
    from steps decoded ahead, so the plan learns what a plain round really costs here; the text stays plain
    decoding's."""
    from engine.spec.policy import CostProfile

    router, broker = router_for(tiny_model_dirs, adaptive=True, num_speculative_tokens=2)
    costs, rounds = router.scheduler.round.costs, router.scheduler.round
    cheap = CostProfile((1, 2), ((0.01, 0.0101, 0.0102),) * 2, (0.0001, 0.0001))  # wide verify and drafts ~free
    costs.policy_profile = lambda draft, target, ahead=False: cheap  # as planned, whatever rounds observe
    planned, plan = [], rounds.plan
    rounds.plan = lambda rows, joining, live_now: planned.append(plan(rows, joining, live_now)[0]) or [planned[-1]]
    params = dataclasses.replace(GREEDY, max_tokens=120)
    [tokens] = run_all(router, [PROMPTS[0]], [params])
    assert text(router, tokens) == plain_reference(tiny_model_dirs, PROMPTS[0], 120)
    first = planned.index(0)
    assert first == PLAIN_SAMPLE_FIRST
    assert planned[first:first + PLAIN_SAMPLE_ROUNDS + 1] == [0] * PLAIN_SAMPLE_ROUNDS + [2]
    ahead = broker.cores["target"].ahead.stats
    assert (ahead.used, ahead.dropped) == (PLAIN_SAMPLE_ROUNDS - 1, 0), "its later rounds ahead; none after it"
    assert any(correction.seen_ahead for correction in costs._corrections.values())
