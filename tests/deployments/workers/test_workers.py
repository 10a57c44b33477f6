"""The model-worker cores of deployments/workers/draft.py directly, without Ray or a router: what a draft and a target
worker answer for a round's calls, on the tiny random-weight model pair.

Replies are read through `part(reply, name)`, which takes a reply's field by name from its wire tuple, so these
tests pin what a worker computes, not how its reply is spelled."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from deployments.transport.messages import DraftCall, DraftResult, VerifyCall, VerifyResult
from engine.request.delta import SeqDelta
from deployments.workers.draft import DraftWorkerCore
from deployments.workers.target import TargetWorkerCore
from engine.models.loading import load_causal_lm, resolve
from engine.request.delta import UnknownSequenceError
from engine.request.settings import SequenceSettings
from engine.request.sampling import SamplingParams
from engine.spec.rejection import greedy_accept
from tests.conftest import TINY_VOCAB
from tests.deployments.conftest import tiny_config

PROMPT = [5, 9, 12, 7, 30, 2]


def part(reply, name: str):
    """A reply's field: workers answer their results' wire tuples (a verify's seconds come second, a draft's third)."""
    if isinstance(reply, tuple):
        reply = VerifyResult.from_wire(reply) if isinstance(reply[1], float) else DraftResult.from_wire(reply)
    return getattr(reply, name)


def delta(seq_id: str, tokens: list[int], start: int = 0, temperature: float = 0.0, seed: int | None = None,
          logprobs: int | None = None, params: SamplingParams | None = None, prompt_len: int | None = None):
    """A request's delta; `seed` given: a seeded (Gumbel-coupled) request, else one whose seed was drawn (0 here);
    a first delta (start 0) carries the settings: `params`, else those the other arguments make."""
    if start > 0:
        return SeqDelta(seq_id, start, list(tokens))
    params = params or SamplingParams(temperature=temperature, seed=seed, logprobs=logprobs)
    settings = SequenceSettings.of(params, 0 if seed is None else seed, len(tokens) if prompt_len is None else prompt_len)
    return SeqDelta(seq_id, 0, list(tokens), settings)


def verify_call(seq: SeqDelta, draft: list[int], proposal=None) -> tuple:
    return VerifyCall(seq, list(draft), proposal).wire()


def draft_call(seq: SeqDelta, k: int) -> tuple:
    return DraftCall(seq, k).wire()


@pytest.fixture(scope="module")
def config(tiny_model_dirs):
    return tiny_config(tiny_model_dirs, model={"target_dtype": "float32"}).engine_config()


@pytest.fixture(scope="module")
def target(config):
    return TargetWorkerCore(config)


@pytest.fixture(scope="module")
def draft(config):
    return DraftWorkerCore(config)


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    """The same weights through transformers' own forward: the reference the workers must agree with."""
    return tuple(load_causal_lm(resolve(str(d)), "float32") for d in tiny_model_dirs)


