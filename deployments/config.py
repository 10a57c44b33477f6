"""The one validated configuration of a specserve application (the `args` of serve_config.yaml).

Converted once at the boundary: `engine_config()` gives the engine's frozen dataclass, and `deployments.app`
computes every `serve.deployment` option from this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.chat_template import chat_template_text
from engine.calibration.store import DEFAULT_DIR as DEFAULT_COST_CACHE
from engine.factory import DraftSource, EngineConfig, draft_source, parse_draft
from engine.models.loading import DTYPES

# Ray Serve's AutoscalingConfig.metrics_interval_s default: how often load reports reach the autoscaler
RAY_METRICS_INTERVAL_S = 10.0


class StrictModel(BaseModel):
    """Unknown fields are errors and a parsed config never changes: the base of every config model here and of
    the Kubernetes overlays (k8s/manifests.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(StrictModel):
    target: str = Field("smollm2", description="alias 'smollm2', a .gguf file, an HF directory or a cached HF id")
    target_dtype: str = Field("auto", description="dtype of the target weights; 'auto': bfloat16 where the hardware "
                                                  "computes it natively (CUDA, a CPU with avx512_bf16 or AMX), else "
                                                  "float32")
    draft: str = Field("ngram", description="'ngram' (n-gram prompt lookup, no draft model), 'none', 'self' (the "
                                            "target's first L layers draft inside the target worker, L chosen at "
                                            "start) or 'self:L', 'self:skip:A-B' (all layers but A..B draft), "
                                            "'medusa:DIR' (Medusa heads' checkpoint, inside the "
                                            "target worker), 'eagle3:DIR' (an EAGLE-3 head, speculators' or EAGLE's "
                                            "format, inside the target worker), or a draft model source (alias, "
                                            ".gguf, HF directory or cached id)")
    draft_dtype: str = Field("int8", description="dtype of the draft ('int8' = weight-only int8)")
    served_model_name: str = Field("smollm2-135m-instruct", description="the `model` name clients send")
    max_model_len: int = Field(2048, ge=16, description="context window (prompt + output tokens)")
    trust_remote_code: bool = Field(False, description="run model code shipped with the weights (off: safer)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where model workers run")
    chat_template: str = Field(
        "auto", description="the chat template conversations are rendered with: 'auto' = the model's own, except "
        "the embedded 'smollm2', whose own renders no tools (the shipped smollm2_tools: its ChatML with tools); "
        "the name of a template shipped in deployments/api/templates, a Jinja file, or the template's text "
        "(vLLM's --chat-template)")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        "hermes", description="how tool_choice 'auto' reads tool calls out of the model's output (vLLM's parser "
        "names: deployments/api/tool_parsers.py); None: 'auto' with tools is refused, while 'required' and a named "
        "function (constrained by a grammar) need no parser")

    @field_validator("target_dtype", "draft_dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES and v != "auto":
            raise ValueError(f"unknown dtype {v!r}; choose one of {sorted(DTYPES) + ['auto']}")
        return v

    @field_validator("draft")
    @classmethod
    def _draft_parses(cls, v: str) -> str:
        parse_draft(v)  # ValueError naming model.draft for a malformed 'self:L', 'medusa:' or 'eagle3:'
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_found(cls, v: str) -> str:
        if v != "auto":
            chat_template_text(v)  # ValueError: names none
        return v


class SpeculationSection(StrictModel):
    num_speculative_tokens: int = Field(3, ge=0, le=16, description="draft tokens per round (K); 0 = plain")
    ngram_min: int = Field(2, ge=1, description="shortest n-gram prompt lookup tries")
    ngram_max: int = Field(4, ge=1, description="longest n-gram prompt lookup tries")
    tree: Literal["auto", "on", "off"] = Field(
        "off", description="token trees (engine/spec/tree.py): drafts as a tree of candidates verified in one pass "
                           "with tree attention, exact at any temperature. auto: per round, where the measured cost "
                           "of verifying tree_nodes + 1 positions per row and the requests' measured tree acceptance "
                           "beat the chain (engine/spec/plan.plan_trees); on: every drafting row; off: chains. Rows "
                           "with a grammar or logits processors stay chains. Needs the static runner")
    tree_nodes: int = Field(8, ge=1, le=15, description="draft nodes a row's tree may hold (the verify pass scores "
                                                        "tree_nodes + 1 positions per tree row)")
    staged: bool = Field(
        False, description="staged speculative decoding's second stage, for a draft model: n-gram lookup over the "
                           "context guesses the draft's own next tokens and one draft pass checks them "
                           "(engine/proposers/draft_model.py). The drafts do not change, only the draft passes")

    @field_validator("tree", mode="before")
    @classmethod
    def _yaml_switch(cls, v):
        """YAML reads a bare on / off as a boolean: take it as the word."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v
    max_batch_for_speculation: int = Field(
        EngineConfig.max_batch_for_speculation, ge=0,
        description="without `adaptive`: live sequences in a round above which K drops to 0",
    )
    adaptive: bool = Field(
        True, description="choose each request's K per round from its observed acceptance and the measured cost "
                          "of drafting and verifying at the current batch size (engine/spec/plan.py); "
                          "num_speculative_tokens is then the upper bound")
    calibration: str | None = Field(
        None, description="cost profile written by `specserve-calibrate` for this model pair and machine; "
                          "None: each Draft/Target replica measures its own costs at start (a few seconds)")
    cost_cache: str | None = Field(
        DEFAULT_COST_CACHE, description="directory where replicas keep the costs they measure at start "
        "(keyed by model, dtype, runner settings, threads and hardware; engine/calibration/store.py): a restart on the same "
        "machine reads them instead of measuring again (much of a Target's start on a 2-core CPU). None: always "
        "measure. Tensor-parallel targets always measure (their ranks measure together)")
    overlap: bool = Field(
        False, description="draft round r+1 while the target verifies round r, assuming round r is fully "
                           "accepted (used when the guess is right, discarded otherwise)")
    draft_after_reply: bool = Field(
        False, description="with a drafter inside the target (self, medusa, eagle3): make each row's next drafts "
                           "after the verify call's answer has gone (on the worker's model thread, before its next "
                           "call), so drafting overlaps the router's hop; off: before answering. The drafts and the "
                           "output are the same either way (bench/RESULTS.md compares the two)")
    decode_ahead: bool = Field(
        True, description="for rounds without drafts (plain decoding, or rounds the plan left plain at this load), "
                          "the target decodes each row's next token right after answering, while the router handles "
                          "the answer "
                          "(deployments/workers/decode_ahead.py): the router's hop overlaps the model's step. The output "
                          "does not change; a guess that does not hold costs one step")


class RunnerSection(StrictModel):
    """The model runner of the Draft and Target workers (engine/models/runner.py)."""

    kind: Literal["auto", "static", "transformers"] = Field(
        "auto", description="'static': the compiled Llama-family runner over a preallocated KV cache (an error for "
                            "other models); 'transformers': the transformers forward; 'auto': static where it applies")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="how the static runner runs its decode and verify steps. 'auto': CUDA graphs on CUDA "
                            "(captured at start, seconds), eager on CPU; 'on': CUDA graphs on CUDA, torch.compile "
                            "(inductor) on CPU (faster steps, but minutes of compilation per shape on a small CPU); "
                            "'off': eager everywhere. true / false read as on / off")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV-cache size per model worker, GiB; None: "
                                                               "kv_cache_fraction of the memory free after loading")
    kv_cache_fraction: float = Field(0.2, gt=0, le=0.95, description="share of free memory (GPU or host) the KV "
                                                                     "cache takes when kv_cache_gib is unset")
    max_num_seqs: int = Field(32, ge=1, description="KV-cache slots at most per worker (sequences held at once)")
    prefill_chunk: int = Field(256, ge=16, description="prompt tokens per round: a longer prompt is prefilled over "
                                                       "several rounds, so running streams wait at most one chunk")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the keys and values the KV cache holds; 'auto': the model's weight dtype "
                            "(bfloat16 for a bf16 target or draft, whose CPU steps compute in float32), as vLLM's "
                            "kv_cache_dtype auto; half the bytes of float32 for attention to read, twice the tokens "
                            "per GiB")
    prefix_caching: Literal["auto", "on", "off"] = Field(
        "auto", description="keep finished sequences' keys/values in free KV-cache slots and copy them for new "
                            "sequences that start with the same tokens (a chat template's system prompt, a "
                            "conversation's earlier turns, a repeated prompt), as vLLM's automatic prefix caching "
                            "does. 'auto': on where a hit gives exactly the bits a computed prefix gives (the static "
                            "runner's eager bf16 forward on a CPU with AVX512_BF16), off elsewhere; 'on': an error "
                            "where it would not be exact; 'off'")

    @field_validator("prefix_caching", "compile", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        """YAML 1.1 (PyYAML, `serve run`) reads a bare `on` / `off` as a boolean: take it as the word."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SamplingDefaults(StrictModel):
    temperature: float = Field(1.0, ge=0.0, description="default when a request gives none (OpenAI's default)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(256, ge=1, description="default max_tokens when a request gives none")


class LimitsSection(StrictModel):
    max_tokens: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    max_prompt_tokens: int = Field(2000, ge=1)
    max_stop_strings: int = Field(8, ge=0)
    max_choices: int = Field(16, ge=1, description="most choices one request may ask for (its prompts times n)")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_live_sequences_per_router: int = Field(64, ge=1, description="admission limit; beyond it 503")
    max_queue_wait_s: float = Field(
        30.0, ge=0, description="how long a request waits for a free KV-cache slot on a Target replica before it is "
                                "answered 503 with Retry-After (deployments/router/admission.py)")


class ScalingSection(StrictModel):
    """Replica count, load targets and resources of one deployment."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(4, gt=0)
    max_ongoing_requests: int = Field(16, ge=1)
    max_queued_requests: int = Field(32, ge=-1, description="-1 = unbounded (not recommended)")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0, description="window over which ongoing requests are averaged")
    metrics_interval_s: float | None = Field(
        None, gt=0, description="how often replicas and handles report their load to the autoscaler. None: Ray's "
                                f"default ({RAY_METRICS_INTERVAL_S:g} s). Ray 2.60 marks this AutoscalingConfig field "
                                "deprecated but still pushes at this interval")
    num_cpus: float = Field(0.5, gt=0, description="CPUs per model worker (the router: per replica)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per model worker")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources per model worker")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per worker. None: the node's cores divided among the workers "
                                "that run at the same time (Ray itself would leave torch with 1 thread)")
    niceness: int | None = Field(
        None, ge=-20, le=19, description="scheduling niceness of a model worker's compute threads (Draft/Target). Ray "
                                         "starts its workers at 15, the same as the router and Serve's proxy, whose "
                                         "streaming work then preempts a compute thread mid-step; 0 lets the models "
                                         "run first (a 1-stream served step faster on a dedicated 2-core machine: "
                                         "bench/RESULTS.md), but a saturated node then starves the routers and Serve's "
                                         "control plane (an autoscaling test flapped). Lowering it needs "
                                         "CAP_SYS_NICE; without it a warning is logged. None: Ray's. Default: 0 for "
                                         "Draft and Target (ROLE_DEFAULTS)")

    @model_validator(mode="after")
    def _bounds(self) -> "ScalingSection":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        interval = self.metrics_interval_s or RAY_METRICS_INTERVAL_S
        if self.look_back_period_s <= interval:
            # a window shorter than the reports sees no report at times, reads that as no load, and scales down
            raise ValueError(f"look_back_period_s ({self.look_back_period_s:g} s) must exceed the autoscaling metrics "
                             f"interval ({interval:g} s); set metrics_interval_s below it")
        return self


# Each deployment's defaults where they differ from ScalingSection's: serve_config.yaml's one-machine values (a
# test holds the two equal). A section given in a config is merged over its role's defaults, field by field.
_MODEL_WORKER = {"niceness": 0, "target_ongoing_requests": 8, "max_queued_requests": 16}
ROLE_DEFAULTS = {
    "router": {"num_cpus": 0.25, "max_replicas": 2, "target_ongoing_requests": 16, "max_ongoing_requests": 64,
               "max_queued_requests": 64},
    "draft": _MODEL_WORKER,
    "target": _MODEL_WORKER,
}


class SpecServeConfig(StrictModel):
    model: ModelSection = Field(default_factory=ModelSection)
    speculation: SpeculationSection = Field(default_factory=SpeculationSection)
    runner: RunnerSection = Field(default_factory=RunnerSection)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    tp_size: int = Field(1, ge=1, description="tensor-parallel workers per Target replica (one bundle each)")
    router: ScalingSection = Field(default_factory=lambda: ScalingSection(**ROLE_DEFAULTS["router"]))
    draft: ScalingSection = Field(default_factory=lambda: ScalingSection(**ROLE_DEFAULTS["draft"]))
    target: ScalingSection = Field(default_factory=lambda: ScalingSection(**ROLE_DEFAULTS["target"]))
    api_key_env: str = Field("SPECSERVE_API_KEY", description="env var holding the API key (unset: no auth)")
    api_key_file: str | None = Field(None, description="file holding the API key (e.g. a mounted Kubernetes "
                                                       "Secret); used when the env var is unset")
    log_prompts: bool = Field(False, description="debug only: log prompt and completion text")
    dev_endpoints: bool = Field(
        False, description="tests and operators only: POST /pause and /resume, GET /is_paused on each Router replica "
                           "(vLLM's VLLM_SERVER_DEV_MODE routes: deployments/api/dev_routes.py); behind the API key")

    @field_validator("router", "draft", "target", mode="before")
    @classmethod
    def _role_defaults(cls, section, info):
        return {**ROLE_DEFAULTS[info.field_name], **section} if isinstance(section, dict) else section

    @model_validator(mode="after")
    def _consistent(self) -> "SpecServeConfig":
        if self.speculation.ngram_min > self.speculation.ngram_max:
            raise ValueError("speculation.ngram_min must be <= ngram_max")
        if self.speculation.tree != "off" and self.runner.kind == "transformers":
            raise ValueError(f"speculation.tree: {self.speculation.tree} needs the static runner (tree attention), "
                             f"not runner.kind: transformers")
        if self.speculation.calibration is not None:
            from engine.spec.policy import CostProfile

            try:
                CostProfile.from_json(self.speculation.calibration)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"speculation.calibration {self.speculation.calibration!r} is not a readable cost "
                                 f"profile: {exc}") from exc
        if self.draft_source().in_target:
            if self.runner.kind == "transformers":
                raise ValueError(f"model.draft: {self.model.draft!r} drafts inside the static runner's steps: set "
                                 f"runner.kind auto or static (got transformers)")
        if self.limits.max_prompt_tokens >= self.model.max_model_len:
            raise ValueError("limits.max_prompt_tokens must be below model.max_model_len")
        if (self.tp_size > 1 and self.runner.compile == "on" and self.model.device == "cpu"
                and self.runner.kind != "transformers"):
            # gloo collectives do not run inside inductor graphs (on CUDA, NCCL's run inside the CUDA graphs)
            raise ValueError(f"runner.compile: on is not supported with tp_size {self.tp_size} on CPU: the "
                             f"tensor-parallel static runner runs eagerly there; set runner.compile: auto or off")
        return self

    def draft_source(self) -> DraftSource:
        """Where the served rounds' drafts come from (engine/factory.py decides it from `model.draft`)."""
        return draft_source(self.engine_config())

    def engine_config(self) -> EngineConfig:
        m, s = self.model, self.speculation
        return EngineConfig(
            target=m.target, target_dtype=m.target_dtype, draft=m.draft, draft_dtype=m.draft_dtype,
            num_speculative_tokens=s.num_speculative_tokens, ngram_min=s.ngram_min, ngram_max=s.ngram_max,
            tree=s.tree, tree_nodes=s.tree_nodes, staged=s.staged,
            max_batch_for_speculation=s.max_batch_for_speculation,
            max_model_len=m.max_model_len, device=m.device, trust_remote_code=m.trust_remote_code,
            runner=self.runner.kind, compile=self.runner.compile, kv_cache_gib=self.runner.kv_cache_gib,
            kv_cache_fraction=self.runner.kv_cache_fraction, max_num_seqs=self.runner.max_num_seqs,
            prefill_chunk=self.runner.prefill_chunk, prefix_caching=self.runner.prefix_caching,
            kv_cache_dtype=self.runner.kv_cache_dtype, cost_cache=s.cost_cache,
            draft_after_reply=s.draft_after_reply,
        )


def config_from_args(args: Mapping | None) -> SpecServeConfig:
    """An application's `args` (serve_config.yaml, a RayService's serveConfigV2) as the validated config: the one
    path from args to config, taken by `build_app`, `specserve-check-config` and `specserve-calibrate` alike, so a
    config the check passes is one the builder accepts. Raises pydantic's ValidationError naming the field."""
    return SpecServeConfig.model_validate(args or {})
