"""POST /v1/completions and /v1/chat/completions: a request's choices run by the Router, merged into one response
or one stream of server-sent events ending in `data: [DONE]`.

Every choice (n per prompt) is its own sequence in the rounds; this module only interleaves their outputs, decodes
their logprobs (deployments/api/responses.py) and, for chat choices that may call tools, parses their text into
content and tool calls as it streams (deployments/api/tool_parsers.py). `usage.speculative` reports the request's
rounds, drafted and accepted tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from deployments.api.errors import APIError
from deployments.api.params import refuse_unsupported
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.responses import (
    CompletionLogprobs,
    TokenPieces,
    chat_logprobs,
    interleave,
    merged_usage,
    prompt_logprobs_json,
)
from deployments.api.tool_parsers import Assembled, delta_of, finish_reason, parser_for


def add_generation_routes(app: FastAPI, router) -> None:
    """The two generation routes on `app`, served by `router` (a deployments.router.router.Router)."""
    pieces = TokenPieces(router.tokenizer)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refuse_unsupported(body)
        return await _serve(router, pieces, body, router.prepare_completion(body), chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        refuse_unsupported(body)
        return await _serve(router, pieces, body, router.prepare_chat(body), chat=True, request=request)


async def _serve(router, pieces: TokenPieces, body, prepared: list, chat: bool, request: Request):
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


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


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