def next_token_argmax(model, tokens: list[int], n: int) -> list[int]:
    """The model's argmax after each of the last n positions of `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return logits[len(tokens) - n:].argmax(-1).tolist()


def greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out += next_token_argmax(model, out, 1)
    return out[len(tokens):]


# ---- target ---------------------------------------------------------------------------------------------------
def test_greedy_verify_answers_the_agreeing_drafts_then_the_targets_argmax(target, models):
    for drafts in ([14, 3], greedy_continuation(models[0], PROMPT, 2)):
        reply = target.verify([verify_call(delta("g1", PROMPT), drafts)])
        [verdict] = part(reply, "verdicts")
        tokens, accepted = greedy_accept(drafts, next_token_argmax(models[0], PROMPT + drafts, len(drafts) + 1))
        assert (verdict.tokens, verdict.num_accepted, verdict.logprobs) == (tokens, accepted, None)
        assert part(reply, "seconds") > 0
        target.release(["g1"])
    assert accepted == 2, "the target's own continuation is accepted whole, plus the bonus token"


def test_a_continued_sequence_rolls_its_cache_back_past_rejected_drafts(target, models):
    target.verify([verify_call(delta("r1", PROMPT), [14, 3, 8])])
    # the router accepted 14, rejected 3 and 8, and committed the target's token 40 instead; the next call sends
    # only what is new to the worker: the committed tokens from position len(PROMPT) on
    committed = PROMPT + [14, 40]
    reply = target.verify([verify_call(delta("r1", [14, 40], start=len(PROMPT)), [21])])
    [verdict] = part(reply, "verdicts")
    assert verdict.tokens == greedy_accept([21], next_token_argmax(models[0], committed + [21], 2))[0]
    target.release(["r1"])


def test_sampled_rows_are_sampled_at_the_target_and_only_tokens_come_back(target, models):
    """A seeded row's tokens are the Gumbel-max choices of the target's distribution at its absolute positions;
    an unseeded row is rejection-sampled against the compact proposal it brings; logprobs only where asked."""
    from engine.spec.randomness import gumbel, seeds_tensor

    with torch.no_grad():  # temperature 1, no top-k/top-p: the model's softmax
        logp = models[0](torch.tensor([PROMPT[:4] + [6, 11]])).logits[0, -3:].log_softmax(-1)
    choice = (logp + gumbel(seeds_tensor([3]), torch.tensor([[4, 5, 6]]), TINY_VOCAB)[0]).argmax(-1).tolist()
    proposal = (np.array([[6, 7], [11, 12]], dtype=np.int32), np.array([[0.5, 0.5], [0.5, 0.5]], dtype=np.float32))
    calls = [verify_call(delta("m1", PROMPT), [14]),
             verify_call(delta("m2", PROMPT[:4], temperature=1.0, seed=3, logprobs=2), [6, 11]),
             verify_call(delta("m3", PROMPT[:4], temperature=1.0), [6, 11], proposal)]
    greedy, seeded, unseeded = part(target.verify(calls), "verdicts")
    assert seeded.tokens == choice[: seeded.num_accepted + 1], "drafts accepted iff they are the target's choices"
    assert len(seeded.logprobs) == len(seeded.tokens) and len(seeded.logprobs[0].top) == 2
    np.testing.assert_allclose(seeded.logprobs[0].logprob, float(logp[0, seeded.tokens[0]]), atol=1e-4)
    assert greedy.logprobs is None and unseeded.logprobs is None
    assert 0 <= unseeded.num_accepted <= 2 and len(unseeded.tokens) == unseeded.num_accepted + 1
    target.release(["m1", "m2", "m3"])


LONG_PROMPT = [(5 * t + 2) % 60 + 2 for t in range(50)]


def prompt_delta(seq_id: str, start: int, end: int, n: int) -> SeqDelta:
    """What the router sends while a request's prompt logprobs are not all in: prompt tokens [start, end), the top
    n, and the prompt token after them (a chunk's)."""
    return replace(delta(seq_id, LONG_PROMPT[start:end], start=start, prompt_len=len(LONG_PROMPT)),
                   prompt_logprobs=n, prompt_next=LONG_PROMPT[end] if end < len(LONG_PROMPT) else None)


def test_the_target_scores_prompt_logprobs_alike_chunked_or_whole_and_only_for_rows_that_ask(target, models):
    with torch.no_grad():
        want = models[0](torch.tensor([LONG_PROMPT])).logits[0, :-1].log_softmax(-1)  # [L-1, V]: row t-1 -> token t
    plain = part(target.verify([verify_call(delta("plain", PROMPT), [])]), "verdicts")
    target.release(["plain"])
    results = {}
    for chunk in (len(LONG_PROMPT), 16):
        scored = [None] * len(LONG_PROMPT)
        for start in range(0, len(LONG_PROMPT), chunk):
            end = min(len(LONG_PROMPT), start + chunk)
            calls = [verify_call(prompt_delta("p", start, end, 3), [])]
            if start == 0:
                calls.append(verify_call(delta("plain", PROMPT), []))  # a row beside it that did not ask
            reply = target.verify(calls)
            if start == 0:
                assert part(reply, "verdicts")[1] == plain[0], "a row that did not ask is unaffected"
            runs = part(reply, "prompt_logprobs")
            assert set(runs) == {0}, "only the row that asked gets prompt logprobs"
            for position, entry in enumerate(runs[0].entries, runs[0].first):
                assert scored[position] is None
                scored[position] = entry
        target.release(["p", "plain"])
        assert scored[0] is None and None not in scored[1:], f"every prompt token scored once (chunk {chunk})"
        results[chunk] = scored
    for t in range(1, len(LONG_PROMPT)):
        token = LONG_PROMPT[t]
        for scored in results.values():
            np.testing.assert_allclose(scored[t].logprob, float(want[t - 1, token]), atol=1e-4)
            assert scored[t].rank == 1 + int((want[t - 1] > want[t - 1, token]).sum())
            assert [i for i, _ in scored[t].top] == want[t - 1].topk(3).indices.tolist()


def test_the_target_reply_is_under_a_kilobyte_per_row_without_logprobs(target):
    """The wire budget of issue 18: target -> router under 1 KB per row per round (pickled, as the channel sends)."""
    import pickle

    rows = 8
    calls = [verify_call(delta(f"w{b}", PROMPT, temperature=1.0, seed=b if b % 2 else None), [6, 11, 3],
                         (np.tile(np.arange(8, dtype=np.int32), (3, 1)), np.full((3, 8), 0.125, np.float32))
                         if b % 2 == 0 else None)
             for b in range(rows)]
    reply = target.verify(calls)
    assert len(pickle.dumps(reply, protocol=5)) / rows < 1024
    target.release([f"w{b}" for b in range(rows)])


def test_release_frees_the_sequence_and_a_stale_continuation_is_refused(target):
    before = target.stats()["live_sequences"]
    target.verify([verify_call(delta("x1", PROMPT), [])])
    assert target.stats()["live_sequences"] == before + 1
    target.release(["x1"])
    assert target.stats()["live_sequences"] == before
    with pytest.raises(UnknownSequenceError):  # the router must re-send it from token 0 (a re-prefill)
        target.verify([verify_call(delta("x1", [4], start=len(PROMPT)), [])])
    target.release(["x1"])


def test_release_stale_frees_only_sequences_no_call_touched_lately(target, draft):
    """The replica's sweep (deployments/workers/lease_ledger.py): a sequence a call created again after its release is
    freed; one a call touched within `idle_s` is kept; ids the worker does not hold are ignored."""
    before = target.stats()["live_sequences"]
    target.verify([verify_call(delta("late", PROMPT), [])])
    target.release(["late"])
    target.verify([verify_call(delta("late", PROMPT), [])])  # a call after the release re-creates it
    target.verify([verify_call(delta("busy", PROMPT), [])])
    assert target.stats()["live_sequences"] == before + 2
    assert target.release_stale(["late", "busy", "never-seen"], idle_s=60.0) == []  # both touched just now
    assert target.release_stale(["late", "never-seen"], idle_s=0.0) == ["late"]
    assert target.stats()["live_sequences"] == before + 1
    with pytest.raises(UnknownSequenceError):
        target.verify([verify_call(delta("late", [4], start=len(PROMPT)), [])])
    target.release(["busy", "late"])
    assert target.stats()["live_sequences"] == before
    draft.propose([draft_call(delta("late-d", PROMPT), 2)], None)
    assert draft.release_stale(["late-d"], idle_s=0.0) == ["late-d"]
    assert "late-d" not in draft.stats()["live_sequence_ids"]


def test_released_ago_reports_when_each_sequence_was_released(target):
    """The replica's sweep closes leases whose sequences were released after they began (workers/replicas.py)."""
    import time

    assert target.released_ago(["nothing-yet"]) == {}
    target.verify([verify_call(delta("gone", PROMPT), [])])
    before_release = time.monotonic()
    target.release(["gone"])
    after_release = time.monotonic()
    time.sleep(0.05)
    before_asking = time.monotonic()
    ago = target.released_ago(["gone", "nothing-yet"])
    after_asking = time.monotonic()
    # between the release's end and the question's start, and at most from the release's start to the answer
    assert list(ago) == ["gone"] and before_asking - after_release <= ago["gone"] <= after_asking - before_release


PENALISED = SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.4,
                           logit_bias=((14, 1.0),))


