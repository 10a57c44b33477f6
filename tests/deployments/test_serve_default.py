"""serve_config.yaml exactly as `make run` starts it (n-gram drafting, no Draft replicas) on a real local Ray
cluster: ready, greedy output equal to plain decoding of the target, n-gram rounds counted."""

import httpx
import pytest

from tests.deployments.serve_cluster import BASE, serve_app, served_target, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
# a prompt whose answer repeats its own words, so prompt lookup finds n-grams to draft (in process, fixed K=3: 18
# drafts, 5 accepted over 48 tokens)
PROMPT = "Write the Python function def add(a, b): return a + b and then explain it."


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    with serve_app(tmp_path_factory.mktemp("serve_default")):
        yield OpenAI(base_url=f"{BASE}/v1", api_key="unused", timeout=300)


def test_the_default_config_serves_plain_decodings_text_with_ngram_drafts(client):
    from engine import SamplingParams
    from engine.cli import encode_prompt
    from engine.speculative import SpeculativeEngine

    runner, tokenizer = served_target()
    reference = SpeculativeEngine(runner, tokenizer, None, 0).generate(
        [encode_prompt(tokenizer, PROMPT, True)], SamplingParams(max_tokens=48))[0].text

    def healthy() -> bool:
        health = httpx.get(f"{BASE}/health", timeout=10)
        assert "Draft" not in health.text, health.text  # n-gram drafting: no Draft replica to wait for
        return health.status_code == 200

    wait_until(healthy, 120, "/health to answer 200")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=48, temperature=0,
                                          extra_body={"speculative": {"k": 3, "adaptive": False}})
    assert chat.choices[0].message.content == reference
    spec = chat.usage.model_extra["speculative"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0, spec
