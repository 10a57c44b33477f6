"""What clients send: the request models of the OpenAI-compatible API (deployments/api/routes.py serves them).

Extension fields: `speculative: {"k": int, "enabled": bool, "adaptive": bool, "overlap": bool, "tree": bool}`, `top_k`,
`ignore_eos`, vLLM's sampling parameters and `prompt_logprobs`. Chat completions take OpenAI's `tools` /
`tool_choice` (deployments/api/tools.py). The models declare what the server implements; any other field a client
sends is refused with a 400 naming it unless it carries its unused value (deployments/api/params.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.errors import APIError
from deployments.api.structured import ResponseFormat, StructuredOutputs
from deployments.api.tools import Tool, ToolCall, ToolChoice, template_tool_calls
from engine.request.sampling import MAX_LOGPROBS


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int | None = Field(None, ge=0, le=16, description="draft tokens per round for this request")
    enabled: bool = Field(True, description="false: plain target decoding for this request")
    adaptive: bool | None = Field(None, description="false: exactly k drafts every round, whatever the acceptance "
                                                    "or the load (default: the server's policy)")
    overlap: bool | None = Field(None, description="false: no drafting ahead for this request on a server with "
                                                   "speculation.overlap (default: the server's setting)")
    tree: bool | None = Field(None, description="false: this request's drafts stay a chain on a server with "
                                                "speculation.tree (default: the server's setting)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    # undeclared fields are kept and checked by params.refuse_unsupported: implemented, neutral, or a 400
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, description="choices to generate (each an independent sample of the prompt)")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    # vLLM's sampling parameters (engine/request/sampling.SamplingParams; the ids are checked against the vocabulary by
    # the router)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit, "
                                                                  "clamped to [-100, 100]")
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="each prompt token's log-probability under the model, its rank "
                                                    "and the top n (vLLM's; not with stream)")
    # structured outputs (deployments/api/structured.py): OpenAI's and vLLM's ways to ask for a grammar
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (one set of choices per prompt)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="each token's log-probability and the top n alternatives")
    echo: bool = Field(False, description="the prompt's text before the completion's")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string or token list is one; a list of strings or token lists is many."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt) if prompt else [prompt]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types carry other fields: refused by their type
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields: params.MESSAGE_NEUTRAL
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier tool calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call whose result it carries")

    def template_dict(self, index: int) -> dict:
        """The message as the chat template reads it: text parts joined by newlines (vLLM's joining); tool calls
        with their arguments as objects, a tool message with its call's id."""
        where = f"messages[{index}].content"
        if self.content is None and not self.tool_calls:
            raise APIError(400, f"{where} is missing (a message without tool calls needs content)", param=where)
        if self.content is None or isinstance(self.content, str):
            text = self.content
        else:
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"{where}[{j}]: content parts of type {part.type!r} are not supported "
                                        "(this server serves a text model: only 'text' parts)",
                                   param=f"{where}[{j}].type", code="unsupported_content")
            text = "\n".join(part.text for part in self.content)
        message = {"role": self.role, "content": text if text is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self, index)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="each output token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="and the n most likely alternatives")
    # tool calling (deployments/api/tools.py)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools), "required", '
                                                             'or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per choice")

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, description="with messages: rendered by the chat template")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
