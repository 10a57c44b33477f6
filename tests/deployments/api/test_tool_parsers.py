"""deployments/api/tool_parsers.py: model outputs turned into content and tool calls, the same whether the text
arrives whole or in any split (what streaming and non-streaming answers rely on)."""

import json

import pytest

from deployments.api.tool_parsers import (
    Assembled,
    CallStart,
    Content,
    delta_of,
    finish_reason,
    parser_for,
)
from deployments.api.tools import ToolPlan

HERMES = ToolPlan("auto", parser="hermes")
LLAMA = ToolPlan("auto", parser="llama3_json")


def parsed(plan: ToolPlan, pieces: list[str]) -> dict:
    parser = parser_for(plan)
    message = Assembled()
    for piece in pieces:
        message.add(parser.feed(piece))
    message.add(parser.finish())
    out = message.message()
    return {"content": out["content"], "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                                 for c in out.get("tool_calls", [])]}


def every_split(plan: ToolPlan, text: str) -> list[dict]:
    """The result of `text` fed whole, one character at a time, and split at every place."""
    return ([parsed(plan, [text]), parsed(plan, list(text))]
            + [parsed(plan, [text[:i], text[i:]]) for i in range(1, len(text))])


CASES = [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     {"content": "Let me look.", "calls": [("get_weather", {"city": "Paris"})]}),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
             '{"x": [1, 2]}}</tool_call>\n',
     {"content": None, "calls": [("a", {}), ("b", {"x": [1, 2]})]}),
    (HERMES, '<tool_call>[{"name": "a", "arguments": {"k": 1}}, {"name": "b", "arguments": "{\\"j\\": 2}"}]'
             '</tool_call>', {"content": None, "calls": [("a", {"k": 1}), ("b", {"j": 2})]}),
    # ended at the closing tag's first token (a stop string), or cut by the length limit before it
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"k": 1}}\n', {"content": None, "calls": [("a", {"k": 1})]}),
    (HERMES, 'I use <tool_call>not json</tool_call> tags <tool', {"content": "I use <tool_call>not json</tool_call> "
                                                                        "tags <tool", "calls": []}),
    (HERMES, '  plain text, kept exactly \n', {"content": "  plain text, kept exactly \n", "calls": []}),
    (HERMES, '<tool_call>{"name": "a", "argu', {"content": '<tool_call>{"name": "a", "argu', "calls": []}),
    (LLAMA, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     {"content": None, "calls": [("get_weather", {"city": "Oslo"})]}),
    (LLAMA, ' {"name": "a", "parameters": {}}; {"name": "b", "arguments": {"q": "x;y"}}',
     {"content": None, "calls": [("a", {}), ("b", {"q": "x;y"})]}),
    (LLAMA, 'The answer is {"not": "a call"}.', {"content": 'The answer is {"not": "a call"}.', "calls": []}),
    (LLAMA, '{"name": "a", "parameters": {"k": 1}', {"content": '{"name": "a", "parameters": {"k": 1}', "calls": []}),
    (ToolPlan("required"), '[{"name":"a","parameters":{"k":1}},{"name":"b","parameters":{}}]',
     {"content": None, "calls": [("a", {"k": 1}), ("b", {})]}),
    (ToolPlan("required"), '[{"name":"a","param', {"content": '[{"name":"a","param', "calls": []}),
]


@pytest.mark.parametrize("plan, text, expected", CASES)
def test_outputs_parse_into_content_and_calls_in_any_split(plan, text, expected):
    results = every_split(plan, text)
    assert results[0] == expected
    assert all(r == expected for r in results), [r for r in results if r != expected][:1]


def test_a_named_function_s_arguments_stream_as_they_come():
    parser = parser_for(ToolPlan("named", function="get_weather"))
    first = parser.feed('{"ci')
    assert isinstance(first[0], CallStart) and first[0].name == "get_weather" and first[0].index == 0
    assert delta_of(first) == {"tool_calls": [{"index": 0, "id": first[0].id, "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"ci'}}]}
    assert delta_of(parser.feed('ty":"Oslo"}')) == {"tool_calls": [{"index": 0,
                                                                     "function": {"arguments": 'ty":"Oslo"}'}}]}
    assert parser.finish() == [] and parser.count == 1


def test_call_ids_are_distinct_and_streamed_deltas_carry_each_call_once():
    parser = parser_for(HERMES)
    events = parser.feed('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "a", '
                         '"arguments": {}}</tool_call>') + parser.finish()
    delta = delta_of(events)
    assert delta["content"] == "Hi"  # the blank before a call is dropped
    ids = [call["id"] for call in delta["tool_calls"]]
    assert [c["index"] for c in delta["tool_calls"]] == [0, 1] and len(set(ids)) == 2
    assert all(i.startswith("call_") for i in ids)
    assert delta_of([Content("")]) is None


def test_a_reply_that_called_finishes_with_tool_calls_unless_cut_short():
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("length", 1) == "length"
    assert finish_reason("stop", 0) == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
           '</tool_call>')
    assert parsed(ToolPlan("auto", parser="hermes", single=True), [two])["calls"] == [("a", {})]
    assert parsed(ToolPlan("auto", parser="llama3_json", single=True),
                  ['{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'])["calls"] == [("a", {})]
    assert [c for c, _ in parsed(HERMES, [two])["calls"]] == ["a", "b"]
