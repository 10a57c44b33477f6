"""Building a ready engine from one frozen config: target runner, tokenizer, proposer."""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.cpu import extension as cpu_extension
from engine.models.loading import DEFAULT_MODEL, eos_token_ids, load_causal_lm, load_tokenizer, resolve
from engine.models.runner import Runner, cpu_computes_bf16, resolve_dtype
from engine.models.static.forward import why_unsupported
from engine.models.static.runner import KVBudget, StaticRunner, step_mode
from engine.models.transformers_runner import ModelRunner
from engine.proposers.base import Proposer, check_tokenizers_compatible
from engine.proposers.draft_model import DraftModelProposer
from engine.proposers.ngram import NgramProposer
from engine.request.grammar import GrammarCompiler, SequenceGrammars
from engine.spec.plan import TreeSettings
from engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)



class DraftMethod(str, enum.Enum):
    """How a deployment drafts: the one vocabulary for it, parsed once from the config's `draft` (a model source,
    "ngram", "none", "self", "self:L", "medusa:DIR" or "eagle3:DIR": `EngineConfig.draft_method`). A new kind of proposer is a
    member here, a branch in `build_proposer` (or `build_target_drafter`) and `draft_source`, and its module in
    engine/proposers/."""

    MODEL = "model"  # a draft model (engine/proposers/draft_model.DraftModelProposer), served by Draft workers
    NGRAM = "ngram"  # prompt lookup (engine/proposers/ngram.NgramProposer), in the router: no model, no worker
    NONE = "none"  # no drafts: plain decoding
    SELF = "self"  # the target's first layers (engine/proposers/early_exit.py), inside the target worker
    MEDUSA = "medusa"  # Medusa heads (engine/proposers/medusa.py), inside the target worker
    EAGLE3 = "eagle3"  # an EAGLE-3 head (engine/proposers/eagle3.py), inside the target worker

    @classmethod
    def of(cls, draft: str) -> "DraftMethod":
        """The method a config's `draft` names: "ngram", "none", "self[:L]", "medusa:DIR", "eagle3:DIR", anything
        else a draft model's source."""
        if draft == "self" or draft.startswith("self:"):
            return cls.SELF
        if draft.startswith("medusa:"):
            return cls.MEDUSA
        if draft.startswith("eagle3:"):
            return cls.EAGLE3
        return {cls.NGRAM.value: cls.NGRAM, cls.NONE.value: cls.NONE}.get(draft, cls.MODEL)

    @property
    def in_target(self) -> bool:
        """Drafts made inside the target worker, from its verify pass (engine/spec/target_drafts.py)."""
        return self in (DraftMethod.SELF, DraftMethod.MEDUSA, DraftMethod.EAGLE3)


def parse_draft(draft: str) -> tuple[DraftMethod, str | None]:
    """(method, argument): "self:4" -> (SELF, "4"), "self:skip:8-13" -> (SELF, "skip:8-13": those layers skipped),
    "self" -> (SELF, None: the layers chosen at start), "medusa:DIR" ->
    (MEDUSA, DIR), "eagle3:DIR" -> (EAGLE3, DIR); a ValueError naming `model.draft` for a malformed one."""
    method = DraftMethod.of(draft)
    if method is DraftMethod.SELF:
        arg = draft.partition(":")[2] or None
        skip = arg is not None and re.fullmatch(r"skip:\d+-\d+", arg)
        if arg is not None and not skip and (not arg.isdigit() or int(arg) < 1):
            raise ValueError(f"model.draft: 'self:L' takes a layer count L >= 1 (or 'self:skip:A-B' the middle "
                             f"layers A..B to skip), got {draft!r}")
        return method, arg
    if method in (DraftMethod.MEDUSA, DraftMethod.EAGLE3):
        arg = draft.partition(":")[2]
        if not arg:
            raise ValueError(f"model.draft: '{method.value}:DIR' names the heads' checkpoint directory")
        return method, arg
    return method, None