def test_the_target_processes_each_position_from_the_tokens_it_holds_with_settings_sent_once(target, models):
    """The settings come with the first call only; later calls (deltas from `start`) are processed with them, and
    the penalties counted from the tokens the worker holds plus the drafts before each position."""
    from tests.engine.reference_processing import reference_greedy

    want = reference_greedy(models[0], PROMPT, PENALISED, (1,))
    reply = target.verify([verify_call(delta("p1", PROMPT, params=PENALISED), want[:3])])
    [verdict] = part(reply, "verdicts")
    assert verdict.tokens == want[:4] and verdict.num_accepted == 3, "the penalised continuation, accepted whole"
    reply = target.verify([verify_call(delta("p1", want[:4], start=len(PROMPT)), want[4:7])])  # no settings now
    [verdict] = part(reply, "verdicts")
    assert verdict.tokens == want[4:8] and verdict.num_accepted == 3
    plain = greedy_continuation(models[0], PROMPT, 8)
    assert plain != want[:8], "the check can fail: the penalties change the text"
    target.release(["p1"])
    [fresh] = part(target.verify([verify_call(delta("p1", PROMPT), [])]), "verdicts")  # re-sent with plain settings
    assert fresh.tokens == plain[:1]
    target.release(["p1"])


def test_the_draft_processes_its_steps_with_the_settings_of_the_first_call(draft, models):
    forced = SamplingParams(logit_bias=((17, 100.0),))
    reply = draft.propose([draft_call(delta("d9", PROMPT, params=forced), 3)])
    assert part(reply, "drafts") == [[17, 17, 17]]
    reply = draft.propose([draft_call(delta("d9", [17], start=len(PROMPT)), 2)])
    assert part(reply, "drafts") == [[17, 17]], "kept for the sequence's later calls"
    draft.release(["d9"])
    assert part(draft.propose([draft_call(delta("d9", PROMPT), 1)]), "drafts") != [[17]]
    draft.release(["d9"])


