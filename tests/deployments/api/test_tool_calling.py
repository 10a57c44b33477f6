"""Tool calling over real HTTP through the official `openai` client (router + scheduler + worker cores, no cluster),
on a tiny model whose chat template reads tools and which learned one agent loop (tests/deployments/conftest.py):
auto calls parsed by the hermes parser, streamed calls the client reassembles, a two-turn loop with a tool result,
"required" and named functions constrained by their schemas with speculation unchanged, and 400s naming the field
for bad tools and tool messages."""

import json

import jsonschema
import openai
import pytest

from deployments.router.router import Router
from tests.deployments.conftest import (
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    LocalBroker,
    http_server,
    tiny_config,
)

SCHEMA = WEATHER_TOOL["function"]["parameters"]
NOTE_TOOL = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}, "urgent": {"type": "boolean"}},
    "required": ["text", "urgent"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(tool_model_dirs):
    config = tiny_config(tool_model_dirs, model={"tool_call_parser": "hermes"},
                         speculation={"num_speculative_tokens": 3})
    router = Router(config, LocalBroker(config))
    with http_server(router) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), router


def _ask(client, messages=WEATHER_QUESTION, **kwargs):
    kwargs.setdefault("tools", [WEATHER_TOOL])
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, temperature=0, **kwargs)


def test_auto_parses_the_model_s_call_into_tool_calls(served):
    client, _ = served
    r = _ask(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.usage.model_extra["speculative"]["num_draft_tokens"] > 0, "the request was speculated"


def test_a_streamed_call_is_reassembled_by_the_client(served):
    client, _ = served
    with client.chat.completions.stream(model="tiny", messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                        max_tokens=100, temperature=0) as stream:
        pieces = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in pieces  # the call came as delta.tool_calls
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_two_turn_agent_loop_answers_from_the_tool_s_result(served):
    client, _ = served
    first = _ask(client).choices[0].message
    (call,) = first.tool_calls
    messages = WEATHER_QUESTION + [first.model_dump(exclude_none=True),
                                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = _ask(client, messages).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert second.message.content == WEATHER_ANSWER


def test_tool_choice_none_leaves_the_call_as_text(served):
    client, _ = served
    choice = _ask(client, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("<tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_s_arguments_follow_its_schema_with_speculation_unchanged(served, stream):
    client, _ = served
    outputs = {}
    for k in (0, 3):
        body = dict(tools=[WEATHER_TOOL, NOTE_TOOL], tool_choice=NAMED,
                    extra_body={"speculative": {"k": k, "adaptive": False}})
        if stream:
            with client.chat.completions.stream(model="tiny", messages=WEATHER_QUESTION, max_tokens=100,
                                                temperature=0, **body) as s:
                r = s.get_final_completion()
        else:
            r = _ask(client, **body)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        outputs[k] = call.function.arguments
    assert outputs[3] == outputs[0], "greedy speculation under the tool's grammar equals plain decoding"


def test_required_calls_one_of_the_tools_with_valid_arguments(served):
    client, _ = served
    r = _ask(client, tools=[WEATHER_TOOL, NOTE_TOOL], tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls  # parallel_tool_calls: false allows one
    tool = {"get_weather": WEATHER_TOOL, "take_note": NOTE_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    spec = r.usage.model_extra["speculative"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def _error(client, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, **kwargs)
    return info.value.body


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": WEATHER_QUESTION + [{"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": WEATHER_QUESTION + [{"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]},
     "messages[1].tool_call_id"),
    ({"messages": WEATHER_QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
])
def test_bad_tools_and_tool_messages_are_400s_naming_the_field(served, kwargs, param):
    client, _ = served
    error = _error(client, **kwargs)
    assert error["param"] == param, error
    assert error["message"]


def test_a_model_without_a_tool_template_or_a_server_without_a_parser_says_so(byte_model_dirs, tool_model_dirs):
    from deployments.api.errors import APIError
    from deployments.api.request_models import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": WEATHER_QUESTION,
                                                    "tools": [WEATHER_TOOL], "max_tokens": 50})
    no_template = Router(tiny_config(byte_model_dirs), broker=None)  # its template never reads tools
    with pytest.raises(APIError) as info:
        no_template.prepare_chat(request)
    assert (info.value.param, info.value.code) == ("tools", "tools_unsupported")
    no_parser = Router(tiny_config(tool_model_dirs, model={"tool_call_parser": None}), broker=None)
    with pytest.raises(APIError) as info:
        no_parser.prepare_chat(request)
    assert (info.value.param, info.value.code) == ("tool_choice", "tool_choice_unsupported")
    named = request.model_copy(update={"tool_choice": ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": WEATHER_QUESTION, "tool_choice": NAMED}).tool_choice})
    assert no_parser.prepare_chat(named)[0].tools.mode == "named"  # constrained choices need no parser


def test_tokenize_renders_the_tools_through_the_template(served):
    import httpx

    client, router = served
    body = {"model": "tiny", "messages": WEATHER_QUESTION}
    base = str(client.base_url).removesuffix("/v1/")
    plain = httpx.post(f"{base}/tokenize", json=body).json()["tokens"]
    with_tools = httpx.post(f"{base}/tokenize", json={**body, "tools": [WEATHER_TOOL]}).json()["tokens"]
    assert router.tokenizer.decode(with_tools).startswith("tools: get_weather")
    assert "get_weather" not in router.tokenizer.decode(plain)
