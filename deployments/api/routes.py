"""The OpenAI-compatible HTTP API: request models and the FastAPI app over a `Router`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events ending in
`data: [DONE]`), GET /v1/models, POST /tokenize and /detokenize (vLLM's shapes), GET /health (200 once completions
can run, 503 before), GET /stats. Extension fields: `speculative: {"k": int, "enabled": bool, "adaptive": bool,
"overlap": bool}`, `top_k`, `ignore_eos`, vLLM's sampling parameters and `prompt_logprobs`; `usage.speculative`
reports the request's rounds, drafted and accepted tokens. Chat completions take OpenAI's `tools` / `tool_choice`
(deployments/api/tools.py; the output parsed by deployments/api/tool_parsers.py).

The request models declare what the server implements; any other field a client sends is refused with a 400
naming it unless it carries its unused value (deployments/api/params.py). Response shapes: api_responses.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api.errors import APIError
from deployments.api.params import refuse_unsupported
from deployments.api.responses import (
    CompletionLogprobs,
    TokenPieces,
    chat_logprobs,
    interleave,
    merged_usage,
    prompt_logprobs_json,
)
from deployments.api.structured import ResponseFormat, StructuredOutputs
from deployments.api.tool_parsers import Assembled, delta_of, finish_reason, parser_for
from deployments.api.tools import Tool, ToolCall, ToolChoice, template_tool_calls
from engine.request.sampling import MAX_LOGPROBS

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "create_app"]


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int | None = Field(None, ge=0, le=16, description="draft tokens per round for this request")
    enabled: bool = Field(True, description="false: plain target decoding for this request")
    adaptive: bool | None = Field(None, description="false: exactly k drafts every round, whatever the acceptance "
                                                    "or the load (default: the server's policy)")
    overlap: bool | None = Field(None, description="false: no drafting ahead for this request on a server with "
                                                   "speculation.overlap (default: the server's setting)")


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


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/stats", "/tokenize", "/detokenize")


def _route_label(path: str) -> str:
    """A bounded metric label: unknown paths (scanners, fuzzers) share one value."""
    return path if path in ROUTES else "other"


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def create_app(router) -> FastAPI:
    """The FastAPI app serving `router` (a deployments.router.router.Router)."""
    app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server")
    pieces = TokenPieces(router.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", param=None, code="invalid_json").response()
        return APIError(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc or None,
                        code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), type_="invalid_request_error").response()

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        try:
            router.check_http(request)
            slot = router.admit(request)
        except APIError as exc:
            router.metrics.http(_route_label(request.url.path), exc.status)
            return exc.response()
        request.state.admission_slot = slot
        try:
            response = await call_next(request)
        finally:
            if slot is not None:
                slot.release()  # the request ended before reaching the scheduler (a 4xx, say); else a no-op
        router.metrics.http(_route_label(request.url.path), response.status_code)
        return response

    @app.get("/health")
    async def health():  # 503 until the model replicas can be leased (not Serve's own /-/healthz: readiness.py)
        return await router.health()

    @app.get("/stats")
    async def stats():
        st = router.scheduler.stats
        ms_per_round = lambda seconds: 1000 * seconds / max(1, st.timings.rounds)  # noqa: E731
        return {"live_sequences": router.scheduler.num_live, "current_k": router.scheduler.current_k(),
                "rounds": st.timings.rounds, "max_batch": st.timings.max_batch, "mean_batch": st.timings.mean_batch,
                "replica_failures": st.replica_failures, "speculative": st.spec.as_dict(),
                "ahead": {"drafts": st.ahead_drafts, "used": st.ahead_used, "cancelled": st.ahead_cancelled},
                "chained_rounds": st.chained_rounds,
                "cost_profiles": router.scheduler.cost_profiles(),
                "orchestration_ms_per_round": ms_per_round(st.orchestration_seconds),
                "prefill_chunks": st.prefill_chunks, "draft_prefill_chunks": st.draft_prefill_chunks,
                "prefix_cache": {"prompt_tokens": st.prompt_tokens, "cached_prompt_tokens": st.cached_prompt_tokens},
                "draft_lease_ms_per_round": ms_per_round(st.draft_lease_seconds),
                "draft_ms_per_round": ms_per_round(st.timings.draft_seconds),
                "verify_ms_per_round": ms_per_round(st.timings.verify_seconds),
                "draft_compute_ms_per_round": ms_per_round(st.draft_compute_seconds),
                "verify_compute_ms_per_round": ms_per_round(st.verify_compute_seconds)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": router.model_name, "object": "model", "created": 0,
                                            "owned_by": "specserve", "root": router.model_name, "parent": None,
                                            "max_model_len": router.config.model.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = router.tokenize(body)
        return {"count": len(ids), "max_model_len": router.config.model.max_model_len, "tokens": ids,
                "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return {"prompt": router.detokenize(body)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refuse_unsupported(body)
        return await _serve(body, router.prepare_completion(body), chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        refuse_unsupported(body)
        return await _serve(body, router.prepare_chat(body), chat=True, request=request)

    async def _serve(body, prepared: list, chat: bool, request: Request):
        """Every choice of the request (n per prompt), merged into one response or one event stream."""
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        choices = router.choices(prepared, body.n)
        slots = router.more_slots(getattr(request.state, "admission_slot", None), len(choices))
        streams = [router.run(p, f"{rid}-{i}" if len(choices) > 1 else rid, slot)
                   for i, (p, slot) in enumerate(zip(choices, slots))]
        echo = [_echo(router.tokenizer, p) if getattr(body, "echo", False) else "" for p in choices]
        texts = list(echo)
        # chat choices that may call tools: their text is parsed into content and tool calls as it streams
        parsers = [parser_for(p.tools) if chat and p.tools is not None else None for p in choices]
        completion_lps = [CompletionLogprobs() for _ in choices]
        chat_lps: list[list[dict]] = [[] for _ in choices]
        finals: list = [None] * len(choices)

        def add_logprobs(i: int, out) -> dict | None:
            """The choice's logprobs for `out`'s tokens (kept for the whole response too), or None: not asked."""
            if out.logprobs is None:
                return None
            if chat:
                entries = chat_logprobs(pieces, out.new_token_ids, out.logprobs)
                chat_lps[i].extend(entries)
                return {"content": entries, "refusal": None}
            return completion_lps[i].add(pieces, out.new_token_ids, out.logprobs).json()

        try:
            firsts = await asyncio.gather(*(_first(s) for s in streams))  # admission errors: HTTP errors
        except BaseException:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise
        # a request's first output carries its prompt logprobs: echoed with the completion's logprobs, and in vLLM's
        # `prompt_logprobs` field (a completion's choices; chat's response)
        echo_lps = [completion_lps[i].add_prompt(pieces, p.prompt_ids, firsts[i].prompt_logprobs, body.logprobs).json()
                    if getattr(body, "echo", False) and body.logprobs is not None else None
                    for i, p in enumerate(choices)]
        prompt_lps = [None if f.prompt_logprobs is None else prompt_logprobs_json(pieces, p.prompt_ids,
                                                                                  f.prompt_logprobs)
                      for p, f in zip(choices, firsts)] if not body.stream else []

        if not body.stream:
            async for i, out in interleave([_prefixed(f, s) for f, s in zip(firsts, streams)]):
                texts[i] += out.new_text
                add_logprobs(i, out)
                finals[i] = out
            result = []
            for i, last in enumerate(finals):
                asked = last.logprobs is not None
                choice = {"index": i, "finish_reason": last.finish_reason,
                          "logprobs": (({"content": chat_lps[i], "refusal": None} if chat
                                        else completion_lps[i].json()) if asked else None)}
                if parsers[i] is not None:
                    message = Assembled()
                    message.add(parsers[i].feed(texts[i]) + parsers[i].finish())
                    choice["message"] = message.message()
                    choice["finish_reason"] = finish_reason(last.finish_reason, parsers[i].count)
                else:
                    choice.update({"message": {"role": "assistant", "content": texts[i]}} if chat else
                                  {"text": texts[i], "prompt_logprobs": prompt_lps[i]})
                result.append(choice)
            response = {"id": rid, "object": obj, "created": created, "model": router.model_name, "choices": result,
                        "usage": merged_usage(finals, len(prepared))}
            if chat:
                response["prompt_logprobs"] = prompt_lps[0]  # one prompt for all choices (vLLM's place)
            return response

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish: str | None, logprobs: dict | None = None,
                  role: bool = False, delta: dict | None = None) -> dict:
            if chat:
                if delta is None:
                    delta = {"role": "assistant", "content": text or ""} if role else (
                        {"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return {"id": rid, "object": chunk_obj, "created": created, "model": router.model_name,
                    "choices": [choice]}

        async def events():
            merged = interleave([_prefixed(f, s) for f, s in zip(firsts, streams)])
            try:
                for i in range(len(choices)):
                    if chat:
                        yield _sse(chunk(i, "", None, role=True))
                    elif echo[i] or echo_lps[i]:
                        yield _sse(chunk(i, echo[i], None, echo_lps[i]))
                async for i, out in merged:
                    logprobs = add_logprobs(i, out)
                    if parsers[i] is not None:
                        events = parsers[i].feed(out.new_text) + (parsers[i].finish() if out.finished else [])
                        delta = delta_of(events)
                        finish = finish_reason(out.finish_reason, parsers[i].count)
                        if delta or out.finished or logprobs:
                            yield _sse(chunk(i, None, finish, logprobs, delta=delta or {}))
                    elif out.new_text or out.finished or logprobs:
                        yield _sse(chunk(i, out.new_text, out.finish_reason, logprobs))
                    finals[i] = out
                if include_usage:
                    yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": router.model_name,
                                "choices": [], "usage": merged_usage(finals, len(prepared))})
                yield _sse("[DONE]")
            except Exception as exc:  # after the 200 header an error can only travel in the stream
                known = isinstance(exc, APIError)
                yield _sse({"error": {"message": str(exc), "type": exc.type if known else "server_error",
                                      "param": exc.param if known else None, "code": exc.code if known else None}})
            finally:
                await merged.aclose()  # client gone or done: abort the requests, free their caches

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _echo(tokenizer, prepared) -> str:
    """The prompt `echo` puts before a completion: its text as sent, or its token ids decoded."""
    return prepared.prompt_text if prepared.prompt_text is not None else tokenizer.decode(prepared.prompt_ids)


async def _first(outputs):
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a request always yields at least its final output
        raise APIError(500, "the request produced no output", type_="server_error")


async def _prefixed(first, rest):
    """`first`, then what `rest` yields (a stream whose first output was awaited already); closing it closes
    `rest` (which aborts its request)."""
    try:
        yield first
        if not first.finished:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()