def test_target_stats_and_ping(target):
    stats = target.stats()
    assert stats["rank"] == 0 and stats["parameters"] == stats["full_parameters"] > 0
    assert isinstance(stats["kv_capacity"], int) and stats["kv_capacity"] > 0  # the static runner's slots
    assert target.ping() == 0.0  # idle


# ---- draft ----------------------------------------------------------------------------------------------------
def test_greedy_drafts_are_the_draft_models_greedy_continuation(draft, models):
    reply = draft.propose([draft_call(delta("d1", PROMPT), 3), draft_call(delta("d2", PROMPT[:3]), 2)])
    assert part(reply, "drafts") == [greedy_continuation(models[1], PROMPT, 3),
                                     greedy_continuation(models[1], PROMPT[:3], 2)]
    assert not part(reply, "proposals")  # greedy drafts are tokens only
    # the next round sends only the new committed tokens; the draft continues from there
    committed = PROMPT + part(reply, "drafts")[0][:1] + [44]
    reply = draft.propose([draft_call(delta("d1", committed[len(PROMPT):], start=len(PROMPT)), 2)])
    assert part(reply, "drafts") == [greedy_continuation(models[1], committed, 2)]
    draft.release(["d1", "d2"])


def test_sampled_drafts_repeat_by_seed_and_only_unseeded_rows_send_compact_proposals(draft):
    calls = [draft_call(delta("s1", PROMPT, temperature=1.0), 3),  # unseeded: a proposal
             draft_call(delta("s2", PROMPT, temperature=1.0, seed=7), 3)]  # seeded: tokens only
    first = draft.propose(calls)
    draft.release(["s1", "s2"])
    again = draft.propose(calls)
    draft.release(["s1", "s2"])
    assert part(first, "drafts") == part(again, "drafts"), "counter-based: the same seed and positions, same drafts"
    assert all(len(d) == 3 for d in part(first, "drafts"))
    assert set(part(first, "proposals")) == {0}
    ids, probs = part(first, "proposals")[0]
    assert ids.dtype == np.int32 and probs.dtype == np.float32 and ids.shape == probs.shape
    assert ids.shape[0] == 3 and ids.shape[1] == min(128, TINY_VOCAB)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-4)
    # each drafted token was drawn from its row's proposal: one of its tokens, of positive probability
    for i, tok in enumerate(part(first, "drafts")[0]):
        assert probs[i][list(ids[i]).index(tok)] > 0


def test_a_cancelled_ahead_draft_answers_cancelled_and_others_are_unaffected(draft):
    before = draft.stats()["cancelled_drafts"]
    draft.cancel(41)
    reply = draft.propose([draft_call(delta("a1", PROMPT), 2)], ahead_id=41)
    assert part(reply, "cancelled") is True
    assert draft.stats()["cancelled_drafts"] == before + 1
    reply = draft.propose([draft_call(delta("a1", PROMPT), 2)], ahead_id=42)  # not cancelled
    assert len(part(reply, "drafts")[0]) == 2
    draft.release(["a1"])


def test_draft_release_and_stats(draft):
    before = draft.stats()["live_sequences"]
    draft.propose([draft_call(delta("l1", PROMPT), 1)])
    assert draft.stats()["live_sequences"] == before + 1
    draft.release(["l1"])
    assert draft.stats()["live_sequences"] == before
    with pytest.raises(UnknownSequenceError):
        draft.propose([draft_call(delta("l1", [3], start=len(PROMPT)), 1)])
    assert draft.ping() == 0.0


