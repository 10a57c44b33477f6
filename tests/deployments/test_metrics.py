"""The router's metrics agree with the responses' own usage statistics (recording backend, no cluster)."""

import asyncio
from collections import defaultdict

from deployments.metrics import ServingMetrics
from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, tiny_config, write_profile
from tests.deployments.router.test_router import client, complete


class _Metric:
    def __init__(self, store, name, description="", boundaries=None, tag_keys=()):
        assert ":" not in name, "Ray deprecates ':' in metric names"
        self.store, self.name, self.tag_keys, self.default = store, name, tuple(tag_keys), {}
        self.boundaries = boundaries

    def set_default_tags(self, tags):
        self.default = dict(tags)

    def _key(self, tags):
        merged = {**self.default, **(tags or {})}
        assert set(merged) == set(self.tag_keys), (self.name, merged, self.tag_keys)
        return self.name, tuple(sorted(merged.items()))

    def inc(self, value=1.0, tags=None):
        assert value > 0
        self.store.counters[self._key(tags)] += value

    def observe(self, value, tags=None):
        self.store.observations[self._key(tags)].append(value)

    def set(self, value, tags=None):
        self.store.gauges[self._key(tags)] = value


class RecordingBackend:
    def __init__(self):
        self.counters = defaultdict(float)
        self.observations = defaultdict(list)
        self.gauges = {}
        self.Counter = self.Histogram = self.Gauge = lambda *a, **kw: _Metric(self, *a, **kw)

    def total(self, table, name, **labels):
        return sum(v if table != "observations" else len(v) for (n, tags), v in getattr(self, table).items()
                   if n == name and all((k, val) in tags for k, val in labels.items()))


def test_counters_and_histograms_match_usage(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs)
    backend = RecordingBackend()
    router = Router(config, LocalBroker(config), metrics=ServingMetrics("tiny", backend))

    async def go():
        async with client(router) as c:
            ok = await asyncio.gather(*[complete(c, prompt=[5 + i, 6, 7], max_tokens=12 + 4 * i) for i in range(3)])
            bad = await complete(c, model="nope")
            return [r.json() for r in ok], bad.status_code

    bodies, bad_status = asyncio.run(go())
    assert bad_status == 404
    usage = [b["usage"] for b in bodies]
    spec = [u["speculative"] for u in usage]
    p = "specserve_"
    assert backend.total("counters", p + "spec_decode_num_drafts") == sum(s["num_drafts"] for s in spec) > 0
    assert backend.total("counters", p + "spec_decode_num_draft_tokens") == sum(s["num_draft_tokens"] for s in spec)
    assert backend.total("counters", p + "spec_decode_num_accepted_tokens") == sum(
        s["num_accepted_tokens"] for s in spec)
    for pos in range(config.speculation.num_speculative_tokens):
        assert backend.total("counters", p + "spec_decode_num_accepted_tokens_per_pos", position=str(pos)) == sum(
            s["accepted_per_position"][pos] for s in spec)
    assert backend.total("counters", p + "generation_tokens") == sum(u["completion_tokens"] for u in usage)
    assert backend.total("counters", p + "prompt_tokens") == sum(u["prompt_tokens"] for u in usage)
    assert backend.total("counters", p + "request_success", finished_reason="length") == 3
    assert backend.total("observations", p + "time_to_first_token_seconds") == 3
    assert backend.total("observations", p + "e2e_request_latency_seconds") == 3
    assert backend.total("observations", p + "inter_token_latency_seconds") == sum(s["rounds"] for s in spec) - 3
    assert backend.total("counters", p + "http_requests", route="/v1/completions", status="200") == 3
    assert backend.total("counters", p + "http_requests", route="/v1/completions", status="404") == 1
    assert backend.gauges[(p + "num_requests_running", (("model_name", "tiny"),))] == 0
    ttft = backend.observations[(p + "time_to_first_token_seconds", (("model_name", "tiny"),))]
    e2e = backend.observations[(p + "e2e_request_latency_seconds", (("model_name", "tiny"),))]
    assert all(0 < t <= e for t, e in zip(sorted(ttft), sorted(e2e)))


def test_rounds_with_nothing_accepted_or_nothing_drafted_record_cleanly():
    backend = RecordingBackend()  # like Ray's counters, it refuses increments of 0
    metrics = ServingMetrics("m", backend)
    metrics.round([3, 3], [0, 0], 0.01, 0.02, 0.001)  # every draft rejected
    metrics.round([0], [0], 0.0, 0.02, 0.001)  # plain decoding round
    metrics.finished(0, 0, None, 0.1)  # aborted before anything happened
    assert backend.total("counters", "specserve_spec_decode_num_drafts") == 2
    assert backend.total("counters", "specserve_spec_decode_num_draft_tokens") == 6
    assert backend.total("counters", "specserve_spec_decode_num_accepted_tokens") == 0
    assert backend.total("counters", "specserve_request_success", finished_reason="abort") == 1


def test_k_and_on_off_gauges_follow_the_policy(tiny_model_dirs, tmp_path):
    """Under load past the profile's knee the gauges read K = 0 and off; with one request, K > 0 and on."""
    config = tiny_config(tiny_model_dirs, speculation={"adaptive": True,
                                                       "calibration": write_profile(tmp_path / "c.json", 2)})
    backend = RecordingBackend()
    router = Router(config, LocalBroker(config), metrics=ServingMetrics("tiny", backend))
    k_key, on_key = (("specserve_" + n, (("model_name", "tiny"),)) for n in ("spec_decode_k", "spec_decode_enabled"))
    seen = []
    set_gauge = _Metric.set

    def recording_set(metric, value, tags=None):
        set_gauge(metric, value, tags)
        if metric.name.endswith(("spec_decode_k", "spec_decode_enabled", "num_requests_running")):
            seen.append((metric.name.removeprefix("specserve_"), value))

    _Metric.set = recording_set
    try:
        async def go():
            async with client(router) as c:
                await asyncio.gather(*[complete(c, prompt=[5 + i, 6, 7], max_tokens=8) for i in range(4)])
                await complete(c, max_tokens=8)
        asyncio.run(go())
    finally:
        _Metric.set = set_gauge
    # gauges are set in this order per round: running, waiting (not kept), k, enabled
    rounds = [(seen[i][1], seen[i + 1][1], seen[i + 2][1]) for i in range(0, len(seen) - 2)
              if seen[i][0] == "num_requests_running" and seen[i + 1][0] == "spec_decode_k"]
    assert any(running == 4 and k == 0 and on == 0 for running, k, on in rounds), rounds
    assert any(running == 1 and k > 0 and on == 1 for running, k, on in rounds), rounds
    assert backend.gauges[k_key] == 0 and backend.gauges[on_key] == 0, "idle: no drafting"
