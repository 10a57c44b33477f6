"""Overload benchmark: bursts of 10x the admission limit against the real Serve app; how fast refusals come back.

The benchmark writes a copy of serve_config.yaml with a small admission limit (`limits.max_live_sequences_per_router`,
one Router replica so the limit is the whole app's), starts it the way the README does (a local Ray head, then
`serve run`), and fires bursts of `--factor` x capacity requests at once (half streaming, half not; greedy; prompts
from bench/prompts.jsonl). Each request is timed from sending to its response headers: for a refusal (503 or 429)
that is the refusal latency, for an admitted request the time to the headers (the whole answer when not streaming,
the first token when streaming). Every request must be answered within `--timeout` (else it counts as hung).

    python -m bench.overload_bench                         # capacity 4, 5 bursts of 40 requests
    python -m bench.overload_bench --url http://127.0.0.1:8000 --capacity 64   # a server already running

After each burst's refusals are back, and while its admitted requests decode, two reference bursts of the same size
measure the floor under the same load: GET /health (the cheapest request through the proxy and the Router replica,
the path a refusal takes) and GET /-/healthz (answered by Serve's proxy alone).

Issue 6's target: refusals (503/429 with Retry-After) within 100 ms. Prints the figures and writes JSON
(bench/results/overload_bench.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from bench.load_bench import load_prompts

REFUSED = (429, 503)
# the cheapest requests through the proxy and the Router replica, and through the proxy alone (Serve's own route)
REFERENCE_ROUTES = ("/health", "/-/healthz")


def limited_config(base: Path, capacity: int, out: Path) -> Path:
    from tests.deployments.serve_cluster import config_variant

    return config_variant(base, {"limits": {"max_live_sequences_per_router": capacity},
                                 "router": {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}}, out)


async def one(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int, stream: bool,
              timeout: float) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    start = time.perf_counter()

    async def exchange() -> dict:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            headers_s = time.perf_counter() - start
            await r.aread()  # the refusal's JSON, or the whole answer / stream
            return {"status": r.status_code, "stream": stream, "headers_s": headers_s,
                    "total_s": time.perf_counter() - start, "retry_after": r.headers.get("retry-after"),
                    "code": _error_code(r) if r.status_code != 200 else None}

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        return {"status": "hung", "stream": stream, "headers_s": None, "total_s": timeout}
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "stream": stream, "headers_s": None,
                "total_s": time.perf_counter() - start}


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def bursts(args, base: str) -> tuple[list[dict], list[dict]]:
    prompts = load_prompts(args.prompts)
    size = args.factor * args.capacity
    limits = httpx.Limits(max_connections=size + 8, max_keepalive_connections=size + 8)
    results, per_burst = [], []
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        warm = await one(client, args.model, prompts[0], 8, False, args.timeout)  # connections, caches
        if warm["status"] != 200:
            raise RuntimeError(f"the server does not answer a plain request: {warm}")
        for b in range(args.bursts):
            started = time.perf_counter()
            tasks = [asyncio.create_task(one(client, args.model, prompts[(b * size + i) % len(prompts)],
                                             args.max_tokens, i % 2 == 0, args.timeout)) for i in range(size)]
            reference = {}
            if args.reference:
                # once the refusals are back and the admitted requests decode: as many of the cheapest requests
                # through the same path at once, the floor a refusal's latency can be compared with
                await _until_done(tasks, size - args.capacity, args.timeout)
                for path in REFERENCE_ROUTES:
                    reference[path] = await reference_burst(client, path, size - args.capacity, args.timeout)
            burst = await asyncio.gather(*tasks)
            for r in burst:
                r["burst"] = b
            results += burst
            counts = Counter(str(r["status"]) for r in burst)
            per_burst.append({"burst": b, "seconds": time.perf_counter() - started, "counts": dict(counts),
                              "reference": reference})
            print(f"burst {b}: {size} requests in {per_burst[-1]['seconds']:.1f} s: {dict(counts)}")
            await asyncio.sleep(args.pause)
    return results, per_burst


async def _until_done(tasks: list[asyncio.Task], count: int, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while sum(t.done() for t in tasks) < count and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)


async def reference_burst(client: httpx.AsyncClient, path: str, size: int, timeout: float) -> list[float]:
    """Seconds to the response headers of `size` concurrent GETs of `path`."""
    async def get() -> float:
        start = time.perf_counter()
        async with client.stream("GET", path, timeout=timeout) as r:
            seconds = time.perf_counter() - start
            await r.aread()
            if r.status_code != 200:
                raise RuntimeError(f"GET {path} answered {r.status_code}")
            return seconds

    return list(await asyncio.gather(*[get() for _ in range(size)]))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values) * 1000
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max()), "n": len(values)}


def summarize(results: list[dict], target_ms: float, per_burst: list[dict] | None = None) -> dict:
    refused = [r for r in results if r["status"] in REFUSED]
    admitted = [r for r in results if r["status"] == 200]
    reference = {path: percentiles([s for b in per_burst or [] for s in b.get("reference", {}).get(path, [])])
                 for path in REFERENCE_ROUTES}
    return {
        "reference_latency": {path: p for path, p in reference.items() if p},
        "requests": len(results),
        "counts": dict(Counter(str(r["status"]) for r in results)),
        "hung": sum(r["status"] == "hung" for r in results),
        "refused_with_retry_after": sum(r.get("retry_after") is not None for r in refused),
        "refusal_codes": dict(Counter(str(r.get("code")) for r in refused)),
        "refusal_latency": percentiles([r["headers_s"] for r in refused]),
        "refusal_latency_streaming": percentiles([r["headers_s"] for r in refused if r["stream"]]),
        "refusal_latency_non_streaming": percentiles([r["headers_s"] for r in refused if not r["stream"]]),
        "refusals_within_target": sum(r["headers_s"] * 1000 <= target_ms for r in refused),
        "admitted_headers": percentiles([r["headers_s"] for r in admitted]),
        "admitted_total": percentiles([r["total_s"] for r in admitted]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve_config.yaml", help="the config to start, with the limit replaced")
    ap.add_argument("--url", default=None, help="benchmark a server already running here instead of starting one")
    ap.add_argument("--capacity", type=int, default=4, help="max_live_sequences_per_router of the started app")
    ap.add_argument("--factor", type=int, default=10, help="burst size as a multiple of the capacity")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between bursts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300.0, help="a request unanswered this long counts as hung")
    ap.add_argument("--target-ms", type=float, default=100.0, help="the refusal latency target (issue 6)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip the reference bursts (GET /health, GET /-/healthz) after each burst's refusals")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--out", default="bench/results/overload_bench.json")
    args = ap.parse_args(argv)

    if args.url:
        results, per_burst = asyncio.run(bursts(args, args.url))
    else:
        from tests.deployments.serve_cluster import BASE, ROOT, serve_app

        with tempfile.TemporaryDirectory() as tmp:
            config = limited_config(ROOT / args.config, args.capacity, Path(tmp) / "overload.yaml")
            with serve_app(Path(tmp), config=str(config)):
                results, per_burst = asyncio.run(bursts(args, BASE))
    summary = summarize(results, args.target_ms, per_burst)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "bursts": per_burst, "requests": results},
                              indent=2))
    lat = summary["refusal_latency"]
    print(f"\n{summary['requests']} requests in {args.bursts} bursts of {args.factor} x {args.capacity}: "
          f"{summary['counts']}, hung {summary['hung']}")
    if lat:
        print(f"refusals: {lat['n']}, with Retry-After {summary['refused_with_retry_after']}, codes "
              f"{summary['refusal_codes']}")
        print(f"refusal latency ms: p50 {lat['p50_ms']:.1f}  p90 {lat['p90_ms']:.1f}  p99 {lat['p99_ms']:.1f}  "
              f"max {lat['max_ms']:.1f}; within {args.target_ms:.0f} ms: {summary['refusals_within_target']}")
        for kind in ("streaming", "non_streaming"):
            s = summary[f"refusal_latency_{kind}"]
            if s:
                print(f"  {kind:14s} p50 {s['p50_ms']:.1f}  p99 {s['p99_ms']:.1f}  max {s['max_ms']:.1f} (n={s['n']})")
    for path, ref in summary["reference_latency"].items():
        print(f"reference: bursts of GET {path}, same size and load: p50 {ref['p50_ms']:.1f}  p99 {ref['p99_ms']:.1f}  "
              f"max {ref['max_ms']:.1f}")
    adm = summary["admitted_total"]
    if adm:
        print(f"admitted: {adm['n']}, answer complete p50 {adm['p50_ms']:.0f} ms, max {adm['max_ms']:.0f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
