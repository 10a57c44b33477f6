"""The application on a real local Ray cluster, started as the README says (`ray start`, then `serve run` of
serve_config.yaml with a draft model instead of its n-gram default, so Draft replicas run), driven by the openai
client."""

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

import httpx
import pytest

from tests.deployments.serve_cluster import served_target

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def cluster(readme_app_with_draft_model):
    return readme_app_with_draft_model[0]


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy decoding of the same target, in-process."""
    from engine import SamplingParams
    from engine.cli import encode_prompt
    from engine.speculative import SpeculativeEngine

    runner, tokenizer = served_target()
    engine = SpeculativeEngine(runner, tokenizer, None, 0)

    def run(prompt: str, chat: bool, n: int, ignore_eos: bool = False) -> str:
        ids = encode_prompt(tokenizer, prompt, chat)
        return engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=ignore_eos))[0].text

    return run


def test_completions_and_chat_equal_plain_decoding(client, reference):
    # fixed K, so the text is checked with drafts in it: the adaptive policy plans from the costs and acceptance this
    # router has seen (test_observability's requests ran before on this cluster), and on a busy machine may not draft
    comp = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=32,
                                     temperature=0, extra_body={"speculative": {"k": 3, "adaptive": False}})
    assert comp.choices[0].text == reference("The three primary colors are", False, 32)
    assert comp.usage.completion_tokens <= 32 and comp.usage.prompt_tokens > 0
    spec = comp.model_extra.get("usage", {}) or comp.usage.model_extra["speculative"]
    assert spec["num_draft_tokens"] > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=32, temperature=0)
    assert chat.choices[0].message.content == reference(QUESTION, True, 32)
    assert "Paris" in chat.choices[0].message.content


def test_streaming_equals_non_streaming(client, reference):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(QUESTION, True, 32)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    comp_stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].text for c in comp_stream) == reference("Once upon a time", False, 24)


def test_eight_concurrent_streams_are_batched(client, reference):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def one(prompt):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, prompts))
    for prompt, text in zip(prompts, texts):
        assert text == reference(prompt, True, 24)
    stats = httpx.get("http://127.0.0.1:8000/stats").json()
    assert stats["max_batch"] >= 4, stats  # rounds carried several requests at once


# The draft worker is found by its actor name, not through a Serve handle of the Draft deployment: a fresh driver's
# handle once held its call for over 120 s without sending it (CI, the replica's log shows no call arriving).
# The driver connects and finds the worker first (seconds), then kills it when the test writes a line.
KILL_PINNED_DRAFT_WORKER = """
import json, ray, sys
ray.init(address="auto", log_to_driver=False)
(found,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("specserve-draft-")]
worker = ray.get_actor(found["name"], namespace=found["namespace"])
print("ready", flush=True)
sys.stdin.readline()
live = ray.get(worker.stats.remote(), timeout=60)["live_sequences"]
ray.kill(worker, no_restart=True)
print(json.dumps({"live_sequences": live}), flush=True)
"""
MAX_TOKENS = 256  # EOS ignored: dozens of rounds remain when the first text arrives


def test_killing_the_pinned_draft_worker_mid_stream_keeps_the_output(client, reference):
    """The only Draft replica is the one the request is pinned to; its worker is killed from another driver while the
    router is paused (/pause: dev_endpoints) between two rounds of the streaming request, so the kill lands
    mid-stream however busy the machine is; after /resume the request's next drafting round meets the dead worker."""
    prompt = "List the days of the week, one per line."
    failures_before = httpx.get("http://127.0.0.1:8000/stats").json()["replica_failures"]
    log = tempfile.TemporaryFile("w+")  # the driver's own log, read only when it fails
    killer = subprocess.Popen([sys.executable, "-c", KILL_PINNED_DRAFT_WORKER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "RAY_ADDRESS": "auto"})

    def driver_log() -> str:
        log.seek(0)
        return log.read()[-2000:]

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ready = pool.submit(killer.stdout.readline).result(timeout=120)
        assert ready.strip() == "ready", (ready, driver_log())
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                # fixed K: the adaptive policy may not draft at all on a busy machine
                                                extra_body={"ignore_eos": True,
                                                            "speculative": {"k": 3, "adaptive": False}})
        text, killed, paused = "", None, None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if killed is None and text:
                paused = httpx.post("http://127.0.0.1:8000/pause", timeout=120).json()
                try:
                    out, _ = killer.communicate("kill\n", timeout=120)
                finally:
                    httpx.post("http://127.0.0.1:8000/resume", timeout=120)
                assert killer.returncode == 0, driver_log()
                killed = json.loads(out.strip().splitlines()[-1])
    finally:
        if killer.poll() is None:
            killer.kill()
        log.close()
    assert paused == {"paused": True, "live_sequences": 1}, "the paused router held the request"
    assert killed is not None and killed["live_sequences"] == 1, "the request's sequence lived on that draft worker"
    failures = httpx.get("http://127.0.0.1:8000/stats").json()["replica_failures"] - failures_before
    assert failures >= 1, "a round of the request met the dead draft worker"
    assert text == reference(prompt, True, MAX_TOKENS, ignore_eos=True)
    # Serve's health check replaces the broken Draft replica; later requests still succeed
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=16, temperature=0)
    assert after.choices[0].message.content == reference(QUESTION, True, 16)
