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


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_embedded_model_calls_tools_through_its_shipped_template(client):
    """Named and required calls are constrained to the tools' schemas; auto parses whatever the 135M model says
    (it rarely calls a tool by itself); a two-turn loop with the tool's result answers in text."""
    import json

    import jsonschema

    named = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=60, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert "speculative" in named.usage.model_extra

    required = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], temperature=0,
                                              max_tokens=80, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls", required.choices[0]
    for call in required.choices[0].message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    auto = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0,
                                          max_tokens=40).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        assert all(json.loads(c.function.arguments) is not None for c in auto.message.tool_calls)
    else:
        assert auto.finish_reason in ("stop", "length") and auto.message.content

    called = named.choices[0].message
    loop = QUESTION + [called.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=loop, tools=[WEATHER], temperature=0,
                                            max_tokens=40, tool_choice="none").choices[0]
    assert answer.message.content and not answer.message.tool_calls
