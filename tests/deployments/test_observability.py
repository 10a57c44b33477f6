"""A real Prometheus scraping a local Ray cluster that runs the app: metrics agree with the responses' usage.

Prometheus is Debian's `prometheus` package (the Makefile's test set-up installs it). Every Grafana panel's PromQL
runs against it, so a wrong metric name or query fails here.
"""

import json
import shutil
import subprocess
import time

import httpx
import pytest

from deployments import dashboard
from deployments.metrics import E2E_BUCKETS, EXPORTED_PREFIX as P, TTFT_BUCKETS
from tests.deployments.serve_cluster import BASE, free_port, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Name three fruits.", "Write a haiku about rain.", "What is 12 times 12?",
           "Give one tip for writing clear code."]


@pytest.fixture(scope="module")
def stack(readme_app_with_draft_model, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed; `make test` installs Debian's package")
    _, metrics_port = readme_app_with_draft_model
    tmp = tmp_path_factory.mktemp("obs")
    prom_port = free_port()
    (tmp / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }))
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{prom_port}/-/ready").status_code == 200, 60,
                   "prometheus to be ready")
        wait_until(lambda: _scalar(api, 'max(up{job="ray"})') == 1.0, 60, "prometheus to scrape Ray")
        yield api
    finally:
        prom.terminate()
        prom.wait(30)


def _query(api: str, expr: str) -> list:
    r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _scalar(api: str, expr: str) -> float | None:
    result = _query(api, expr)
    return float(result[0]["value"][1]) if result else None


def _stream(prompt: str) -> tuple[float, float, dict]:
    """TTFT and end-to-end latency as the client sees them, and the response's usage."""
    # fixed K: the speculative counters need drafts, and on a busy machine the adaptive policy may not draft
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "speculative": {"k": 3, "adaptive": False}}
    start, first, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{BASE}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return first - start, time.perf_counter() - start, usage


def _bucket_above(x: float, buckets: list[float]) -> float:
    return next((b for b in buckets if b >= x), float("inf"))


def test_prometheus_metrics_agree_with_usage(stack):
    api = stack
    runs = [_stream(p) for p in PROMPTS]
    usage = [u for _, _, u in runs]
    spec = [u["speculative"] for u in usage]
    drafted = sum(s["num_draft_tokens"] for s in spec)
    accepted = sum(s["num_accepted_tokens"] for s in spec)
    drafts = sum(s["num_drafts"] for s in spec)
    assert drafted > 0

    # counters reach exactly the sums of the responses' usage (a fresh cluster: this module runs first on it)
    total = lambda name: _scalar(api, f"sum({P}{name})")  # noqa: E731
    wait_until(lambda: total("e2e_request_latency_seconds_count") == len(PROMPTS)
               and total("spec_decode_num_draft_tokens_total") == drafted, 90, "metrics to reach Prometheus")
    assert total("spec_decode_num_accepted_tokens_total") == accepted
    assert total("spec_decode_num_drafts_total") == drafts
    assert total("generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    # a request's list is as long as the most drafts it used in a round (K shrinks near a request's end)
    for pos in range(max(len(s["accepted_per_position"]) for s in spec)):
        expected = sum(s["accepted_per_position"][pos] for s in spec if pos < len(s["accepted_per_position"]))
        got = _scalar(api, f'sum({P}spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}})')
        assert (got or 0) == expected, (pos, got, expected)

    # the dashboard's acceptance expressions, over the whole run instead of a rate window
    rate = _scalar(api, f"sum({P}spec_decode_num_accepted_tokens_total) / sum({P}spec_decode_num_draft_tokens_total)")
    assert rate == pytest.approx(accepted / drafted)
    length = _scalar(api, f"1 + sum({P}spec_decode_num_accepted_tokens_total) / sum({P}spec_decode_num_drafts_total)")
    assert length == pytest.approx(1 + accepted / drafts)

    # latency quantiles come back and agree with what the client measured: the server's clock starts after the
    # client's and stops before it, so each server quantile is at most the bucket bound above the client's
    for name, buckets, client in [("time_to_first_token_seconds", TTFT_BUCKETS, sorted(t for t, _, _ in runs)),
                                  ("e2e_request_latency_seconds", E2E_BUCKETS, sorted(e for _, e, _ in runs))]:
        for q, client_q in [(0.5, client[len(client) // 2]), (0.99, client[-1])]:
            server_q = _scalar(api, f"histogram_quantile({q}, sum by (le)({P}{name}_bucket))")
            assert server_q is not None and 0 < server_q <= _bucket_above(client_q, buckets), (name, q, server_q,
                                                                                                client_q)
    e2e_sum = total("e2e_request_latency_seconds_sum")  # Ray records observations at bucket midpoints
    assert 0 < e2e_sum <= sum(_bucket_above(e, E2E_BUCKETS) for _, e, _ in runs)


def test_every_dashboard_query_runs_and_returns_data(stack):
    api = stack
    _stream(PROMPTS[0])  # traffic inside the rate window
    queries = dashboard.concrete_queries(dashboard.build_dashboard(), rate_interval="5m")
    empty = lambda: [expr for expr in queries if not _query(api, expr)]  # noqa: E731
    try:  # rate() needs two scrapes after the traffic
        wait_until(lambda: not empty(), 60, "every dashboard query to return data")
    except TimeoutError:
        pass
    assert not empty(), f"queries with no data: {empty()}"
