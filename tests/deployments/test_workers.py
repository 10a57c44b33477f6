"""The model-worker cores of deployments/workers.py directly, without Ray or a router: what a draft and a target
worker answer for a round's calls, on the tiny random-weight model pair.

Replies are read through `part(reply, name)`, which takes a reply's field by name from its wire tuple, so these
tests pin what a worker computes, not how its reply is spelled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deployments.messages import DraftCall, DraftResult, SeqDelta, VerifyCall, VerifyResult, draft_replies_directly
from deployments.worker_base import UnknownSequenceError
from deployments.workers import DraftWorkerCore, TargetWorkerCore
from engine.loading import load_causal_lm, resolve
from tests.conftest import TINY_VOCAB
from tests.deployments.conftest import tiny_config

PROMPT = [5, 9, 12, 7, 30, 2]


def part(reply, name: str):
    """A reply's field: workers answer their results' wire tuples (a verify's starts with its argmax dict, a
    draft's with its list of drafts)."""
    if isinstance(reply, tuple):
        reply = VerifyResult.from_wire(reply) if isinstance(reply[0], dict) else DraftResult.from_wire(reply)
    return getattr(reply, name)


def delta(seq_id: str, tokens: list[int], start: int = 0, temperature: float = 0.0, seed: int | None = None):
    return SeqDelta(seq_id, start, list(tokens), temperature, 0, 1.0, seed)


def verify_call(seq: SeqDelta, draft: list[int]) -> tuple:
    return VerifyCall(seq, list(draft)).wire()


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
def test_greedy_verify_answers_the_targets_argmax_after_each_draft_position(target, models):
    drafts = [14, 3]
    reply = target.verify([verify_call(delta("g1", PROMPT), drafts)])
    assert part(reply, "argmax")[0] == next_token_argmax(models[0], PROMPT + drafts, len(drafts) + 1)
    assert not part(reply, "probs")  # greedy rows send token ids only
    assert part(reply, "seconds") > 0
    target.release(["g1"])


def test_a_continued_sequence_rolls_its_cache_back_past_rejected_drafts(target, models):
    target.verify([verify_call(delta("r1", PROMPT), [14, 3, 8])])
    # the router accepted 14, rejected 3 and 8, and committed the target's token 40 instead; the next call sends
    # only what is new to the worker: the committed tokens from position len(PROMPT) on
    committed = PROMPT + [14, 40]
    reply = target.verify([verify_call(delta("r1", [14, 40], start=len(PROMPT)), [21])])
    assert part(reply, "argmax")[0] == next_token_argmax(models[0], committed + [21], 2)
    target.release(["r1"])


def test_sampled_rows_get_probabilities_and_greedy_rows_token_ids_in_one_batch(target, models):
    calls = [verify_call(delta("m1", PROMPT), [14]),
             verify_call(delta("m2", PROMPT[:4], temperature=1.0, seed=3), [6, 11])]
    reply = target.verify(calls)
    assert set(part(reply, "argmax")) == {0} and set(part(reply, "probs")) == {1}
    probs = np.asarray(part(reply, "probs")[1])  # [K+1, V]
    assert probs.shape == (3, TINY_VOCAB)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-4)
    with torch.no_grad():  # temperature 1, no top-k/top-p: the model's softmax
        expected = models[0](torch.tensor([PROMPT[:4] + [6, 11]])).logits[0, -3:].softmax(-1).numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-4)
    target.release(["m1", "m2"])


def test_verify_chained_fills_in_the_drafts_and_carries_the_draft_result(target):
    seq = delta("c1", PROMPT)
    direct = target.verify([verify_call(seq, [14, 3])])
    target.release(["c1"])
    draft_result = DraftResult([[14, 3]], {}, 0.01)
    chained = target.verify_chained([verify_call(seq, [])], [0], draft_result.wire())
    assert part(chained, "argmax") == part(direct, "argmax")
    assert part(chained, "draft") == draft_result  # the router gets the draft's result with the target's reply
    target.release(["c1"])


def test_release_frees_the_sequence_and_a_stale_continuation_is_refused(target):
    before = target.stats()["live_sequences"]
    target.verify([verify_call(delta("x1", PROMPT), [])])
    assert target.stats()["live_sequences"] == before + 1
    target.release(["x1"])
    assert target.stats()["live_sequences"] == before
    with pytest.raises(UnknownSequenceError):  # the router must re-send it from token 0 (a re-prefill)
        target.verify([verify_call(delta("x1", [4], start=len(PROMPT)), [])])
    target.release(["x1"])


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
    assert not part(reply, "probs")  # greedy drafts are one-hot: the router rebuilds them
    # the next round sends only the new committed tokens; the draft continues from there
    committed = PROMPT + part(reply, "drafts")[0][:1] + [44]
    reply = draft.propose([draft_call(delta("d1", committed[len(PROMPT):], start=len(PROMPT)), 2)])
    assert part(reply, "drafts") == [greedy_continuation(models[1], committed, 2)]
    draft.release(["d1", "d2"])


def test_sampled_drafts_send_their_distributions_and_repeat_with_the_seed(draft):
    first = draft.propose([draft_call(delta("s1", PROMPT, temperature=1.0, seed=7), 3)])
    draft.release(["s1"])
    again = draft.propose([draft_call(delta("s1", PROMPT, temperature=1.0, seed=7), 3)])
    draft.release(["s1"])
    assert part(first, "drafts") == part(again, "drafts") and len(part(first, "drafts")[0]) == 3
    probs = np.asarray(part(first, "probs")[0])  # [K, V]
    assert probs.shape == (3, TINY_VOCAB)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-4)
    # each drafted token was drawn from its row's distribution: never one of probability 0
    assert all(probs[i, tok] > 0 for i, tok in enumerate(part(first, "drafts")[0]))


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


def test_only_sampled_rounds_reply_from_the_draft_directly():
    greedy, sampled = delta("a", PROMPT), delta("b", PROMPT, temperature=0.7)
    assert not draft_replies_directly([DraftCall(greedy, 3)])
    assert draft_replies_directly([DraftCall(greedy, 3), DraftCall(sampled, 3)])
