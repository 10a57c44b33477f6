"""The Router: tokenizes, validates and admits requests, then streams what the Scheduler's rounds produce.

`Router` is a plain class (unit-tested with an in-process lease broker); `RouterServer` is its Ray Serve ingress
deployment, holding handles to the Draft and Target deployments.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass, replace

from deployments.api.chat_template import chat_template_for
from deployments.api.readiness import DeploymentState, DeploymentStatuses, Readiness, serve_statuses
from deployments.api.routes import APIError, ChatCompletionRequest, CompletionRequest, create_app
from deployments.api.structured import checked_grammar
from deployments.api.tools import ToolPlan, check_conversation, plan_tools
from deployments.config import SpecServeConfig
from deployments.errors import Overloaded, ReplicaGone, RequestFailed
from deployments.metrics import NullMetrics, observe
from deployments.router.admission import AdmissionSlot
from deployments.router.scheduler import Scheduler, SchedulerConfig
from engine.models.loading import eos_token_ids, load_tokenizer, resolve
from engine.request.grammar import GrammarCompiler, GrammarError, GrammarSpec
from engine.request.sampling import SamplingParams
from engine.request.sequence import EmptyPromptError, PromptTooLongError

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    k: int | None
    adaptive: bool | None  # None: the server's K policy; False: exactly k every round
    overlap: bool | None  # None: the server's setting; False: no drafting ahead for this request
    arrival: float  # time.perf_counter() when the request was read
    prompt_text: str | None = None  # a completion's prompt as the client sent it, when it was text (for echo)
    tools: ToolPlan | None = None  # a chat request whose output may be tool calls: how to read them


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

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    # ---- HTTP-level checks (before the body is parsed) ------------------------------------------------------
    def check_http(self, request) -> None:
        if not request.url.path.startswith("/v1"):
            return
        if self.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)",
                               type_="authentication_error", code="invalid_api_key")
        if request.method == "POST":
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

    # ---- request preparation --------------------------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> list[Prepared]:
        """One Prepared per prompt of the request (a list of prompts gives several)."""
        arrival = time.perf_counter()
        prompts = body.prompts()
        self._check_choices(len(prompts), body.n)
        # vLLM's rule: `echo` with `logprobs` scores the prompt with that top n unless prompt_logprobs says otherwise
        prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (
            body.logprobs if body.echo else None)
        return [replace(self._prepare(body, self._prompt_ids(prompt), body.max_tokens, arrival, body.logprobs,
                                      prompt_logprobs),
                        prompt_text=prompt if isinstance(prompt, str) else None)
                for prompt in prompts]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", param="prompt", code="empty_prompt")
            return self.tokenizer(prompt)["input_ids"]
        self._check_token_ids(prompt, "prompt", "prompt token ids")
        return list(prompt)

    def _check_token_ids(self, ids, param: str, what: str) -> None:
        """A 400 naming `param` when an id is outside the tokenizer's vocabulary."""
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{what} must be in [0, {vocab})", param=param)

    def _check_choices(self, prompts: int, n: int) -> None:
        limit = self.config.limits.max_choices
        if prompts * n > limit:
            raise APIError(400, f"{prompts} prompt(s) x n={n} choices is over the limit of {limit} per request",
                           param="n")

    def prepare_chat(self, body: ChatCompletionRequest) -> list[Prepared]:
        arrival = time.perf_counter()
        self._check_choices(1, body.n)
        self._check_template(body.messages)
        plan, tool_grammar, tools = plan_tools(body, self.config.model.tool_call_parser, self.grammars,
                                               self.tokenizer.chat_template)
        ids = self._chat_ids(body.messages, add_generation_prompt=True, tools=tools)
        prepared = self._prepare(body, ids, body.max_completion_tokens or body.max_tokens, arrival,
                                 body.logprobs_n(), body.prompt_logprobs, tool_grammar=tool_grammar)
        return [replace(prepared, tools=plan)]

    def _check_template(self, messages) -> None:
        if not messages:
            raise APIError(400, "messages is empty", param="messages", code="empty_prompt")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")

    def _chat_ids(self, messages, add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        self._check_template(messages)
        check_conversation(messages)
        dicts = [m.template_dict(i) for i, m in enumerate(messages)]
        return list(self.tokenizer.apply_chat_template(dicts, tools=tools, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=True)["input_ids"])

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

    # ---- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------------
    def tokenize(self, body) -> list[int]:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            return self._chat_ids(body.messages, body.add_generation_prompt, tools)
        return list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])

    def detokenize(self, body) -> str:
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens", "token ids")
        return self.tokenizer.decode(body.tokens)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _prepare(self, body, prompt_ids: list[int], max_tokens: int | None, arrival: float,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 tool_grammar: GrammarSpec | None = None) -> Prepared:
        cfg, limits = self.config, self.config.limits
        self._check_model(body.model)
        if body.stream and (body.prompt_logprobs or 0) > 0:  # vLLM's refusal: a stream has no place for them
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if not prompt_ids:
            raise APIError(400, "prompt is empty", param="prompt", code="empty_prompt")
        if len(prompt_ids) > limits.max_prompt_tokens or len(prompt_ids) >= cfg.model.max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens; the limit is "
                                f"{min(limits.max_prompt_tokens, cfg.model.max_model_len - 1)}",
                           param="prompt", code="context_length_exceeded")
        max_tokens = max_tokens or cfg.sampling.max_tokens
        if max_tokens > limits.max_tokens:
            raise APIError(400, f"max_tokens {max_tokens} is over the limit of {limits.max_tokens}",
                           param="max_tokens")
        stop = body.stop_list()
        if len(stop) > limits.max_stop_strings:
            raise APIError(400, f"at most {limits.max_stop_strings} stop strings", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        grammar = checked_grammar(body, self.grammars)  # a bad grammar: 400 naming its parameter, not admitted
        if tool_grammar is not None:  # tool_choice "required" or a named function
            if grammar is not None:
                raise APIError(400, "tool_choice \"required\" or a named function constrains the output itself: "
                                    "set response_format / structured_outputs or that, not both", param="tool_choice")
            grammar = tool_grammar
        try:
            params = SamplingParams(
                temperature=cfg.sampling.temperature if body.temperature is None else body.temperature,
                top_p=cfg.sampling.top_p if body.top_p is None else body.top_p,
                top_k=cfg.sampling.top_k if body.top_k is None else body.top_k,
                max_tokens=max_tokens, stop=tuple(stop), seed=body.seed, ignore_eos=body.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, grammar=grammar, **self._vllm_sampling(body),
            )
        except ValueError as exc:  # SamplingParams' messages begin with the parameter's name
            name = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=name if name in SamplingParams.__dataclass_fields__ else None
                           ) from exc
        k, adaptive, overlap = None, None, None
        if body.speculative is not None:
            k = 0 if not body.speculative.enabled else body.speculative.k
            adaptive, overlap = body.speculative.adaptive, body.speculative.overlap
        if self.config.log_prompts:
            logger.info("prompt: %r", self.tokenizer.decode(prompt_ids))
        return Prepared(prompt_ids, params, k, adaptive, overlap, arrival)

    def _vllm_sampling(self, body) -> dict:
        """vLLM's sampling parameters of a request, as SamplingParams fields; token ids outside the vocabulary are
        a 400 naming the parameter."""
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        self._check_token_ids(bias, "logit_bias", "logit_bias token ids")
        stop_ids = body.stop_token_ids or []
        self._check_token_ids(stop_ids, "stop_token_ids", "stop_token_ids")
        fields = {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
                  "repetition_penalty": body.repetition_penalty, "min_p": body.min_p}
        return {**{k: v for k, v in fields.items() if v is not None}, "logit_bias": tuple(bias.items()),
                "min_tokens": body.min_tokens, "stop_token_ids": tuple(stop_ids),
                "include_stop_str_in_output": body.include_stop_str_in_output,
                "skip_special_tokens": body.skip_special_tokens}

    async def run(self, prepared: Prepared, request_id: str, slot: AdmissionSlot | None = None):
        """The request's per-round outputs; scheduler errors become API errors."""
        stream = self.scheduler.generate(prepared.prompt_ids, prepared.params, prepared.k, request_id,
                                         adaptive=prepared.adaptive, overlap=prepared.overlap, slot=slot)
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
        except (EmptyPromptError, PromptTooLongError) as exc:
            raise APIError(400, str(exc), param="prompt") from exc
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