@dataclass(frozen=True)
class EngineConfig:
    target: str = DEFAULT_MODEL  # alias, .gguf path, HF directory, or HF id in the local cache
    target_dtype: str = "float32"
    draft: str = "ngram"  # "ngram" (prompt lookup, the served default), "none", or a draft model's source
    draft_dtype: str = "int8"
    num_speculative_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    tree: str = "off"  # token trees (engine/spec/tree.py): "auto" (where they pay), "on", "off"
    tree_nodes: int = 8  # draft nodes a row's tree may hold
    # staged speculative decoding's second stage: a draft model's own steps speculated by n-gram lookup
    staged: bool = False
    max_batch_for_speculation: int | None = 4  # above this many live sequences rounds draft nothing (spec/plan.py)
    max_model_len: int | None = 2048
    device: str = "cpu"
    trust_remote_code: bool = False
    # the model runner (engine/models/runner.py): the compiled static path for the Llama family, else transformers'
    runner: str = "auto"  # "auto" (static where supported), "static" (an error where not), "transformers"
    # how the static runner runs its steps (engine/models/static/steps.step_mode): "auto" = CUDA graphs on CUDA,
    # eager on CPU; "on" = CUDA graphs on CUDA, torch.compile (inductor) on CPU, whose shapes compile for minutes on a
    # small CPU; "off" = eager everywhere
    compile: str = "auto"
    kv_cache_gib: float | None = None  # KV-cache bytes per model worker; None: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.2
    max_num_seqs: int = 32  # KV-cache slots at most (sequences a worker holds at once)
    prefill_chunk: int = 256  # prompt tokens per forward; the scheduler sends a long prompt this much per round
    # keep finished sequences' keys/values in free slots for new ones that start the same way
    # (engine/models/static/prefix_cache.py): "auto" (where hits are exact), "on" (an error where they would not be),
    # "off"
    prefix_caching: str = "auto"
    # the KV cache's dtype (kv_cache_dtype_for): "auto" (the model's weight dtype: bf16 for a bf16 model, whose
    # steps compute in fp32 on CPU), "float32", "bfloat16"
    kv_cache_dtype: str = "auto"
    cost_cache: str | None = None  # where workers keep their start-up cost measurements (engine/calibration/store.py)
    # a drafter inside the target drafts after the verify call's answer has gone instead of before (the served worker)
    draft_after_reply: bool = False

    @property
    def draft_method(self) -> DraftMethod:
        return DraftMethod.of(self.draft)

    def budget(self) -> KVBudget:
        return KVBudget(gib=self.kv_cache_gib, fraction=self.kv_cache_fraction, max_num_seqs=self.max_num_seqs)

    @property
    def widest_verify(self) -> int:
        """The most drafts a verify pass scores per row: K, or a token tree's nodes where trees are on (the widths
        the target measures and captures at start)."""
        return max(self.num_speculative_tokens, self.tree_nodes if self.tree != "off" else 0)


def make_runner(model: torch.nn.Module, config: EngineConfig, vocab_size: int | None = None) -> Runner:
    """The static (compiled, preallocated) runner where it supports the model, else the transformers runner."""
    reason = why_unsupported(model)
    if config.runner == "transformers" or (reason is not None and config.runner == "auto"):
        if reason is not None and config.runner == "auto":
            log.info("model runner: transformers (the static runner does not cover %s)", reason)
        return ModelRunner(model, max_model_len=config.max_model_len, vocab_size=vocab_size)
    if reason is not None:
        raise ValueError(f"runner: static cannot run this model: {reason}")
    dtype, weight_dtype = cpu_step_dtypes(model, step_mode(config.compile, model.device) == "inductor")
    return StaticRunner(model, max_model_len=config.max_model_len, vocab_size=vocab_size, budget=config.budget(),
                        compile=config.compile, prefill_chunk=config.prefill_chunk, dtype=dtype,
                        weight_dtype=weight_dtype, prefix_caching=config.prefix_caching,
                        cache_dtype=kv_cache_dtype_for(model, config.kv_cache_dtype))


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_cache_dtype_for(model: torch.nn.Module, setting: str) -> torch.dtype | None:
    """The static runner's KV-cache dtype for `setting`; None: its activation dtype.

    "auto" is the model's weight dtype, as in vLLM (`--kv-cache-dtype auto`) and transformers: a bf16 model keeps
    bf16 keys and values even where its steps compute in fp32 (on CPU: `cpu_step_dtypes`). Attention reads the whole
    cache every step and is memory-bound at long contexts: bf16 halves the bytes, and with them much of a step's
    attention time (measured: bench/RESULTS.md), and a budget holds twice the tokens. Keys are rounded to bf16
    after RoPE, values as computed; attention computes in fp32 over the widened values. Greedy exactness holds
    against plain decoding with the same cache dtype."""
    if setting == "auto":
        param = next(model.parameters())
        return param.dtype if param.dtype in KV_CACHE_DTYPES.values() else None
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {setting!r}")
    return KV_CACHE_DTYPES[setting]


