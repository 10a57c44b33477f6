"""Decoding ahead (deployments/workers/decode_ahead.py): a target worker answers a plain round's next call from the step
it ran right after replying, with the tokens that call would have computed (greedy and seeded), and computes as before
whatever differs from its guess."""

from __future__ import annotations

import pytest

from deployments.transport.messages import RowFailure, VerifyCall, VerifyResult
from deployments.workers.decode_ahead import AheadRow, DecodeAhead, merged, next_calls
from deployments.workers.target import TargetWorkerCore
from engine.spec.accept import Verdict
from tests.deployments.workers.test_workers import PROMPT, delta, greedy_continuation, part


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    from tests.deployments.conftest import tiny_config

    return TargetWorkerCore(tiny_config(tiny_model_dirs, model={"target_dtype": "float32"}).engine_config())


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    from engine.models.loading import load_causal_lm, resolve

    return tuple(load_causal_lm(resolve(str(d)), "float32") for d in tiny_model_dirs)


def decode(target, seqs: dict[str, dict], rounds: int, ahead: bool) -> dict[str, list[int]]:
    """Plain rounds over `seqs` (id -> delta settings), each call sending the tokens the last one gave, as the
    router does; the tokens each sequence got."""
    tokens = {s: [] for s in seqs}
    for r in range(rounds):
        calls = []
        for s, settings in seqs.items():
            sent = PROMPT if r == 0 else tokens[s][-1:]
            start = 0 if r == 0 else len(PROMPT) + len(tokens[s]) - 1
            calls.append(VerifyCall(delta(s, sent, start=start, **settings), [], None, ahead).wire())
        for s, verdict in zip(seqs, part(target.verify(calls), "verdicts")):
            tokens[s] += verdict.tokens
    return tokens


def test_greedy_and_seeded_rows_decode_ahead_to_the_tokens_computed_without_it(target, models):
    settings = {"greedy": {}, "seeded": {"temperature": 1.0, "seed": 11}}
    before = target.ahead.stats.as_dict()
    with_ahead = decode(target, {f"a-{k}": v for k, v in settings.items()}, 8, ahead=True)
    target.on_model_thread(lambda: None)  # after the step queued behind the last reply
    stats = target.ahead.stats.as_dict()
    target.release(list(with_ahead))
    without = decode(target, {f"b-{k}": v for k, v in settings.items()}, 8, ahead=False)
    target.release(list(without))
    assert with_ahead["a-greedy"] == without["b-greedy"] == greedy_continuation(models[0], PROMPT, 8)
    assert with_ahead["a-seeded"] == without["b-seeded"]  # a seeded row draws by absolute position
    # rounds 2..8 were answered from the step made ahead; the step after the last round was dropped at release
    assert stats["used"] - before["used"] == 2 * 7 and stats["steps"] - before["steps"] == 8
    assert target.ahead.stats.dropped - before["dropped"] == 2 and not target.ahead.rows


def test_a_call_that_differs_from_the_guess_is_computed_and_the_cache_rolls_back(target, models):
    got = decode(target, {"c": {}}, 2, ahead=True)["c"]
    target.on_model_thread(lambda: None)
    dropped = target.ahead.stats.dropped
    # the router now drafts for the row (the step made ahead assumed none): computed anew, the guessed token's
    # keys and values rolled back and fed again with the drafts
    committed = PROMPT + got
    drafts = greedy_continuation(models[0], committed, 2)
    call = VerifyCall(delta("c", got[-1:], start=len(committed) - 1), drafts).wire()
    reply = VerifyResult.from_wire(target.verify([call]))
    assert reply.ahead_rows == 0 and target.ahead.stats.dropped == dropped + 1
    assert reply.verdicts[0].tokens == greedy_continuation(models[0], committed, 3)
    target.release(["c"])


def test_only_rounds_whose_every_row_is_marked_decode_ahead(target):
    steps = target.ahead.stats.steps
    calls = [VerifyCall(delta("m1", PROMPT), [], None, True).wire(), VerifyCall(delta("m2", PROMPT), []).wire()]
    target.verify(calls)
    target.verify([VerifyCall(delta("m3", PROMPT), [4, 5], None, True).wire()])  # drafts: not a plain row
    target.on_model_thread(lambda: None)  # after any step queued behind the replies
    assert target.ahead.stats.steps == steps and not target.ahead.rows
    target.release(["m1", "m2", "m3"])


def test_next_calls_send_each_rows_tokens_and_refuse_rounds_that_cannot_go_ahead():
    calls = [VerifyCall(delta("x", [1, 2, 3]), [], None, True)]
    result = VerifyResult([Verdict([9], 0)], 0.01)
    [nxt] = next_calls(calls, result)
    assert (nxt.seq.start, nxt.seq.tokens, nxt.draft, nxt.ahead) == (3, [9], [], True)
    assert next_calls([VerifyCall(calls[0].seq, [], None, False)], result) is None
    assert next_calls(calls, VerifyResult([None], 0.01, failed={0: RowFailure("c", "m")})) is None


def test_take_serves_exact_matches_drops_others_and_merged_puts_rows_back_in_order():
    ahead = DecodeAhead()
    rows = [VerifyCall(delta(s, [7], start=5), [], None, True) for s in ("p", "q", "r")]
    ahead.keep(rows, VerifyResult([Verdict([1], 0), Verdict([2], 0), Verdict([3], 0)], 0.25), 0.25)
    calls = [VerifyCall(delta("q", [7], start=5), []), VerifyCall(delta("new", PROMPT), []),
             VerifyCall(delta("p", [8], start=5), []), VerifyCall(delta("r", [1, 2, 3, 4, 5, 7]), [])]  # r re-sent from scratch
    served = ahead.take(calls)
    assert list(served) == [0] and ahead.stats.used == 1 and ahead.stats.dropped == 2 and not ahead.rows
    computed = VerifyResult([Verdict([4], 0), Verdict([5], 0), Verdict([6], 0)], 0.5, cached_tokens={1: 3})
    result = merged(4, served, [1, 2, 3], computed, rank=0)
    assert [v.tokens for v in result.verdicts] == [[2], [4], [5], [6]]
    assert result.seconds == 0.75 and result.ahead_rows == 1 and result.cached_tokens == {2: 3}
    assert merged(4, served, [1, 2, 3], None, rank=1) is None
    row = AheadRow(0, (1,), None, 0, 0.1)
    assert merged(1, {0: row}, [], None, rank=0).seconds == 0.1


def test_the_wire_carries_the_mark_and_the_ahead_rows():
    call = VerifyCall(delta("w", [1]), [], None, True)
    assert VerifyCall.from_wire(call.wire()) == call
    assert VerifyCall.from_wire(VerifyCall(delta("w", [1]), []).wire()).ahead is False
    result = VerifyResult([Verdict([1], 0)], 0.1, ahead_rows=1)
    assert VerifyResult.from_wire(result.wire()) == result
