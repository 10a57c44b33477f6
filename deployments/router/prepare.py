"""Request preparation: a request's body checked and turned into what the scheduler runs (`Prepared`, one per
prompt), and /tokenize and /detokenize, which share its tokenization.

Each check is made once, here, before the request reaches a round, and a refusal is a 400 naming the parameter at
fault (deployments/api/errors.APIError):
- the prompt (`_check_prompt`): nothing given, or more tokens than the limits allow. The engine's own check
  (engine/request/sequence.check_prompt) guards the in-process engine; a prompt passed here never meets it;
- a conversation: the chat template (`_template`), the tools it renders (deployments/api/tools.template_tools, for
  chat completions and /tokenize alike), the tool-call fields of the messages;
- sampling parameters, stop strings and grammars (a bad grammar is never admitted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from deployments.api.errors import APIError
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.structured import checked_grammar
from deployments.api.tools import ToolPlan, check_conversation, plan_tools, template_tools
from deployments.config import SpecServeConfig
from engine.request.grammar import GrammarCompiler, GrammarSpec
from engine.request.sampling import SamplingParams
from engine.spec.options import SpeculationOptions

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpeculationOptions  # the request's own K, pinning and overlap (engine/spec/options.py)
    arrival: float  # time.perf_counter() when the request was read
    prompt_text: str | None = None  # a completion's prompt as the client sent it, when it was text (for echo)
    tools: ToolPlan | None = None  # a chat request whose output may be tool calls: how to read them


class RequestPreparer:
    """Checks and tokenizes requests for one Router. It reads the tokenizer's chat template at each request, so a
    template set after start-up is the one used."""

    def __init__(self, config: SpecServeConfig, tokenizer, grammars: GrammarCompiler) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = grammars  # compiles grammars to check them, never masks

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    # ---- completions and chat completions -----------------------------------------------------------------------
    def completion(self, body: CompletionRequest) -> list[Prepared]:
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

    def chat(self, body: ChatCompletionRequest) -> list[Prepared]:
        arrival = time.perf_counter()
        self._check_choices(1, body.n)
        template = self._template(body.messages)
        plan, tool_grammar, tools = plan_tools(body, self.config.model.tool_call_parser, self.grammars, template)
        ids = self._chat_ids(body.messages, add_generation_prompt=True, tools=tools)
        prepared = self._prepare(body, ids, body.max_completion_tokens or body.max_tokens, arrival,
                                 body.logprobs_n(), body.prompt_logprobs, tool_grammar=tool_grammar)
        return [replace(prepared, tools=plan)]

    # ---- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------------
    def tokenize(self, body) -> list[int]:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            template = self._template(body.messages)
            return self._chat_ids(body.messages, body.add_generation_prompt, template_tools(body.tools, template))
        return list(self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])

    def detokenize(self, body) -> str:
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens", "token ids")
        return self.tokenizer.decode(body.tokens)

    # ---- the prompt --------------------------------------------------------------------------------------------
    def _check_prompt(self, prompt, param: str = "prompt", tokens: bool = False) -> None:
        """Every prompt check: nothing given (an empty text or conversation, checked before any work; an empty
        token list) is a 400 `empty_prompt` naming `param`; `tokens` (the prompt's ids) over the limits, a 400
        `context_length_exceeded`. At least one position is left to generate."""
        if not prompt:
            raise APIError(400, f"{param} is empty", param=param, code="empty_prompt")
        limit = min(self.config.limits.max_prompt_tokens, self.config.model.max_model_len - 1)
        if tokens and len(prompt) > limit:
            raise APIError(400, f"prompt has {len(prompt)} tokens; the limit is {limit}", param=param,
                           code="context_length_exceeded")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_prompt(prompt)  # before tokenizing: a tokenizer may add a BOS token to nothing
            return self.tokenizer(prompt)["input_ids"]
        self._check_token_ids(prompt, "prompt", "prompt token ids")
        return list(prompt)

    def _template(self, messages) -> str:
        """The chat template a conversation is rendered with, checked once per request: messages to render (else
        400 `empty_prompt`) and a template (else 400 `no_chat_template`)."""
        self._check_prompt(messages, param="messages")
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        return template

    def _chat_ids(self, messages, add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        """A conversation (its template checked by `_template`, its tools rendered by `template_tools`) as ids."""
        check_conversation(messages)
        dicts = [m.template_dict(i) for i, m in enumerate(messages)]
        return list(self.tokenizer.apply_chat_template(dicts, tools=tools, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=True)["input_ids"])

    # ---- the rest of the request -------------------------------------------------------------------------------
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
        self._check_prompt(prompt_ids, tokens=True)
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
        speculation = SpeculationOptions()
        if body.speculative is not None:
            asked = body.speculative
            speculation = SpeculationOptions(0 if not asked.enabled else asked.k, asked.adaptive, asked.overlap,
                                             asked.tree)
        if self.config.log_prompts:
            logger.info("prompt: %r", self.tokenizer.decode(prompt_ids))
        return Prepared(prompt_ids, params, speculation, arrival)

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
