"""The load generator end to end against the in-process app (tiny models): both modes, both load shapes."""

import argparse
import asyncio

import httpx

from bench import load_bench
from deployments.api.routes import create_app
from deployments.router.router import Router
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, tiny_config


def test_load_bench_runs_both_modes_and_writes_plots(tiny_model_dirs, tmp_path):
    config = tiny_config(tiny_model_dirs)
    router = Router(config, LocalBroker(config))
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    args = argparse.Namespace(model="tiny", prompts="bench/prompts.jsonl", concurrency=[1, 2], rates=[50.0],
                              requests=3, max_tokens=6, temperature=0.0, seed=0,
                              ignore_eos=True)

    async def go():
        transport = httpx.ASGITransport(app=create_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await load_bench.run_all(args, client)

    runs = asyncio.run(go())
    assert [(r.load, r.level, r.mode) for r in runs] == [
        (load, level, mode) for load, level in [("concurrency", 1.0), ("concurrency", 2.0), ("poisson", 50.0)]
        for mode in ("speculative", "plain")]
    for r in runs:
        assert r.requests == 3 and not r.errors and r.output_tokens_per_s > 0
        assert r.ttft_s["p50"] is not None and r.ttft_s["p50"] <= r.e2e_s["p50"]
        assert (r.acceptance_rate is None) == (r.mode == "plain"), "plain requests draft nothing"
    rows = load_bench.ratios(runs)
    assert len(rows) == 3 and all(row["throughput_ratio"] > 0 for row in rows)
    assert "speculative / plain" in load_bench.table(runs, rows)
    pngs = load_bench.plot(runs, tmp_path / "lb")
    assert [p.name for p in pngs] == ["lb_concurrency.png", "lb_poisson.png"]
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_failed_requests_are_counted_by_type():
    results = [load_bench.RequestResult(ok=False, error="http_503"), load_bench.RequestResult(ok=False,
               error="http_503"), load_bench.RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=0.05, output_tokens=9)]
    run = load_bench.summarize("plain", "concurrency", 1, results, 1.0)
    assert run.errors == {"http_503": 2} and run.requests_per_s == 1.0 and run.output_tokens_per_s == 9.0
