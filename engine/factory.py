"""Building a ready engine from one frozen config: target runner, tokenizer, proposer."""

from __future__ import annotations

from dataclasses import dataclass

from .loading import DEFAULT_MODEL, load_causal_lm, load_tokenizer, resolve
from .model_runner import ModelRunner
from .proposers import DraftModelProposer, NgramProposer, Proposer, check_tokenizers_compatible
from .speculative import SpeculativeEngine

DRAFT_NGRAM = "ngram"
DRAFT_NONE = "none"


@dataclass(frozen=True)
class EngineConfig:
    target: str = DEFAULT_MODEL  # alias, .gguf path, HF directory, or HF id in the local cache
    target_dtype: str = "float32"
    # default: the target's own weights as an int8 weight-only draft (README: "Choosing the default draft")
    draft: str = DEFAULT_MODEL  # "ngram", "none", or a model source like `target`
    draft_dtype: str = "int8"
    num_speculative_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch_for_speculation: int | None = 4  # above this many live sequences rounds draft nothing (policy.py)
    max_model_len: int | None = 2048
    device: str = "cpu"
    trust_remote_code: bool = False


def build_target(config: EngineConfig):
    """(runner, tokenizer) of the target model."""
    resolved = resolve(config.target)
    tokenizer = load_tokenizer(resolved, config.trust_remote_code)
    model = load_causal_lm(resolved, config.target_dtype, config.device, config.trust_remote_code)
    return ModelRunner(model, max_model_len=config.max_model_len), tokenizer


def build_proposer(config: EngineConfig, target_tokenizer, target_vocab_size: int) -> Proposer | None:
    if config.draft == DRAFT_NONE:
        return None
    if config.draft == DRAFT_NGRAM:
        return NgramProposer(config.ngram_min, config.ngram_max)
    resolved = resolve(config.draft)
    check_tokenizers_compatible(target_tokenizer, load_tokenizer(resolved, config.trust_remote_code))
    model = load_causal_lm(resolved, config.draft_dtype, config.device, config.trust_remote_code)
    return DraftModelProposer(ModelRunner(model, max_model_len=config.max_model_len), target_vocab_size)


def build_engine(config: EngineConfig) -> SpeculativeEngine:
    target, tokenizer = build_target(config)
    proposer = build_proposer(config, tokenizer, target.vocab_size)
    eos = target.model.generation_config.eos_token_id if target.model.generation_config else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return SpeculativeEngine(target, tokenizer, proposer, config.num_speculative_tokens, eos_ids,
                             config.max_batch_for_speculation)
