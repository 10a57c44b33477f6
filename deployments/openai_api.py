"""The OpenAI-compatible HTTP API: request models, error JSON, and the FastAPI app over a `Router`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events ending in
`data: [DONE]`), GET /v1/models, GET /health (200 once completions can run, 503 before). Extension fields:
`speculative: {"k": int, "enabled": bool, "adaptive": bool, "overlap": bool}`, `top_k`, `ignore_eos`;
`usage.speculative` reports the request's rounds, drafted and accepted tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int | None = Field(None, ge=0, le=16, description="draft tokens per round for this request")
    enabled: bool = Field(True, description="false: plain target decoding for this request")
    adaptive: bool | None = Field(None, description="false: exactly k drafts every round, whatever the acceptance "
                                                    "or the load (default: the server's policy)")
    overlap: bool | None = Field(None, description="false: no drafting ahead for this request on a server with "
                                                   "speculation.overlap (default: the server's setting)")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    # vLLM's sampling parameters (engine/sampling.SamplingParams; the ids are checked against the vocabulary by the
    # router)
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

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(..., description="text, or token ids")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)


def usage_json(prompt_tokens: int, completion_tokens: int, stats) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculative": stats.as_dict() if stats is not None else None,
    }


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/stats")


def _route_label(path: str) -> str:
    """A bounded metric label: unknown paths (scanners, fuzzers) share one value."""
    return path if path in ROUTES else "other"


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def create_app(router) -> FastAPI:
    """The FastAPI app serving `router` (a deployments.router.Router)."""
    app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server")

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
                "draft_lease_ms_per_round": ms_per_round(st.draft_lease_seconds),
                "draft_ms_per_round": ms_per_round(st.timings.draft_seconds),
                "verify_ms_per_round": ms_per_round(st.timings.verify_seconds),
                "draft_compute_ms_per_round": ms_per_round(st.draft_compute_seconds),
                "verify_compute_ms_per_round": ms_per_round(st.verify_compute_seconds)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": router.model_name, "object": "model", "created": 0,
                                            "owned_by": "specserve"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, router.prepare_completion(body), chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(body, router.prepare_chat(body), chat=True, request=request)

    async def _serve(body, prepared, chat: bool, request: Request):
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        outputs = router.run(prepared, rid, getattr(request.state, "admission_slot", None))
        if not body.stream:
            text, last = "", None
            async for out in outputs:
                text += out.new_text
                last = out
            choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return {"id": rid, "object": obj, "created": created, "model": router.model_name, "choices": [choice],
                    "usage": usage_json(last.num_prompt_tokens, last.num_output_tokens, last.stats)}

        first = await _first(outputs)  # admission errors become HTTP errors, before the stream starts
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if role else (
                    {"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": chunk_obj, "created": created, "model": router.model_name,
                    "choices": [choice]}

        async def events():
            last = first
            try:
                if chat:
                    yield _sse(chunk("", None, role=True))
                out = first
                while True:
                    if out.new_text or out.finished:
                        yield _sse(chunk(out.new_text, out.finish_reason))
                    last = out
                    if out.finished:
                        break
                    out = await outputs.__anext__()
                if include_usage:
                    yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": router.model_name,
                                "choices": [], "usage": usage_json(last.num_prompt_tokens, last.num_output_tokens,
                                                                   last.stats)})
                yield _sse("[DONE]")
            except Exception as exc:  # after the 200 header an error can only travel in the stream
                yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            finally:
                await outputs.aclose()  # client gone or done: abort the request, free its caches

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _first(outputs):
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a request always yields at least its final output
        raise APIError(500, "the request produced no output", type_="server_error")
