"""Bad days over real HTTP (uvicorn, tiny models, in-process replicas): overload bursts and client hang-ups."""

import concurrent.futures
import json

import httpx

from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, http_server, tiny_config
from tests.deployments.held_rounds import HeldRounds, until
from tests.deployments.router.test_router import plain_reference

BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
# "its caches are freed within a second" (docs/ARCHITECTURE.md), counted in rounds: the round on the way when the
# hang-up arrives comes back first
MAX_ROUNDS_AFTER_HANG_UP = 1


def test_burst_of_ten_times_capacity_every_request_answered(tiny_model_dirs, monkeypatch):
    capacity = 2
    config = tiny_config(tiny_model_dirs, limits={"max_live_sequences_per_router": capacity})
    broker = LocalBroker(config)
    router = Router(config, broker)

    def one(_):
        r = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        return r.status_code, r.headers.get("retry-after"), r.json()

    # the admitted requests' rounds are held until every refusal has been answered: refusals that queued behind
    # generation would never be answered, and the wait below would fail
    with http_server(router) as base, HeldRounds(broker, monkeypatch) as rounds:
        with concurrent.futures.ThreadPoolExecutor(10 * capacity) as pool:
            futures = [pool.submit(one, i) for i in range(10 * capacity)]
            until(lambda: sum(f.done() for f in futures) >= 9 * capacity, "the refusals")
            refused_while_held = [f.result() for f in futures if f.done()]
            generated_meanwhile = rounds.passed
            rounds.release()
            answers = [f.result(timeout=60) for f in futures]
        after = httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
    statuses = [a[0] for a in answers]
    assert len(answers) == 10 * capacity and set(statuses) <= {200, 503}, statuses  # none lost, none hung
    assert statuses.count(200) == capacity and statuses.count(503) == 9 * capacity, statuses
    assert generated_meanwhile == 0 and [a[0] for a in refused_while_held] == [503] * 9 * capacity, \
        "every refusal was answered before the admitted requests ran a round"
    for status, retry_after, body in answers:
        if status == 503:
            assert retry_after == "1" and body["error"]["code"] == "overloaded"
        else:
            assert body["usage"]["completion_tokens"] == 40
    texts = {a[2]["choices"][0]["text"] for a in answers if a[0] == 200}
    assert len(texts) == 1, "admitted requests (same prompt, greedy) all produced the same output"
    assert after.status_code == 200 and router.scheduler.num_live == 0


def test_client_hang_up_mid_stream_frees_the_sequence(tiny_model_dirs, monkeypatch):
    """The hang-up is heard at once, not at the next write: the request's rounds past its first chunk are held, so
    nothing is written to the closed connection, and the sequence still leaves the round loop; its caches are freed
    once the round that was on the way at the hang-up has come back (at most that one more round runs)."""
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    target = broker.cores["target"]
    with http_server(router) as base, HeldRounds(broker, monkeypatch, free=1) as rounds:
        with httpx.stream("POST", f"{base}/v1/completions", json={**BODY, "max_tokens": 120, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["text"] is not None
                    assert router.scheduler.num_live == 1
                    break  # leaving the block closes the connection
        rounds_before = target.calls
        until(lambda: router.scheduler.num_live == 0, "the hung-up request to leave the round loop, no round let go")
        passed_meanwhile = rounds.passed
        rounds.release()
        until(lambda: broker.open_leases == {"draft": 0, "target": 0}, "its leases to close")
        until(lambda: target.runner.num_live == 0 and broker.cores["draft"].proposer.runner.num_live == 0,
              "its caches to be freed")
        rounds_after = target.calls - rounds_before
    assert rounds_before == 1 and passed_meanwhile == 1, "the request's rounds were held from its first chunk on"
    assert rounds_after <= MAX_ROUNDS_AFTER_HANG_UP, rounds_after
    assert target.rows < 120 // 2, "generation stopped instead of running to max_tokens"


def test_a_hang_up_leaves_the_request_sharing_its_round_alone(tiny_model_dirs, monkeypatch):
    """A client that hangs up while its row's round is on the way: its sequence is freed once that round is back,
    never before (a worker that freed it would fail the round's call for every row in it), and the request that
    shared the round gets its whole answer."""
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    with http_server(router) as base, HeldRounds(broker, monkeypatch, free=1) as rounds, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{base}/v1/completions", json={**BODY, "max_tokens": 120, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    other = pool.submit(httpx.post, f"{base}/v1/completions",
                                        json={**BODY, "prompt": [9, 8, 7, 6], "max_tokens": 24}, timeout=60)
                    until(lambda: router.scheduler.num_live == 2, "the second request to join")
                    rounds.allow(1)  # the held round; the next one has both rows
                    until(lambda: rounds.held == 1 and rounds.passed == 2, "a round of both")
                    break
        until(lambda: router.scheduler.num_live == 1, "the hung-up request to leave")
        rounds.release()
        answer = other.result(timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, [9, 8, 7, 6], 24)
