"""Per-request state shared by the in-process engine and the Ray router: tokens, stops, statistics, streaming."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from engine.request.logits_processing import LogitsProcessor, RowProcessing
from engine.request.prompt_logprobs import PromptLogprobs
from engine.request.sampling import SamplingParams
from engine.request.settings import SequenceSettings
from engine.request.stopping import OutputText, cut_at_eos_and_length
from engine.spec.randomness import draw_seed
from engine.spec.stats import SpecStats


class EmptyPromptError(ValueError):
    pass


class PromptTooLongError(ValueError):
    pass


@dataclass(frozen=True)
class RequestOutput:
    """What one round produced for one request (a streaming delta), plus totals once finished.

    `new_text` is decoded when first read (engine/request/stopping.OutputText: without stop strings the round loop
    decodes no text; the request's consumer does, between rounds). A request's outputs must be read in order."""

    request_id: str
    new_token_ids: list[int]
    text_source: Callable[[], str] = field(repr=False, compare=False)  # the delta's text, decoded when asked
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stats: SpecStats
    logprobs: list | None = None  # per new token an accept.TokenLogprob, when the request asked for logprobs
    # on a request's first output, when it asked for prompt logprobs: None (the first prompt token has none), then
    # per prompt token a prompt_logprobs.PromptLogprob
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # SequenceState.num_cached_tokens

    @cached_property
    def new_text(self) -> str:
        return self.text_source()


def check_prompt(prompt_ids: Sequence[int], max_model_len: int) -> None:
    if not prompt_ids:
        raise EmptyPromptError("the prompt is empty: at least one token is needed")
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(prompt_ids)} tokens; the context window is {max_model_len} tokens and at least "
            "one must be left to generate"
        )


@dataclass
class SequenceState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    k: int  # draft tokens per round this request asks for (0 = plain decoding)
    max_model_len: int
    eos_token_ids: frozenset[int]  # the ids that end the sequence: EOS (unless ignore_eos) and stop_token_ids
    text: OutputText
    # what every worker that serves it needs for its whole life: the parameters, the request's seed or one drawn at
    # admission (every random number of its sampling is a function of it and of the token position, wherever it is
    # computed: engine/spec/randomness.py), the prompt's length; sent once, with its first delta (engine/request/delta.py)
    settings: SequenceSettings
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    # the logits processors applied to this sequence's draft and target logits at every position
    # (engine/request/logits_processing.py), built from its settings
    processors: tuple[LogitsProcessor, ...] = ()
    # prompt logprobs (params.prompt_logprobs): [None] + per prompt token its PromptLogprob, filled as the target
    # scores the prompt (chunk by chunk: add_prompt_logprobs), delivered with the first output
    prompt_logprobs: list | None = None
    prompt_unscored: int = 0  # prompt tokens not scored yet
    # prompt tokens the target read from its prefix cache instead of computing them (OpenAI's usage
    # `prompt_tokens_details.cached_tokens`); at most the prompt's length, a re-prefill after a failover included
    num_cached_tokens: int = 0

    def add_cached_tokens(self, count: int) -> None:
        self.num_cached_tokens = min(len(self.prompt_ids), self.num_cached_tokens + count)

    @classmethod
    def create(cls, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, k: int,
               max_model_len: int, eos_token_ids: frozenset[int], tokenizer) -> "SequenceState":
        prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(prompt_ids, max_model_len)
        if k < 0:
            raise ValueError("k must be >= 0")
        seed = params.seed if params.seed is not None else draw_seed()
        settings = SequenceSettings.of(params, seed, len(prompt_ids), eos_token_ids)
        # EOS stops a grammar's row even with ignore_eos (a finished grammar allows nothing else)
        keep_eos = not params.ignore_eos or params.grammar is not None
        stop_ids = (frozenset(eos_token_ids) if keep_eos else frozenset()) | frozenset(params.stop_token_ids)
        text = OutputText(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                          include_stop_str=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        asked = params.prompt_logprobs is not None
        return cls(request_id, prompt_ids, params, k, max_model_len, stop_ids, text, settings,
                   processors=settings.processors(),
                   prompt_logprobs=[None] * len(prompt_ids) if asked else None,
                   prompt_unscored=len(prompt_ids) - 1 if asked else 0)

    def wants_prompt_logprobs(self) -> bool:
        """Whether the target must still score prompt tokens of this request."""
        return self.prompt_unscored > 0

    def add_prompt_logprobs(self, run: PromptLogprobs) -> None:
        """Prompt logprobs the target scored (a re-prefill after a failover scores the same positions again)."""
        if self.prompt_logprobs is None:
            return
        for position, entry in enumerate(run.entries, run.first):
            if 0 < position < len(self.prompt_logprobs):
                self.prompt_unscored -= self.prompt_logprobs[position] is None
                self.prompt_logprobs[position] = entry

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def coupled(self) -> bool:
        """Seeded by the request itself: Gumbel-coupled, drafter-invariant sampling (engine/spec/accept.py)."""
        return self.settings.coupled

    def processing(self) -> RowProcessing | None:
        """The row's logits processing for a draft or verify call (None: no processor)."""
        return RowProcessing(self.processors, self.tokens, len(self.prompt_ids)) if self.processors else None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.text.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.text.token_ids)

    def remaining(self) -> int:
        """Tokens this sequence may still emit (max_tokens and the context window)."""
        by_tokens = self.params.max_tokens - len(self.text.token_ids)
        return max(0, min(by_tokens, self.max_model_len - self.num_tokens))

    def draft_len(self, k: int | None = None) -> int:
        """A round emits at most k+1 tokens, so drafting past remaining-1 is wasted work."""
        return max(0, min(self.k if k is None else k, self.remaining() - 1))

    def commit(self, tokens: list[int], num_draft: int, num_accepted: int,
               logprobs: list | None = None) -> RequestOutput:
        """Append one round's tokens, cutting at EOS or a stop token (not before min_tokens), max_tokens, the window
        and stop strings."""
        first = not self.text.token_ids  # the request's first output carries its prompt logprobs
        # a grammar's row samples a stop id before min_tokens only where its grammar can only end (builtin_processors.
        # MinTokens leaves the stop ids there): it stops, as vLLM's does, rather than emit EOS until min_tokens
        owed = 0 if self.params.grammar is not None else self.params.min_tokens - len(self.text.token_ids)
        cut = cut_at_eos_and_length(tokens, self.eos_token_ids, self.remaining(), owed)
        kept = tokens[: cut.keep]
        finish = cut.finish_reason
        stopped_at = self.text.extend(kept, ends_with_stop_token=cut.stop_token)
        if stopped_at is not None:
            kept, finish = kept[:stopped_at], "stop"
        self.stats.record(num_draft, num_accepted, len(kept))
        if finish is None and self.remaining() == 0:
            finish = "length"
        self.finish_reason = finish
        text, upto, final = self.text, len(self.text.token_ids), finish is not None
        if text.deferred:  # decoded when the consumer reads it
            text_source = lambda: text.take_delta(final, upto)  # noqa: E731
        else:  # stop strings: decoded already (extend), the delta is taken now
            delta = text.take_delta(final)
            text_source = lambda: delta  # noqa: E731
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=kept,
            text_source=text_source,
            finished=finish is not None,
            finish_reason=finish,
            num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=len(self.text.token_ids),
            stats=self.stats,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=None if logprobs is None else list(logprobs[: len(kept)]),
            prompt_logprobs=list(self.prompt_logprobs) if first and self.prompt_logprobs is not None else None,
        )