def cpu_step_dtypes(model: torch.nn.Module, compile: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(activation dtype, weight dtype) of the static runner's steps; (None, None): the model's own dtype for both.

    On CPU, a bf16 model (a bf16 target, or an int8 draft's other weights) runs with bf16 weights and fp32
    activations where specserve's CPU operators load: each product is a bf16 product (activations rounded to bf16,
    fp32 sums; engine/models/cpu/linear.linear), while norms, residuals, RoPE and attention compute in fp32 on the fused
    operators, which ATen's bf16 operators do not match at decode sizes (the KV cache holds bf16 unless configured:
    `kv_cache_dtype_for`). On this project's avx512_bf16 machine a decode step ran fastest this way, on the
    VDPBF16PS kernel (bf16_gemm.cpp) ahead of the widening one, both ahead of fp32, while ATen's bf16 operators were
    slower than fp32 (measured: bench/RESULTS.md). An int8 draft's products widen the int8 weights in
    registers, fp32 activations. Without the operators, bf16 activations stay where the CPU computes
    bf16 natively and become fp32 where it would emulate them. Compiled steps keep the model's dtype."""
    if model.device.type != "cpu" or next(model.parameters()).dtype != torch.bfloat16:
        return None, None
    if not compile and cpu_extension.small_gemm() is not None:
        return torch.float32, torch.bfloat16
    if not cpu_computes_bf16():
        return torch.float32, None  # an int8 draft's activations: bf16 is emulated (slow) on this CPU
    return None, None


def build_target(config: EngineConfig):
    """(runner, tokenizer) of the target model."""
    resolved = resolve(config.target)
    tokenizer = load_tokenizer(resolved, config.trust_remote_code)
    model = load_causal_lm(resolved, resolve_dtype(config.target_dtype, config.device), config.device,
                           config.trust_remote_code)
    return make_runner(model, config), tokenizer


def build_proposer(config: EngineConfig, target_tokenizer, target_vocab_size: int) -> Proposer | None:
    """The proposer of the config's draft method (None: no drafts); the one place proposers are chosen (the engine,
    the CLI, calibration and the Draft workers all build theirs here)."""
    method = config.draft_method
    if method is DraftMethod.NONE or method.in_target:  # a drafter inside the target: build_target_drafter
        return None
    if method is DraftMethod.NGRAM:
        return NgramProposer(config.ngram_min, config.ngram_max)
    resolved = resolve(config.draft)
    check_tokenizers_compatible(target_tokenizer, load_tokenizer(resolved, config.trust_remote_code))
    model = load_causal_lm(resolved, resolve_dtype(config.draft_dtype, config.device), config.device,
                           config.trust_remote_code)
    grammars = SequenceGrammars(GrammarCompiler(target_tokenizer, target_vocab_size,
                                                eos_token_ids(resolve(config.target).directory, target_tokenizer)))
    lookup = NgramProposer(config.ngram_min, config.ngram_max) if config.staged else None
    return DraftModelProposer(make_runner(model, config), target_vocab_size, grammars=grammars, lookup=lookup)


@dataclass(frozen=True)
class DraftSource:
    """Where a served round's drafts come from, decided here once from the draft method: the round loop, the
    scheduler, the cost bookkeeping and the application builder ask these questions and never the method.

    `local`: a proposer the router runs itself (n-gram lookup: no model, no worker). `remote`: Draft workers run a
    draft model (their proposer is `build_proposer`'s), leased per request. `in_target`: the Target worker drafts
    for itself (`build_target_drafter`): the router sends each row's K and gets accepted tokens back, one call a
    round. None of them: plain decoding."""

    local: Proposer | None = None
    remote: bool = False
    in_target: bool = False

    @property
    def drafts(self) -> bool:
        return self.remote or self.in_target or self.local is not None


def draft_source(config: EngineConfig) -> DraftSource:
    """The served rounds' draft source for the config's draft method."""
    method = config.draft_method
    if method is DraftMethod.NGRAM:
        return DraftSource(local=NgramProposer(config.ngram_min, config.ngram_max))
    return DraftSource(remote=method is DraftMethod.MODEL, in_target=method.in_target)


