"""Prometheus metrics of the router, exported through Ray's metrics pipeline (`ray.serve.metrics`).

Names and meanings follow vLLM's (`vllm:spec_decode_num_drafts` ...), so dashboards and habits carry over. Ray
deprecates ':' in metric names and prefixes every application metric with `ray_`, so vLLM's `vllm:X` is
`specserve_X` here and `ray_specserve_X` in Prometheus (counters get `_total`). `ray.serve.metrics` adds the
`application`, `deployment` and `replica` labels; we add `model_name`. No label ever carries prompt text or a
request id.

PromQL, e.g.:
    acceptance rate          sum(rate(ray_specserve_spec_decode_num_accepted_tokens_total[1m]))
                             / sum(rate(ray_specserve_spec_decode_num_draft_tokens_total[1m]))
    mean acceptance length   1 + sum(rate(..._num_accepted_tokens_total[1m])) / sum(rate(..._num_drafts_total[1m]))
(mean acceptance length counts the bonus token, vLLM's convention.)
"""

from __future__ import annotations

import logging
from typing import Any

PREFIX = "specserve_"
EXPORTED_PREFIX = "ray_" + PREFIX  # what Prometheus sees

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0]
PHASE_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0]


logger = logging.getLogger("ray.serve")


def observe(record, *args) -> None:
    """Call a recording method; metrics never fail a round or a stream, a broken one is only logged."""
    try:
        record(*args)
    except Exception:
        logger.exception("recording a metric failed")


class NullMetrics:
    """Records nothing (unit tests that do not look at metrics; code outside a Serve replica)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class ServingMetrics:
    """The router replica's metrics. `backend` is `ray.serve.metrics` (or a stand-in with its API in tests)."""

    def __init__(self, model_name: str, backend: Any = None) -> None:
        if backend is None:
            from ray.serve import metrics as backend
        self.tags = {"model_name": model_name}
        m = ("model_name",)

        def counter(name, doc, keys=m):
            c = backend.Counter(PREFIX + name, description=doc, tag_keys=keys)
            c.set_default_tags(dict(self.tags))  # ray.serve.metrics adds its own tags to the dict it is given
            return c

        def histogram(name, doc, buckets):
            h = backend.Histogram(PREFIX + name, description=doc, boundaries=buckets, tag_keys=m)
            h.set_default_tags(dict(self.tags))
            return h

        def gauge(name, doc):
            g = backend.Gauge(PREFIX + name, description=doc, tag_keys=m)
            g.set_default_tags(dict(self.tags))
            return g

        # speculation, vLLM's names and meanings
        self.num_drafts = counter("spec_decode_num_drafts", "Rounds in which a sequence was given draft tokens.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based).",
                                        ("model_name", "position"))
        # requests and tokens
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached",
                                            "Prompt tokens the Target workers read from their prefix cache instead "
                                            "of computing them (usage.prompt_tokens_details.cached_tokens).")
        self.generation_tokens = counter("generation_tokens", "Generated (output) tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("model_name", "finished_reason"))
        self.http_requests = counter("http_requests", "HTTP requests answered, by route and status code.",
                                     ("model_name", "route", "status"))
        # latency
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival to the first output token (includes prefill and queueing).", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Per-token latency after the first: a round's gap divided by the tokens it produced, "
                             "observed once per round.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.draft_time = histogram("spec_decode_draft_seconds", "Draft phase of a round (RPC included).",
                                    PHASE_BUCKETS)
        self.verify_time = histogram("spec_decode_verify_seconds", "Verify phase of a round (RPC included).",
                                     PHASE_BUCKETS)
        self.orchestration_time = histogram("spec_decode_orchestration_seconds",
                                            "A round's draft+verify wall time minus the workers' own compute: RPC, "
                                            "serialization, event-loop hops.", PHASE_BUCKETS)
        # load
        self.running = gauge("num_requests_running", "Sequences in the round loop of this router replica.")
        self.waiting = gauge("num_requests_waiting", "Admitted requests waiting for a Draft/Target lease.")
        self.k = gauge("spec_decode_k", "Mean draft tokens per sequence in the last round (the K policy's choice).")
        self.enabled = gauge("spec_decode_enabled", "1 while rounds draft tokens, 0 while decoding plainly.")

    # ---- round level (Scheduler) ----------------------------------------------------------------------------
    def round(self, draft_lens: list[int], accepted: list[int], draft_s: float, verify_s: float,
              orchestration_s: float) -> None:
        drafted = [(n, a) for n, a in zip(draft_lens, accepted) if n > 0]
        if drafted:  # Ray counters refuse increments of 0, hence the guards
            self.num_drafts.inc(len(drafted))
            self.num_draft_tokens.inc(sum(n for n, _ in drafted))
            if any(a for _, a in drafted):
                self.num_accepted_tokens.inc(sum(a for _, a in drafted))
            for pos in range(max(a for _, a in drafted)):
                count = sum(1 for _, a in drafted if a > pos)
                self.accepted_per_pos.inc(count, {"position": str(pos)})
        self.draft_time.observe(draft_s)
        self.verify_time.observe(verify_s)
        self.orchestration_time.observe(max(0.0, orchestration_s))

    def load(self, running: int, waiting: int, k: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.k.set(k)
        self.enabled.set(1 if k > 0 else 0)

    # ---- request level (Router) -----------------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, gap_s: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.itl.observe(gap_s / num_tokens)

    def finished(self, prompt_tokens: int, output_tokens: int, reason: str | None, e2e_s: float,
                 cached_tokens: int = 0) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            self.prompt_tokens_cached.inc(cached_tokens)
        if output_tokens:
            self.generation_tokens.inc(output_tokens)
        self.request_success.inc(1, {"finished_reason": reason or "abort"})
        self.e2e.observe(e2e_s)

    def http(self, route: str, status: int) -> None:
        self.http_requests.inc(1, {"route": route, "status": str(status)})
