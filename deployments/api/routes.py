"""The OpenAI-compatible HTTP API: the FastAPI app over a `Router`.

Routes: POST /v1/completions and /v1/chat/completions (deployments/api/generation.py), GET /v1/models, POST
/tokenize and /detokenize (vLLM's shapes), GET /health (200 once completions can run, 503 before), GET /stats; with
`dev_endpoints`, /pause, /resume and /is_paused (deployments/api/dev_routes.py). Here:
the app, its error answers (OpenAI's error JSON, deployments/api/errors.py), the middleware that checks and admits a
request before its body is read, and the small routes. Request models: deployments/api/request_models.py; response
shapes: deployments/api/responses.py.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api.dev_routes import DEV_ROUTES, add_dev_routes
from deployments.api.errors import APIError
from deployments.api.generation import add_generation_routes
from deployments.api.request_models import DetokenizeRequest, TokenizeRequest

__all__ = ["create_app"]


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/stats", "/tokenize", "/detokenize",
          *DEV_ROUTES)


def _route_label(path: str) -> str:
    """A bounded metric label: unknown paths (scanners, fuzzers) share one value."""
    return path if path in ROUTES else "other"


def create_app(router) -> FastAPI:
    """The FastAPI app serving `router` (a deployments.router.router.Router)."""
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
                "prefix_cache": {"prompt_tokens": st.prompt_tokens, "cached_prompt_tokens": st.cached_prompt_tokens},
                "draft_lease_ms_per_round": ms_per_round(st.draft_lease_seconds),
                "draft_ms_per_round": ms_per_round(st.timings.draft_seconds),
                "verify_ms_per_round": ms_per_round(st.timings.verify_seconds),
                "draft_compute_ms_per_round": ms_per_round(st.draft_compute_seconds),
                "verify_compute_ms_per_round": ms_per_round(st.verify_compute_seconds),
                "target_draft_compute_ms_per_round": ms_per_round(st.target_draft_compute_seconds)}

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

    add_generation_routes(app, router)
    if router.config.dev_endpoints:
        add_dev_routes(app, router)
    return app
