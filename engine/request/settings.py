"""A sequence's settings for its whole life: what any worker needs to process and sample its logits as plain
decoding would, sent once, with the sequence's first call (deployments/transport/messages.py).

The sampling parameters are frozen (engine/request/sampling.SamplingParams, the grammar inside them); the seed is
the request's own or the one drawn at admission (engine/spec/randomness.py), so every worker that ever serves the
sequence, after a failover too, draws the same random numbers; the prompt's length says where the output begins
(penalties count output tokens, a grammar covers the output only); the stop ids are the ones min_tokens masks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.request.builtin_processors import builtin_processors
from engine.request.logits_processing import LogitsProcessor
from engine.request.sampling import SamplingParams
from engine.spec.proposal import RowScheme


@dataclass(frozen=True)
class SequenceSettings:
    params: SamplingParams
    seed: int  # the request's own seed, or the one drawn for it at admission
    prompt_len: int  # where the output begins in the sequence's tokens
    min_tokens_ids: tuple[int, ...] = ()  # masked until min_tokens: EOS ids and stop_token_ids (none without it)

    @staticmethod
    def of(params: SamplingParams, seed: int, prompt_len: int, eos_ids: Iterable[int] = ()) -> "SequenceSettings":
        """A request's settings; EOS is masked under min_tokens even with ignore_eos (as vLLM does)."""
        stop_ids = tuple(sorted(set(eos_ids) | set(params.stop_token_ids))) if params.min_tokens else ()
        return SequenceSettings(params, seed, prompt_len, stop_ids)

    @property
    def coupled(self) -> bool:
        """Seeded by the request itself: Gumbel-coupled, drafter-invariant sampling (engine/spec/accept.py)."""
        return self.params.seed is not None

    def processors(self) -> tuple[LogitsProcessor, ...]:
        """The built-in logits processors these settings need, in vLLM's order (none for the defaults)."""
        return builtin_processors(self.params, self.min_tokens_ids)

    def scheme(self, position: int) -> RowScheme:
        """The sampling scheme of the sequence's token at absolute `position`."""
        return RowScheme(greedy=self.params.greedy, coupled=self.coupled, seed=self.seed, position=position)