def test_a_target_worker_reads_the_costs_a_previous_start_measured(tmp_path, monkeypatch, tiny_model_dirs):
    import json

    from deployments.workers import target as workers

    calls = []
    real = workers.measure_target_costs
    monkeypatch.setattr(workers, "measure_target_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = tiny_config(tiny_model_dirs, speculation={"cost_cache": str(tmp_path)}).engine_config()
    first = workers.TargetWorkerCore(config).calibrate(3)
    second = workers.TargetWorkerCore(config).calibrate(3)
    assert len(calls) == 1, "the second start read the first one's measurement"
    assert second == json.loads(json.dumps(first))


# ---- start-up with few KV-cache slots, and the errors a worker cannot start with ----------------------------------
@pytest.mark.parametrize("slots", [1, 2])
def test_workers_of_one_or_two_slots_start_and_measure_their_costs_within_them(tiny_model_dirs, slots):
    from engine.calibration.measure import profile_from_costs
    from engine.spec.plan import RowOutlook, plan_round

    config = tiny_config(tiny_model_dirs, runner={"max_num_seqs": slots}).engine_config()
    draft = DraftWorkerCore(config, calibrate=True)
    target = TargetWorkerCore(config)
    verify = target.calibrate(3)
    sizes = list(range(1, slots + 1))
    assert draft.stats()["kv_capacity"] == slots == target.stats()["kv_capacity"]
    assert draft.costs["batch_sizes"] == sizes == verify["batch_sizes"]
    assert draft.stats()["live_sequences"] == 0 == target.stats()["live_sequences"], "measured, then released"
    profile = profile_from_costs(verify, draft.costs)
    assert profile.batch_sizes == tuple(sizes) and 0 <= max(plan_round(profile, [RowOutlook(0.8, 3)] * 8)) <= 3
    reply = target.verify([verify_call(delta("s", PROMPT), [])])  # the worker serves after measuring
    [verdict] = part(reply, "verdicts")
    assert len(verdict.tokens) == 1


def test_a_kv_budget_that_holds_no_sequence_fails_the_start_once_saying_what_to_change(tiny_model_dirs):
    from deployments.errors import StartupError

    config = tiny_config(tiny_model_dirs, runner={"kv_cache_gib": 1e-6}).engine_config()
    with pytest.raises(StartupError, match=r"^Target worker cannot start: the KV-cache budget .* kv_cache_gib"):
        TargetWorkerCore(config)
    with pytest.raises(StartupError, match=r"^Draft worker cannot start: the KV-cache budget .* max_model_len"):
        DraftWorkerCore(config)


def test_a_missing_model_path_fails_the_start_naming_the_setting(tiny_model_dirs, tmp_path):
    from deployments.errors import StartupError

    config = tiny_config((tiny_model_dirs[0], tmp_path / "no-such-model")).engine_config()
    with pytest.raises(StartupError, match=r"Draft worker cannot start: model path does not exist: .*model\.draft"):
        DraftWorkerCore(config)


def test_other_start_up_errors_pass_as_they_are():
    from deployments.errors import StartupError
    from deployments.workers.base import startup_error, startup_errors
    from engine.models.runner import KVCacheFull

    with pytest.raises(ZeroDivisionError):  # a bug: Serve's retries are its business
        with startup_errors("target"):
            1 / 0
    assert startup_error("draft", ValueError("bad dtype")) is None
    full = startup_error("target", KVCacheFull("all 1 KV-cache slots are taken"))
    assert isinstance(full, StartupError) and "raise runner.max_num_seqs" in str(full)
    # out of memory while loading: a configuration (or placement) error, said once with what to change
    oom = startup_error("target", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    assert isinstance(oom, StartupError) and "out of memory" in str(oom) and "kv_cache_fraction" in str(oom)
    assert "\n" not in str(oom)


def test_the_workers_channel_methods_are_the_wire_s_one_list(draft, target):
    from deployments.transport.messages import Method

    served = set(draft._model.handlers) | set(target._model.handlers)
    assert served == set(Method), served ^ set(Method)
    assert all(isinstance(name, Method) for name in served)


def test_a_worker_shows_the_projects_startup_lines_on_stderr(capfd):
    """Ray leaves Python's root logger at WARNING; a worker's INFO lines (which operator computes bf16 products, the
    runner's shapes) go to its stderr, which Ray forwards to `serve run`'s output, once however often it is set up."""
    import logging

    from deployments.workers.base import show_startup_logs

    show_startup_logs()
    show_startup_logs()
    logging.getLogger("engine.models.cpu.bf16_products").info("bf16 products: a line")
    logging.getLogger("deployments.router.prepare").info("not a worker's line")
    err = capfd.readouterr().err
    assert err.count("INFO engine.models.cpu.bf16_products: bf16 products: a line") == 1
    assert "not a worker's line" not in err
