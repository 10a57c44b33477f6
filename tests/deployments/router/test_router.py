"""Router + Scheduler + worker cores without a cluster: OpenAI API, batching, stickiness, failures, errors."""

import asyncio
import concurrent.futures
import dataclasses
import json

import httpx
import pytest

from deployments.api.routes import create_app
from deployments.router.router import Router
from engine import ModelRunner, SamplingParams, SpeculativeEngine
from engine.models.loading import load_causal_lm, load_tokenizer, resolve
from tests.deployments.conftest import LocalBroker, http_server, tiny_config
from tests.deployments.held_rounds import HeldRounds, until

PROMPT_IDS = [5, 6, 7, 8, 9, 10]


@pytest.fixture()
def setup(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    return config, broker, router


def plain_reference(dirs, prompt_ids, n):
    target = resolve(str(dirs[0]))
    engine = SpeculativeEngine(ModelRunner(load_causal_lm(target)), load_tokenizer(target), None, 0)
    return engine.generate([prompt_ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].text


def client(router):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router)), base_url="http://test")


async def complete(c, **body):
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **body}
    return await c.post("/v1/completions", json=body)


def test_greedy_completion_equals_plain_decoding(setup, tiny_model_dirs):
    config, broker, router = setup

    async def go():
        async with client(router) as c:
            r = await complete(c)
            assert r.status_code == 200, r.text
            return r.json()

    body = asyncio.run(go())
    assert body["choices"][0]["text"] == plain_reference(tiny_model_dirs, PROMPT_IDS, 24)
    spec = body["usage"]["speculative"]
    assert body["usage"]["completion_tokens"] == 24 and spec["num_draft_tokens"] > 0
    assert 0 < spec["acceptance_rate"] <= 1
    assert broker.open_leases == {"draft": 0, "target": 0}, "finished requests close their leases"
    assert broker.cores["target"].runner.num_live == 0 and broker.cores["draft"].proposer.runner.num_live == 0
    assert broker.direct_releases == {"draft": 1, "target": 1}, "the router frees both sequences after the last round"
    # every drafting round went draft -> target in one chained call
    assert broker.chained == router.scheduler.stats.chained_rounds == spec["num_drafts"] > 0


def test_concurrent_requests_are_batched_and_correct(setup, tiny_model_dirs):
    config, broker, router = setup
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(4)]

    async def go():
        async with client(router) as c:
            return await asyncio.gather(*[complete(c, prompt=p, max_tokens=16) for p in prompts])

    results = asyncio.run(go())
    for p, r in zip(prompts, results):
        assert r.json()["choices"][0]["text"] == plain_reference(tiny_model_dirs, p, 16)
    assert router.scheduler.stats.timings.max_batch == 4
    assert broker.cores["target"].rows > broker.cores["target"].calls, "one verify call carried several requests"


def test_finished_request_leaves_before_the_next_round(setup):
    config, broker, router = setup

    async def go():
        async with client(router) as c:
            return await asyncio.gather(complete(c, max_tokens=4), complete(c, prompt=[9, 8, 7, 6], max_tokens=40))

    results = [r.json() for r in asyncio.run(go())]
    rounds = sum(r["usage"]["speculative"]["rounds"] for r in results)
    assert results[0]["usage"]["completion_tokens"] == 4
    assert broker.cores["target"].rows == rounds, "a finished request was verified again in a later round"


def test_per_request_speculation_options(setup):
    config, broker, router = setup

    async def go():
        async with client(router) as c:
            off = await complete(c, speculative={"enabled": False})
            k1 = await complete(c, speculative={"k": 1})
            return off.json(), k1.json()

    off, k1 = asyncio.run(go())
    assert off["usage"]["speculative"]["num_drafts"] == 0
    assert len(k1["usage"]["speculative"]["accepted_per_position"]) == 1
    assert off["choices"][0]["text"] == k1["choices"][0]["text"]


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_replica_killed_mid_request_output_unchanged(setup, tiny_model_dirs, kind):
    config, broker, router = setup

    broker.fail_at_call[kind] = 3  # the pinned replica dies at its third round

    async def go():
        async with client(router) as c:
            async with c.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                return text

    text = asyncio.run(go())
    assert text == plain_reference(tiny_model_dirs, PROMPT_IDS, 30)
    assert router.scheduler.stats.replica_failures == 1
    assert broker.keys[kind] != f"{kind}-0", "a new replica took over"


def test_a_chained_round_the_draft_cannot_pass_on_verifies_without_its_drafts(setup, tiny_model_dirs):
    config, broker, router = setup
    broker.break_chains = 1  # the draft worker drafts but cannot reach the target worker

    async def go():
        async with client(router) as c:
            return (await complete(c)).json()

    body = asyncio.run(go())
    assert body["choices"][0]["text"] == plain_reference(tiny_model_dirs, PROMPT_IDS, 24)
    assert router.scheduler.stats.replica_failures == 0 and broker.keys["draft"] == "draft-0", "no replica blamed"
    spec = body["usage"]["speculative"]
    assert broker.chained == 1 and router.scheduler.stats.chained_rounds == 0, "that pair is not chained again"
    assert spec["num_drafts"] > 0, "its rounds draft and verify by a call each"


