"""OpenAI tool calling on chat completions: the request's `tools` and `tool_choice`, the tool-call fields of a
conversation's messages, and what a request's choice of tool asks of generation.

- `tool_choice: "none"`: the tools reach the model through its chat template; the output is text.
- `"auto"` (the default when tools are given): the model decides; its output is parsed into `message.tool_calls`
  by the server's tool-call parser (`model.tool_call_parser`: deployments/api/tool_parsers.py), vLLM's behaviour.
- `"required"` and a named function (`{"type": "function", "function": {"name": ...}}`): generation is constrained
  by the grammar engine structured outputs use (engine/request/grammar.py, llguidance), as vLLM constrains them:
  a named function's output is its arguments, a JSON object valid against its `parameters` schema; "required"'s is
  a JSON array of `{"name", "parameters"}` objects, one of the tools each (at most one with
  `parallel_tool_calls: false`), written compactly (no whitespace outside strings: vLLM's
  `disable_any_whitespace`, so a model cannot spend its tokens on blanks). Drafted tokens are masked by the same
  grammar, so speculation keeps the constrained distribution exactly (the rejection rule sees masked
  distributions).

Every tool's `parameters` schema is compiled here (cached by the compiler), so an invalid one is a 400 naming it
whatever the choice. A model whose chat template never reads `tools` cannot be told about them: a request with
tools is refused with a 400 rather than generated (or, on /tokenize, rendered) without them (`model.chat_template`
can name a template that reads them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.errors import APIError
from engine.request.grammar import GrammarCompiler, GrammarError, GrammarSpec

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function declared without `parameters`


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; constrained calls always follow the schema")

    def schema_(self) -> dict:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str = Field(..., description="the arguments as JSON text (an object)")


class ToolCall(BaseModel):
    """A tool call of an assistant message the client sends back (its earlier answer)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ToolPlan:
    """How a choice's output becomes tool calls (deployments/api/tool_parsers.parser_for)."""

    mode: Literal["auto", "required", "named"]
    parser: str | None = None  # auto: the server's tool-call parser
    function: str | None = None  # named: the function called
    single: bool = False  # parallel_tool_calls: false: at most one call (auto: the first the model writes)


def template_tool_calls(message, index: int) -> list[dict]:
    """An assistant message's tool calls as chat templates read them (arguments as an object, vLLM's conversion);
    a 400 naming the field for arguments that are not a JSON object."""
    calls = []
    for j, call in enumerate(message.tool_calls):
        where = f"messages[{index}].tool_calls[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(400, f"{where} must be a JSON object (as text), got {call.function.arguments[:80]!r}",
                           param=where, code="invalid_tool_call")
        calls.append({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}})
    return calls


def check_conversation(messages) -> None:
    """Tool-call fields where they belong: `tool_calls` on assistant messages only, `tool_call_id` on (and required
    by) tool messages, each answering a call of an earlier assistant message. A 400 naming the first that is not."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.tool_calls is not None and message.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls (this one is "
                                f"{message.role!r})", param=f"messages[{i}].tool_calls", code="invalid_tool_call")
        if message.role == "tool":
            if not message.tool_call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id (the id of the call it "
                                    "answers)", param=f"messages[{i}].tool_call_id", code="invalid_tool_message")
            if message.tool_call_id not in called:
                raise APIError(400, f"messages[{i}].tool_call_id {message.tool_call_id!r} answers no tool call of "
                                    "an earlier assistant message", param=f"messages[{i}].tool_call_id",
                               code="invalid_tool_message")
        elif message.tool_call_id is not None:
            raise APIError(400, f"messages[{i}]: only tool messages carry tool_call_id",
                           param=f"messages[{i}].tool_call_id", code="invalid_tool_message")
        called.update(call.id for call in message.tool_calls or ())


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template can show the model its tools (it reads the `tools` variable)."""
    return template is not None and re.search(r"\btools\b", template) is not None


def template_tools(tools: list[Tool] | None, template: str | None) -> list[dict] | None:
    """A request's tools as the chat template reads them, for chat completions and /tokenize alike (the one place
    they are rendered); None without tools. A 400 `tools_unsupported` where the template never reads `tools`: the
    model could not be told about them, and a prompt silently without them would mislead."""
    if not tools:
        return None
    if not template_reads_tools(template):
        raise APIError(400, "this model's chat template does not read `tools`, so the model cannot be told about "
                            "them (the server's model.chat_template can name a template that does)", param="tools",
                       code="tools_unsupported")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def plan_tools(body, parser: str | None, compiler: GrammarCompiler,
               template: str | None) -> tuple[ToolPlan | None, GrammarSpec | None, list[dict] | None]:
    """(how the output becomes tool calls, the grammar generation follows, the tools for the chat template) of a
    chat request; (None, None, None) without tools. 400s name the field at fault."""
    tools: list[Tool] = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools (none were given)", param="tool_choice")
        return None, None, None
    names = _check_tools(tools, compiler)
    rendered = template_tools(tools, template)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None, rendered
    if choice == "auto":
        if parser is None:
            raise APIError(400, 'tool_choice "auto" needs a tool-call parser, and this server has none '
                                "(model.tool_call_parser: hermes or llama3_json); \"required\" or a named function "
                                "work without one", param="tool_choice", code="tool_choice_unsupported")
        return ToolPlan("auto", parser=parser, single=body.parallel_tool_calls is False), None, rendered
    if compiler.unavailable is not None:
        raise APIError(400, f"tool_choice {_shown(choice)} needs constrained generation, which is not available "
                            f"for this model: {compiler.unavailable}", param="tool_choice",
                       code="structured_outputs_unavailable")
    if choice == "required":
        one = body.parallel_tool_calls is False
        return ToolPlan("required", single=one), _compiled(compiler, required_schema(tools, one)), rendered
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(sorted(names))})", param="tool_choice.function.name")
    schema = tools[names[name]].function.schema_()
    return ToolPlan("named", function=name), _compiled(compiler, schema), rendered


def required_schema(tools: list[Tool], at_most_one: bool = False) -> dict:
    """vLLM's schema for tool_choice "required": a non-empty array of calls, each one of the tools by name with
    its parameters."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": t.function.schema_()},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if at_most_one:
        schema["maxItems"] = 1
    return schema


def _check_tools(tools: list[Tool], compiler: GrammarCompiler) -> dict[str, int]:
    """Names valid and distinct, schemas that compile; {name: index}."""
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name {name!r}: names are 1-64 letters, digits, '_' or '-'",
                           param=f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tools[{i}].function.name {name!r} is also tools[{names[name]}]'s",
                           param=f"tools[{i}].function.name")
        names[name] = i
        if compiler.unavailable is None:
            try:
                compiler.compile(GrammarSpec.json_schema(tool.function.schema_()))
            except GrammarError as exc:
                raise APIError(400, f"tools[{i}].function.parameters: invalid JSON schema: {exc}",
                               param=f"tools[{i}].function.parameters", code="invalid_tool_schema") from exc
    return names


def _compiled(compiler: GrammarCompiler, schema: dict) -> GrammarSpec:
    spec = GrammarSpec.json_schema(schema, any_whitespace=False)  # compact: read by programs, never a blank loop
    try:
        compiler.compile(spec)
    except GrammarError as exc:  # each tool's schema compiled alone: the combination is at fault
        raise APIError(400, f"tool_choice: the tools' schemas do not combine into one grammar: {exc}",
                       param="tool_choice", code="invalid_tool_schema") from exc
    return spec


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