def build_target_drafter(config: EngineConfig, runner: Runner, tokenizer=None):
    """The draft source inside the target for the config's `self`, `medusa:DIR` or `eagle3:DIR` (None for other
    methods): it runs on the static runner only (its KV cache and hidden states). On a tensor-parallel shard every
    rank builds it at the same time (`self`'s start-up choice of L runs the shard's collectives, and rank 0's L is
    taken by all)."""
    method, arg = parse_draft(config.draft)
    if not method.in_target:
        return None
    if not isinstance(runner, StaticRunner):
        raise ValueError(f"model.draft: {config.draft!r} drafts inside the target's static runner, which does not "
                         f"run this target (Llama, Mistral, Qwen2 and Gemma families; runner: auto or static)")
    if method is DraftMethod.MEDUSA:
        from engine.proposers.medusa import MedusaDrafter, load_medusa

        heads = load_medusa(arg, runner.model.final_norm.shape[0], runner.vocab_size)
        return MedusaDrafter(heads, runner.model)
    if method is DraftMethod.EAGLE3:
        from engine.proposers.eagle3 import Eagle3Drafter
        from engine.proposers.eagle3_checkpoint import load_eagle3

        head = load_eagle3(arg, runner.model.final_norm.shape[0], runner.vocab_size, len(runner.model.layers))
        return Eagle3Drafter(head, runner)
    from engine.proposers.early_exit import EarlyExitDrafter, auto_exit_layer, skip_block

    total = len(runner.model.layers)
    if arg is None:
        agree = None
        if runner.model.shard is not None:  # measured on each rank: rank 0's choice for all
            from engine.models.static.tp import first_rank_value

            agree = lambda index: first_rank_value(index, runner.model.shard, runner.device)  # noqa: E731
        layers = auto_exit_layer(runner, tokenizer, config.num_speculative_tokens, agree)
    elif arg.startswith("skip:"):
        first, last = (int(n) for n in arg[5:].split("-"))
        try:
            layers = skip_block(total, first, last)
        except ValueError as exc:
            raise ValueError(f"model.draft: 'self:{arg}': {exc} (num_hidden_layers {total})") from exc
    else:
        layers = int(arg)
        if layers >= total:
            raise ValueError(f"model.draft: 'self:{layers}' exits after {layers} layers, but the target has {total} "
                             f"(num_hidden_layers); L must be below it")
    return EarlyExitDrafter(layers)


def capture_graphs(runner: Runner | None, max_k: int, drafter=None) -> bool:
    """Capture a static runner's CUDA graphs now (as the served workers do at start), where its steps are graphs,
    an early-exit drafter's steps too; other runners and step modes are left alone (inductor compiles a shape when
    first used). Whether it did."""
    if getattr(runner, "graphs", None) is None:
        return False
    runner.warm_up(max_k, exit_layers=getattr(drafter, "exit_layers", None))
    return True


def check_trees(config: EngineConfig, runner) -> None:
    """Token trees need tree attention: the static runner's (ValueError naming the setting elsewhere)."""
    if config.tree != "off" and not getattr(runner, "takes_trees", False):
        raise ValueError(f"speculation.tree: {config.tree} needs the static runner (tree attention); this target runs "
                         f"on {type(runner).__name__} (runner.kind, or a model family the static runner does not "
                         f"cover)")


def build_engine(config: EngineConfig,
                 on_loading: Callable[[str, str], None] = lambda role, source: None) -> SpeculativeEngine:
    """The in-process engine of `config`: target, proposer, EOS ids and speculation limits, all from the config.
    `on_loading(role, source)` is called before each model loads ("target", then "draft"), for a progress bar."""
    on_loading("target", config.target)
    target, tokenizer = build_target(config)
    check_trees(config, target)
    on_loading("draft", config.draft)
    drafter = build_target_drafter(config, target, tokenizer)
    proposer = None if drafter is not None else build_proposer(config, tokenizer, target.vocab_size)
    capture_graphs(target, config.widest_verify, drafter)
    capture_graphs(getattr(proposer, "runner", None), config.num_speculative_tokens)
    eos_ids = sorted(eos_token_ids(resolve(config.target).directory, tokenizer))
    return SpeculativeEngine(target, tokenizer, proposer, config.num_speculative_tokens, eos_ids,
                             config.max_batch_for_speculation, drafter=drafter,
                             tree=TreeSettings(config.tree, config.tree_nodes))