def test_aborted_request_frees_caches_at_once(setup):
    """What the HTTP layer does when a client hangs up: close the request's output stream after one round. It
    leaves the round loop at once; its leases close, and its caches are freed, once the round on the way with it
    is back (freeing them sooner would fail that round's call for the other rows in it), and no later round runs."""
    config, broker, router = setup
    target = broker.cores["target"]

    async def go():
        stream = router.scheduler.generate(PROMPT_IDS, SamplingParams(max_tokens=120, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished and router.scheduler.num_live == 1
        assert target.runner.num_live == 1
        rounds = router.scheduler.stats.timings.rounds
        await stream.aclose()
        assert router.scheduler.num_live == 0, "it left the round loop at once"
        for _ in range(6000):  # a guard against a hang only: the round on the way comes back
            if broker.open_leases == {"draft": 0, "target": 0}:
                break
            await asyncio.sleep(0.01)
        return router.scheduler.stats.timings.rounds - rounds

    assert asyncio.run(go()) <= 1, "no round ran after the one on the way"
    assert router.scheduler.num_live == 0
    assert broker.open_leases == {"draft": 0, "target": 0}
    assert broker.cores["target"].runner.num_live == 0
    assert broker.cores["draft"].proposer.runner.num_live == 0


@pytest.mark.parametrize("body,status,fragment", [
    ({"model": "nope"}, 404, "does not exist"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": -1}, 400, "top_k"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"max_tokens": 100000}, 400, "over the limit"),
    ({"n": 99}, 400, "over the limit"),
    ({"n": 0}, 400, "n"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [1] * 300}, 400, "tokens; the limit"),
    ({"prompt": [99999]}, 400, "token ids"),
    ({"stop": [str(i) for i in range(20)]}, 400, "stop strings"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(setup, body, status, fragment):
    config, broker, router = setup

    async def go():
        async with client(router) as c:
            return await complete(c, **body)

    r = asyncio.run(go())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]


def test_http_level_errors(setup, monkeypatch):
    config, broker, router = setup

    async def go():
        async with client(router) as c:
            bad_json = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            wrong_type = await c.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"})
            huge = await c.post("/v1/completions", content=b"{" + b" " * 2_000_000 + b"}",
                                headers={"content-type": "application/json"})
            chat_empty = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
            bad_utf8 = await c.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
                                    headers={"content-type": "application/json"})
            assert bad_utf8.status_code == 400 and bad_utf8.json()["error"]["message"]
            health = await c.get("/health")
            models = await c.get("/v1/models")
            return bad_json, wrong_type, huge, chat_empty, health, models

    bad_json, wrong_type, huge, chat_empty, health, models = asyncio.run(go())
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    assert wrong_type.status_code == 415
    assert huge.status_code == 413
    assert chat_empty.status_code == 400
    assert health.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_api_key_required_when_configured(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", "s3cret")
    config = tiny_config(tiny_model_dirs)
    router = Router(config, LocalBroker(config))

    async def go():
        async with client(router) as c:
            none = await complete(c)
            wrong = await c.post("/v1/completions", json={"model": "tiny", "prompt": "w5"},
                                 headers={"Authorization": "Bearer nope"})
            right = await c.post("/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2},
                                 headers={"Authorization": "Bearer s3cret"})
            health = await c.get("/health")
            return none, wrong, right, health

    none, wrong, right, health = asyncio.run(go())
    assert none.status_code == 401 and wrong.status_code == 401 and right.status_code == 200
    assert health.status_code == 200


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """`until` inside the test's event loop (where the in-process app runs its rounds): yields while it waits."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        await asyncio.sleep(0.005)


def test_admission_limit_answers_503_with_retry_after(tiny_model_dirs, monkeypatch):
    config = tiny_config(tiny_model_dirs, limits={"max_live_sequences_per_router": 1})
    broker = LocalBroker(config)
    router = Router(config, broker)

    async def go():
        # the admitted request's rounds wait until the other three have their answers: all four overlap
        with HeldRounds(broker, monkeypatch) as rounds:
            async with client(router) as c:
                tasks = [asyncio.ensure_future(complete(c, max_tokens=40)) for _ in range(4)]
                await _until(lambda: sum(t.done() for t in tasks) == 3 and router.scheduler.num_live == 1,
                             "three of the four to be answered, the fourth admitted")
                assert rounds.passed == 0, "answered while the admitted one held"
                rounds.release()
                return await asyncio.gather(*tasks)

    results = asyncio.run(go())
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 503, 503, 503], codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"


def test_refusal_comes_at_the_door_before_parsing_or_tokenizing(tiny_model_dirs, monkeypatch):
    config = tiny_config(tiny_model_dirs, limits={"max_live_sequences_per_router": 1})
    broker = LocalBroker(config)
    router = Router(config, broker)
    calls = []
    tokenize = router.tokenizer.__class__.__call__
    router.tokenizer.__class__.__call__ = lambda self, *a, **kw: (calls.append(a), tokenize(self, *a, **kw))[1]

    async def go():
        # the running request's rounds wait until both refusals are back: it is live when they arrive
        with HeldRounds(broker, monkeypatch) as rounds:
            async with client(router) as c:
                running = asyncio.create_task(complete(c, max_tokens=60))
                await _until(lambda: router.scheduler.num_live == 1, "the first request to be admitted")
                text = asyncio.ensure_future(c.post("/v1/completions",
                                                    json={"model": "tiny", "prompt": "hello", "max_tokens": 4}))
                await _until(lambda: text.done() or router.scheduler.num_live > 1, "the second request's answer")
                assert router.scheduler.num_live == 1, "the second request was admitted beside the running one"
                refused_text = await text
                refused_junk = await c.post("/v1/completions", content=b"{not json",
                                            headers={"Content-Type": "application/json"})
                assert not running.done() and rounds.passed == 0, "both answered while the running request was held"
                rounds.release()
                return await running, refused_text, refused_junk

    try:
        ok, refused_text, refused_junk = asyncio.run(go())
    finally:
        router.tokenizer.__class__.__call__ = tokenize
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 60
    for r in (refused_text, refused_junk):
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    assert calls == [], "a refused request was never tokenized"
    assert router.scheduler.admission.reserved == 0


def test_requests_rejected_after_the_door_give_their_place_back(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs, limits={"max_live_sequences_per_router": 1})
    router = Router(config, LocalBroker(config))

    async def go():
        async with client(router) as c:
            bad = [await complete(c, temperature=-1), await complete(c, model="other"),
                   await c.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}),
                   await complete(c, prompt=[])]
            return bad, await complete(c, max_tokens=4)

    bad, good = asyncio.run(go())
    assert [r.status_code for r in bad] == [400, 404, 400, 400]
    assert good.status_code == 200, good.text
    assert router.scheduler.admission.reserved == 0 and router.scheduler.num_live == 0


def test_worker_threads_default_to_the_cores_shared_by_concurrent_ranks():
    import os

    import torch

    from deployments.workers.base import set_torch_threads

    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        assert set_torch_threads(None) == cores == torch.get_num_threads()
        assert set_torch_threads(None, concurrent_workers=2 * cores) == 1
        assert set_torch_threads(3) == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_chat_without_a_chat_template_is_a_clear_400(setup):
    config, broker, router = setup
    router.tokenizer.chat_template = None

    async def go():
        async with client(router) as c:
            return await c.post("/v1/chat/completions", json={"model": "tiny", "messages": [
                {"role": "user", "content": "hi"}]})

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"


def test_bad_requests_do_not_disturb_a_stream_in_the_same_batch(setup, tiny_model_dirs, monkeypatch):
    """Over real HTTP (uvicorn): a burst of bad requests arrives while a good stream is mid-generation."""
    config, broker, router = setup
    bad_bodies = [{"prompt": [99999]}, {"max_tokens": 100000}, {"temperature": -1}, {"prompt": [1] * 300},
                  {"model": "nope"}, {"stop": [""]}]
    good = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    # the good stream's first round goes; its next ones wait until the burst below has its answers (or one of the
    # bad requests got into the scheduler, where only a round would answer it)
    with http_server(router) as base, HeldRounds(broker, monkeypatch, free=1) as rounds, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        text, burst, live, passed = "", None, None, None
        with httpx.stream("POST", f"{base}/v1/completions", json=good, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if burst is None:
                        burst = pool.submit(lambda: [
                            httpx.post(f"{base}/v1/completions", timeout=60,
                                       json={"model": "tiny", "prompt": PROMPT_IDS, **b}).status_code
                            for b in bad_bodies])
                        until(lambda: burst.done() or router.scheduler.num_live > 1, "the bad requests' answers")
                        live, passed = router.scheduler.num_live, rounds.passed
                        rounds.release()
        statuses = burst.result(timeout=60)
    assert passed == 1, "the bad requests were answered between the good stream's first round and its second"
    assert live == 1, "no bad request joined the good one in the scheduler"
    assert all(400 <= s < 500 for s in statuses), statuses
    assert text == plain_reference(tiny_model_dirs, PROMPT_IDS, 60)


def test_api_key_from_a_file_and_no_text_in_logs(tiny_model_dirs, tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    (tmp_path / "key").write_text("from-file\n")
    config = tiny_config(tiny_model_dirs, api_key_file=str(tmp_path / "key"))
    router = Router(config, LocalBroker(config))
    secret_prompt = "w7 w8 w9 w10 w11"

    async def go():
        async with client(router) as c:
            denied = await c.post("/v1/completions", json={"model": "tiny", "prompt": secret_prompt})
            ok = await c.post("/v1/completions", json={"model": "tiny", "prompt": secret_prompt, "max_tokens": 4,
                                                       "ignore_eos": True},
                              headers={"Authorization": "Bearer from-file"})
            return denied, ok

    with caplog.at_level(logging.DEBUG):
        denied, ok = asyncio.run(go())
    assert denied.status_code == 401 and ok.status_code == 200
    completion = ok.json()["choices"][0]["text"]
    assert secret_prompt not in caplog.text and completion not in caplog.text
    with pytest.raises(RuntimeError, match="cannot be read"):
        Router(tiny_config(tiny_model_dirs, api_key_file=str(tmp_path / "missing")), LocalBroker(config))


@pytest.mark.parametrize("role", ["draft", "target"])
def test_worker_with_a_missing_or_corrupt_model_fails_fast_naming_the_file(tiny_model_dirs, tmp_path, role):
    from deployments.errors import StartupError
    from deployments.workers.draft import DraftWorkerCore
    from deployments.workers.target import TargetWorkerCore
    from engine.models.loading import ModelLoadError

    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"not a gguf file")
    base = tiny_config(tiny_model_dirs).engine_config()
    for path in [tmp_path / "missing.gguf", corrupt]:
        config = dataclasses.replace(base, **{role: str(path)})
        # a file that is not there is a configuration error: one StartupError naming it (deployments/workers/base.py)
        with pytest.raises((StartupError, ModelLoadError, ValueError, OSError), match=path.name):
            DraftWorkerCore(config) if role == "draft" else TargetWorkerCore(config)


def test_a_request_waiting_for_a_new_target_replica_does_not_hold_up_the_others(setup, tiny_model_dirs):
    config, broker, router = setup
    broker.fail_at_call["target"] = 3  # request A's replica dies at its third round ...
    broker.held_target_leases.add("A")  # ... and its replacement is slow to come

    async def text_of(prompt, request_id, n):
        text = ""
        async for out in router.scheduler.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                          ignore_eos=True), request_id=request_id):
            text += out.new_text
        return text

    async def go():
        a = asyncio.create_task(text_of(PROMPT_IDS, "A", 30))
        while router.scheduler.stats.replica_failures == 0:
            await asyncio.sleep(0.01)
        b = await asyncio.wait_for(text_of([9, 8, 7, 6], "B", 12), 60)  # B runs its rounds meanwhile
        assert not a.done(), "A is still waiting for its lease"
        broker.release_leases.set()
        return await asyncio.wait_for(a, 60), b

    a, b = asyncio.run(go())
    assert a == plain_reference(tiny_model_dirs, PROMPT_IDS, 30)
    assert b == plain_reference(tiny_model_dirs, [9, 8, 7, 6], 12)
    assert broker.open_leases == {"draft": 0, "target": 0}


def test_a_repeated_prompt_reads_its_prefix_from_the_cache_and_usage_says_how_much(tiny_model_dirs):
    """bf16 weights on a CPU with AVX512_BF16 (layout-invariant: the prefix cache is on): the second request with
    the same prompt copies all but its last token from the cache, the text is the first one's, and its usage reports
    the copied tokens in OpenAI's `prompt_tokens_details.cached_tokens`; /stats counts them."""
    from deployments.metrics import ServingMetrics
    from engine.models.static.prefix_cache import why_layout_variant
    from tests.deployments.test_metrics import RecordingBackend

    config = tiny_config(tiny_model_dirs, model={"target_dtype": "bfloat16"})
    broker = LocalBroker(config)
    runner = broker.cores["target"].runner
    if getattr(runner, "prefix_cache", None) is None:
        pytest.skip(f"no layout-invariant forward here: {why_layout_variant(runner.model)}")
    backend = RecordingBackend()
    router = Router(config, broker, metrics=ServingMetrics("tiny", backend))
    prompt = [5 + (i * 7) % 40 for i in range(30)]

    async def go():
        async with client(router) as c:
            first = await complete(c, prompt=prompt)
            second = await complete(c, prompt=prompt)
            stats = (await c.get("/stats")).json()
            return first.json(), second.json(), stats

    first, second, stats = asyncio.run(go())
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert stats["prefix_cache"] == {"prompt_tokens": 2 * len(prompt), "cached_prompt_tokens": len(prompt) - 1}
    assert backend.total("counters", "specserve_prompt_tokens_cached") == len(prompt) - 1
