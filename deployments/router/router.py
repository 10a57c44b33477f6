"""The Router: checks and admits requests, then streams what the Scheduler's rounds produce.

`Router` is a plain class (unit-tested with an in-process lease broker): HTTP-level checks and admission at the door,
/health, the choices' admission places and their output streams; requests are checked and tokenized by its
`RequestPreparer` (deployments/router/prepare.py). `RouterServer` is its Ray Serve ingress deployment, holding
handles to the Draft and Target deployments.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import replace

from deployments.api.chat_template import chat_template_for
from deployments.api.dev_routes import DEV_ROUTES
from deployments.api.errors import APIError
from deployments.api.readiness import DeploymentState, DeploymentStatuses, Readiness, serve_statuses
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.routes import create_app
from deployments.config import SpecServeConfig
from deployments.errors import Overloaded, ReplicaGone, RequestFailed
from deployments.metrics import NullMetrics, observe
from deployments.router.admission import AdmissionSlot
from deployments.router.prepare import Prepared, RequestPreparer
from deployments.router.scheduler import Scheduler, SchedulerConfig
from engine.models.loading import eos_token_ids, load_tokenizer, resolve
from engine.request.grammar import GrammarCompiler, GrammarError

logger = logging.getLogger("ray.serve")


GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
RETRY_AFTER_S = 1  # what every overload refusal tells clients: the router's own, and Serve's backpressure (app.py)


def overloaded_error(exc: Overloaded) -> APIError:
    return APIError(503, f"server overloaded: {exc}", type_="server_overloaded", code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def not_ready_error(missing: list[str], states: dict[str, DeploymentState]) -> APIError:
    """/health's 503: the deployments no replica of which can be leased yet and, where Serve reports them, their
    states (a failed start names what to change: deployments/errors.StartupError), in the message and as
    `deployments` beside the error."""
    reasons = "; ".join(f"{name} {state.status}" + (f": {state.reason()}" if state.reason() else "")
                        for name, state in states.items())
    return APIError(503, f"not ready: no {' and no '.join(missing)} replica can be leased yet "
                         f"({reasons or 'still starting: loading the models'})",
                    type_="server_error", code="not_ready", headers={"Retry-After": str(RETRY_AFTER_S)},
                    details={"deployments": {name: state.wire() for name, state in states.items()}})


def load_api_key(config: SpecServeConfig) -> str | None:
    """The API key from the configured env var, else from the configured file; None: no auth."""
    key = os.environ.get(config.api_key_env)
    if not key and config.api_key_file:
        try:
            with open(config.api_key_file) as f:
                key = f.read().strip()
        except OSError as exc:  # a configured but unreadable key file must not silently disable auth
            raise RuntimeError(f"api_key_file {config.api_key_file!r} cannot be read: {exc}") from exc
        if not key:
            raise RuntimeError(f"api_key_file {config.api_key_file!r} is empty")
    return key or None


class Router:
    def __init__(self, config: SpecServeConfig, broker, tokenizer=None, metrics=None) -> None:
        self.config = config
        self.metrics = metrics or NullMetrics()
        resolved = resolve(config.model.target)
        self.tokenizer = tokenizer or load_tokenizer(resolved, config.model.trust_remote_code)
        template = chat_template_for(config.model.chat_template, config.model.target)
        if template is not None:
            self.tokenizer.chat_template = template
        self.scheduler = Scheduler(
            SchedulerConfig.of(config, eos_token_ids(resolved.directory, self.tokenizer)), self.tokenizer, broker)
        self.scheduler.metrics = self.metrics
        self.api_key = load_api_key(config)
        self.readiness = Readiness(broker, ("draft", "target") if self.scheduler.config.draft.remote else ("target",))
        # structured outputs: grammars are compiled here to be checked (each distinct one once), never masked here;
        # the tokenizer table is built now, not on the event loop under the first constrained request
        self.grammars = GrammarCompiler(self.tokenizer, len(self.tokenizer), self.scheduler.config.eos_token_ids)
        try:
            self.grammars.prepare()
        except GrammarError as exc:  # kept: constrained requests get a 400 saying so (structured.checked_grammar)
            logger.error("structured outputs are unavailable for this model: %s", exc)
        self.preparer = RequestPreparer(config, self.tokenizer, self.grammars)

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    # ---- HTTP-level checks (before the body is parsed) ------------------------------------------------------
    def check_http(self, request) -> None:
        api = request.url.path.startswith("/v1")
        if not api and request.url.path not in DEV_ROUTES:
            return
        if self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                               type_="authentication_error", code="invalid_api_key")
        if api and request.method == "POST":
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.config.limits.max_body_bytes:
                raise APIError(413, f"request body over {self.config.limits.max_body_bytes} bytes",
                               code="body_too_large")
            ctype = request.headers.get("content-type", "")
            if not ctype.startswith("application/json"):
                raise APIError(415, "Content-Type must be application/json", code="unsupported_media_type")

    def admit(self, request) -> AdmissionSlot | None:
        """At the door, before the body is read: a place under the admission limit for a generation request, or a
        503 at once (no parsing, no tokenization: a refusal stays cheap under a burst)."""
        if request.method != "POST" or request.url.path not in GENERATION_ROUTES:
            return None
        try:
            return self.scheduler.admit()
        except Overloaded as exc:
            raise overloaded_error(exc) from exc

    async def health(self) -> dict:
        """GET /health: 200 once a completion can lease the replicas it needs, 503 until then, saying why where Serve
        reports it (readiness.py)."""
        missing = await self.readiness.missing()
        if missing:
            raise not_ready_error(missing, await self.readiness.why(missing))
        return {"status": "ok", "live_sequences": self.scheduler.num_live}

    # ---- request preparation (deployments/router/prepare.py) ----------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> list[Prepared]:
        """One Prepared per prompt of the request (a list of prompts gives several)."""
        return self.preparer.completion(body)

    def prepare_chat(self, body: ChatCompletionRequest) -> list[Prepared]:
        return self.preparer.chat(body)

    def tokenize(self, body) -> list[int]:
        return self.preparer.tokenize(body)

    def detokenize(self, body) -> str:
        return self.preparer.detokenize(body)

    def choices(self, prepared: list[Prepared], n: int) -> list[Prepared]:
        """n choices per prompt, in OpenAI's order (prompt by prompt). Seeded requests give choice j the seed
        `seed + j` (vLLM's rule), so the choices differ and each repeats."""
        return [p if j == 0 or p.params.seed is None else replace(p, params=replace(p.params, seed=p.params.seed + j))
                for p in prepared for j in range(n)]

    def more_slots(self, slot: AdmissionSlot | None, count: int) -> list[AdmissionSlot | None]:
        """Admission places for `count` choices: the request's own (taken at the door) and one more per extra
        choice, each under the admission limit (503 when there is none; the places taken are given back)."""
        slots = [slot]
        try:
            for _ in range(count - 1):
                slots.append(self.scheduler.admit())
        except Overloaded as exc:
            for taken in slots[1:]:
                taken.release()
            raise overloaded_error(exc) from exc
        return slots

    async def run(self, prepared: Prepared, request_id: str, slot: AdmissionSlot | None = None):
        """The request's per-round outputs; scheduler errors become API errors."""
        stream = self.scheduler.generate(prepared.prompt_ids, prepared.params, prepared.speculation, request_id,
                                         slot=slot)
        last_t, last = None, None
        try:
            async for out in stream:
                now = time.perf_counter()
                if out.new_token_ids:
                    if last_t is None:
                        observe(self.metrics.first_token, now - prepared.arrival)
                    else:
                        observe(self.metrics.tokens, now - last_t, len(out.new_token_ids))
                    last_t = now
                last = out
                if out.finished:
                    observe(self.metrics.finished, out.num_prompt_tokens, out.num_output_tokens,
                            out.finish_reason, now - prepared.arrival, out.num_cached_tokens)
                yield out
        except Overloaded as exc:
            raise overloaded_error(exc) from exc
        except ReplicaGone as exc:
            raise APIError(503, str(exc), type_="server_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except RequestFailed as exc:  # failed on a worker after admission: this request only, the others go on
            raise APIError(500, str(exc), type_="server_error", code=exc.code) from exc
        finally:
            if last is not None and not last.finished:  # client gone or error: counted as aborted
                observe(self.metrics.finished, last.num_prompt_tokens, last.num_output_tokens, "abort",
                        time.perf_counter() - prepared.arrival, last.num_cached_tokens)
            await stream.aclose()


def build_router_server():
    """The Serve ingress class (built lazily so this module imports without a Ray cluster)."""
    from ray import serve

    @serve.ingress()
    class RouterServer:
        def __init__(self, config: dict, draft_handle, target_handle) -> None:
            from deployments.metrics import ServingMetrics
            from deployments.ray_env import warn_if_missing
            from deployments.router.leases import RayLeaseBroker

            warn_if_missing(logger)  # Ray started without the Serve settings specserve is measured with
            cfg = SpecServeConfig.model_validate(config)
            self.router = Router(cfg, RayLeaseBroker(draft_handle, target_handle),
                                 metrics=ServingMetrics(cfg.model.served_model_name))
            # why /health is 503: Serve's status of the Draft and Target deployments (readiness.py)
            self.router.readiness.statuses = DeploymentStatuses(serve_statuses)

        def __serve_build_asgi_app__(self):
            return create_app(self.router)

    return RouterServer
