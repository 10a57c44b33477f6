"""Structured-output request fields: OpenAI's `response_format` and vLLM's `structured_outputs`, mapped to the
engine's GrammarSpec (engine/request/grammar.py) and compiled at the router before the request is admitted, so a bad
schema, regex or grammar is a 400 naming its parameter and never reaches the scheduler or the workers.

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (OpenAI's shapes).
- `structured_outputs` (vLLM's StructuredOutputsParams): exactly one of `json` (a schema, as an object or JSON text),
  `regex`, `choice` (a list of strings), `grammar` (EBNF / GBNF or Lark, as llguidance reads them), `json_object`;
  `disable_any_whitespace` (JSON kinds: no whitespace outside strings); `disable_fallback` (accepted: there is
  one grammar backend, so nothing to fall back to). vLLM's other fields are refused (extra fields: 400).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.errors import APIError
from engine.request.grammar import GrammarCompiler, GrammarError, GrammarSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = Field(None, description="the schema's name (not used for generation)")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema the output must validate against")
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json", description="a JSON schema (an object or its JSON text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF (GBNF) or Lark grammar")
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False


def grammar_spec(body) -> tuple[GrammarSpec, str] | None:
    """A request's grammar and the parameter that set it, or None (unconstrained). APIError 400 when both fields
    constrain, or a field is incomplete."""
    fmt: ResponseFormat | None = getattr(body, "response_format", None)
    outputs: StructuredOutputs | None = getattr(body, "structured_outputs", None)
    if fmt is not None and fmt.type != "text" and outputs is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", param="structured_outputs")
    if fmt is not None and fmt.type != "text":
        return _from_response_format(fmt), "response_format"
    if outputs is not None:
        return _from_structured_outputs(outputs), "structured_outputs"
    return None


def _from_response_format(fmt: ResponseFormat) -> GrammarSpec:
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
    return GrammarSpec.json_schema(fmt.json_schema.schema_)


def _from_structured_outputs(outputs: StructuredOutputs) -> GrammarSpec:
    given = {name: value for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                             ("choice", outputs.choice), ("grammar", outputs.grammar),
                                             ("json_object", outputs.json_object or None)) if value is not None}
    if len(given) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
                            f"(got {', '.join(given) or 'none'})", param="structured_outputs")
    (kind, value), = given.items()
    any_whitespace = not outputs.disable_any_whitespace
    try:
        if kind == "json":
            return GrammarSpec.json_schema(value, any_whitespace)
        if kind == "json_object":
            return GrammarSpec("json_object", "", any_whitespace)
        if kind == "choice":
            return GrammarSpec.choice(value)
        return GrammarSpec(kind, value)
    except GrammarError as exc:
        raise APIError(400, f"structured_outputs.{kind}: {exc}", param="structured_outputs") from exc


def checked_grammar(body, compiler: GrammarCompiler) -> GrammarSpec | None:
    """The request's grammar, compiled once here (the compiler caches it): a bad schema, regex or grammar is a
    400 naming `response_format` or `structured_outputs`."""
    found = grammar_spec(body)
    if found is None:
        return None
    spec, param = found
    if compiler.unavailable is not None:  # not the request's fault: no grammar at all can be compiled here
        raise APIError(400, f"{param}: structured outputs are not available for this model: {compiler.unavailable}",
                       param=param, code="structured_outputs_unavailable")
    try:
        compiler.compile(spec)
    except GrammarError as exc:
        raise APIError(400, f"{param}: invalid {_what(spec)}: {exc}", param=param, code="invalid_grammar") from exc
    return spec


def _what(spec: GrammarSpec) -> str:
    return {"json": "JSON schema", "json_object": "JSON object format", "regex": "regular expression",
            "choice": "choice", "grammar": "grammar"}[spec.kind]
