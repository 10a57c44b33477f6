"""The overload benchmark end to end against the in-process app over real HTTP (tiny models): what it counts, not
how fast (the figures come from the real Serve app, bench/RESULTS.md)."""

import argparse
import asyncio
import itertools
import json
from collections import Counter

import yaml

from bench import overload_bench
from deployments.router.router import Router
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, http_server, tiny_config
from tests.deployments.held_rounds import HeldRounds


def test_bursts_are_answered_in_full_and_refusals_counted(tiny_model_dirs, tmp_path, monkeypatch):
    capacity, factor = 2, 10
    size = factor * capacity
    config = tiny_config(tiny_model_dirs, limits={"max_live_sequences_per_router": capacity})
    broker = LocalBroker(config)
    router = Router(config, broker)
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    args = argparse.Namespace(model="tiny", prompts="bench/prompts.jsonl", capacity=capacity, factor=factor,
                              bursts=2, pause=0.0, max_tokens=24, timeout=120.0, reference=False)
    # each burst's admitted requests keep their places (their rounds held) until all its refusals are back, so the
    # burst meets the limit however slowly the machine runs; the warm-up request before the bursts runs freely
    rounds = HeldRounds(broker, monkeypatch)
    rounds.release()
    one, sent, refused = overload_bench.one, itertools.count(), Counter()

    async def held_one(*a, **kw):
        i = next(sent)
        if i == 0:
            return await one(*a, **kw)  # the warm-up
        burst, place = divmod(i - 1, size)
        if place == 0:
            rounds.hold()  # the burst's first request: nothing is on the way (the last burst was gathered)
        r = await one(*a, **kw)
        if r["status"] == 503:
            refused[burst] += 1
            if refused[burst] == size - capacity:
                rounds.release()
        return r

    monkeypatch.setattr(overload_bench, "one", held_one)
    with http_server(router) as base, rounds:
        results, per_burst = asyncio.run(overload_bench.bursts(args, base))
    assert len(results) == 2 * size and [b["burst"] for b in per_burst] == [0, 1]
    summary = overload_bench.summarize(results, target_ms=100.0)
    counts = summary["counts"]
    assert set(counts) <= {"200", "503"} and summary["hung"] == 0, counts  # every request answered
    assert counts == {"200": 2 * capacity, "503": 2 * (size - capacity)}, counts  # the limit, per burst
    assert summary["refused_with_retry_after"] == counts["503"]
    assert summary["refusal_codes"] == {"overloaded": counts["503"]}
    assert summary["refusal_latency"]["n"] == counts["503"]
    assert summary["refusal_latency"]["p50_ms"] <= summary["refusal_latency"]["max_ms"]
    assert summary["admitted_total"]["n"] == counts["200"]
    assert {r["stream"] for r in results} == {True, False}
    json.dumps(summary)  # what the benchmark writes
    assert router.scheduler.num_live == 0


def test_reference_bursts_are_timed_and_summarized(tiny_model_dirs):
    router = Router(tiny_config(tiny_model_dirs), LocalBroker(tiny_config(tiny_model_dirs)))

    async def go(base):
        import httpx

        async with httpx.AsyncClient(base_url=base) as client:
            return await overload_bench.reference_burst(client, "/health", 6, 30.0)

    with http_server(router) as base:
        seconds = asyncio.run(go(base))
    assert len(seconds) == 6 and all(s > 0 for s in seconds)
    summary = overload_bench.summarize([], 100.0, [{"reference": {"/health": seconds}}, {"reference": {}}])
    assert summary["reference_latency"]["/health"]["n"] == 6
    assert "/-/healthz" not in summary["reference_latency"]


def test_limited_config_sets_the_limit_and_one_router(tmp_path):
    out = overload_bench.limited_config(overload_bench.Path("serve_config.yaml"), 3, tmp_path / "c.yaml")
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    assert args["limits"]["max_live_sequences_per_router"] == 3
    assert args["router"]["min_replicas"] == args["router"]["max_replicas"] == 1
    from deployments.config import SpecServeConfig

    SpecServeConfig.model_validate(args)  # still a valid config
