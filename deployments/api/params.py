"""Request parameters this server does not implement: refused with a 400 naming them, never silently ignored.

The request models (deployments/api/request_models.py) declare what the server implements and keep every other field a
client sent (pydantic's `extra="allow"`). `refuse_unsupported` then accepts an undeclared field only where it is
listed here with the value that means "not used" (clients often send defaults: `functions: []`,
`logprobs: false`), or where it cannot change the output (`user`, a cache-routing hint). Any other
undeclared field, or a listed one with another value, is answered 400 with `param` set to it, as OpenAI answers an
unrecognized argument. So a user who sets a parameter gets either its effect or an error, never a quiet default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deployments.api.errors import APIError

_NULL = (None,)
_EMPTY = (None, [], {})

# fields that never change what is generated: accepted with any value
NO_EFFECT = frozenset({
    "user", "safety_identifier",  # an end-user id for abuse monitoring
    "prompt_cache_key",  # a cache-routing hint
    "metadata",  # tags for stored completions (store is refused below)
    "parallel_tool_calls",  # meaningful only with tools (declared on chat completions; completions take none)
    "service_tier",  # a billing tier
})

# field -> the values that mean "not used": OpenAI's parameters, then vLLM's extensions (its defaults)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    # OpenAI chat and completions
    "tools": _EMPTY,  # completions (chat completions declare tools: deployments/api/tools.py)
    "tool_choice": (None, "none", "auto"),  # with no tools: nothing to call
    "functions": _EMPTY,
    "function_call": (None, "none", "auto"),
    "store": (None, False),
    "modalities": (None, ["text"]),
    "audio": _NULL,
    "prediction": _NULL,
    "reasoning_effort": _NULL,
    "verbosity": _NULL,
    "web_search_options": _NULL,
    "best_of": (None, 1),
    "suffix": (None, ""),
    # vLLM's extensions
    "bad_words": _EMPTY,
    "allowed_token_ids": _NULL,
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "truncate_prompt_tokens": _NULL,
    "return_tokens_as_token_ids": (None, False),
    "guided_json": _NULL, "guided_regex": _NULL, "guided_choice": _NULL, "guided_grammar": _NULL,
    "logits_processors": _NULL,
    "chat_template": _NULL,
    "chat_template_kwargs": _EMPTY,
    "documents": _NULL,
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": _NULL,
    "priority": (None, 0),
    "request_id": _NULL,
    "cache_salt": _NULL,
    "kv_transfer_params": _NULL,
    "vllm_xargs": _NULL,
}

# where a message may carry an undeclared field (tool calls are declared: deployments/api/tools.py)
MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "function_call": _NULL,  # the deprecated single call (tool_calls replaced it)
    "refusal": _NULL,
    "audio": _NULL,
}


def unsupported(extra: Mapping[str, Any] | None, neutral: Mapping[str, tuple[Any, ...]],
                prefix: str = "") -> APIError | None:
    """The 400 for the first field of `extra` (a model's undeclared fields) that is not accepted, or None."""
    for name, value in (extra or {}).items():
        param = f"{prefix}{name}"
        if name in NO_EFFECT and not prefix:
            continue
        if name not in neutral:
            return APIError(400, f"unrecognized request argument: {param!r}", param=param,
                            code="unsupported_parameter")
        if not any(value is ok or (type(value) is type(ok) and value == ok) for ok in neutral[name]):
            return APIError(400, f"{param!r} is not supported by this server (only {_shown(neutral[name])} is "
                                 "accepted, which leaves it unused)", param=param, code="unsupported_parameter")
    return None


def _shown(values: tuple[Any, ...]) -> str:
    return " or ".join("null" if v is None else repr(v) for v in values)


def refuse_unsupported(body) -> None:
    """Raise the 400 for the first parameter of a parsed request (top level, then each message) this server would
    otherwise ignore."""
    error = unsupported(body.model_extra, NEUTRAL)
    for i, message in enumerate(getattr(body, "messages", None) or ()):
        error = error or unsupported(message.model_extra, MESSAGE_NEUTRAL, prefix=f"messages[{i}].")
    if error is not None:
        raise error
