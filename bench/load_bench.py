"""Serving load benchmark: speculative vs plain decoding of the same target, over HTTP, streaming.

Start the server (`make run`), then:

    python -m bench.load_bench                                   # concurrency 1, 4, 16
    python -m bench.load_bench --concurrency 1 2 4 8 16 --rates 0.5 1 2

Every load point runs twice in one invocation: speculative (the server's config) and plain (the same requests
with the extension field `"speculative": {"enabled": false}`, so the same target decodes without a draft).
- Fixed concurrency: C clients, each sending its next request when the previous one finished.
- Poisson arrivals: requests start at exponentially distributed gaps (mean 1/rate), however many are in flight.
Prompts: bench/prompts.jsonl (chat, summarization, code), cycled. Per run: requests/s, output tokens/s, TTFT and
inter-token latency p50/p90/p99, acceptance rate (from the responses' `usage.speculative`), errors by type.
Inter-token latency is per request: (last chunk - first chunk) / (output tokens - 1), because a speculative
round streams several tokens in one chunk. Writes JSON and two PNG charts (throughput and latency against load,
both modes on one chart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: float | None = None
    output_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class RunResult:
    mode: str  # "speculative" | "plain"
    load: str  # "concurrency" | "poisson"
    level: float  # clients, or requests/s
    requests: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_s: dict
    itl_s: dict
    e2e_s: dict
    acceptance_rate: float | None
    errors: dict = field(default_factory=dict)


def load_prompts(path: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in Path(path).read_text().splitlines() if line.strip()]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}


async def one_request(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                      temperature: float, speculative: bool | dict, ignore_eos: bool = False) -> RequestResult:
    """One streaming chat request; `speculative` False = plain, a dict = the request's speculation options."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if isinstance(speculative, dict):
        body["speculative"] = speculative
    elif not speculative:
        body["speculative"] = {"enabled": False}
    start = time.perf_counter()
    first = last = None
    usage = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return RequestResult(ok=False, error=f"http_{r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error="stream_error")
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=type(exc).__name__)
    end = time.perf_counter()
    if usage is None:
        return RequestResult(ok=False, error="no_usage")
    n = usage["completion_tokens"]
    spec = usage.get("speculative") or {}
    return RequestResult(
        ok=True, ttft=(first - start) if first is not None else None, e2e=end - start,
        itl=(last - first) / (n - 1) if first is not None and n > 1 else None, output_tokens=n,
        drafted=spec.get("num_draft_tokens", 0), accepted=spec.get("num_accepted_tokens", 0))


async def run_concurrency(client, model, prompts, clients: int, total: int, max_tokens: int, temperature: float,
                          speculative: bool | dict, progress: tqdm, ignore_eos: bool = False
                          ) -> tuple[list[RequestResult], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[RequestResult] = []

    async def worker():
        while not queue.empty():
            messages = queue.get_nowait()
            results.append(await one_request(client, model, messages, max_tokens, temperature, speculative,
                                              ignore_eos))
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - start


async def run_poisson(client, model, prompts, rate: float, total: int, max_tokens: int, temperature: float,
                      speculative: bool, progress: tqdm, seed: int, ignore_eos: bool = False
                      ) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)  # the same arrival times for both modes

    async def timed(messages):
        result = await one_request(client, model, messages, max_tokens, temperature, speculative, ignore_eos)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for i in range(total):
        tasks.append(asyncio.create_task(timed(prompts[i % len(prompts)])))
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(mode: str, load: str, level: float, results: list[RequestResult], duration: float) -> RunResult:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    drafted = sum(r.drafted for r in ok)
    return RunResult(
        mode=mode, load=load, level=level, requests=len(results), duration_s=duration,
        requests_per_s=len(ok) / duration, output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft_s=percentiles([r.ttft for r in ok if r.ttft is not None]),
        itl_s=percentiles([r.itl for r in ok if r.itl is not None]),
        e2e_s=percentiles([r.e2e for r in ok]),
        acceptance_rate=(sum(r.accepted for r in ok) / drafted) if drafted else None, errors=errors)


async def run_all(args, client: httpx.AsyncClient) -> list[RunResult]:
    prompts = load_prompts(args.prompts)
    points = [("concurrency", float(c)) for c in args.concurrency] + [("poisson", r) for r in args.rates]
    sizes = {p: (args.requests or max(8, 2 * int(p[1]))) if p[0] == "concurrency" else (args.requests or 16)
             for p in points}
    runs: list[RunResult] = []
    await one_request(client, args.model, prompts[0], 4, args.temperature, True)  # warm-up
    with tqdm(total=2 * sum(sizes.values()), unit="req", desc="load_bench") as progress:
        for load, level in points:
            for mode in ("speculative", "plain"):
                progress.set_postfix_str(f"{load}={level:g} {mode}")
                speculative = mode == "speculative"
                if load == "concurrency":
                    results, duration = await run_concurrency(client, args.model, prompts, int(level),
                                                              sizes[(load, level)], args.max_tokens,
                                                              args.temperature, speculative, progress,
                                                              args.ignore_eos)
                else:
                    results, duration = await run_poisson(client, args.model, prompts, level, sizes[(load, level)],
                                                          args.max_tokens, args.temperature, speculative, progress,
                                                          args.seed, args.ignore_eos)
                runs.append(summarize(mode, load, level, results, duration))
    return runs


def ratios(runs: list[RunResult]) -> list[dict]:
    by_key = {(r.load, r.level, r.mode): r for r in runs}
    out = []
    for (load, level, mode), spec in by_key.items():
        plain = by_key.get((load, level, "plain"))
        if mode != "speculative" or plain is None:
            continue
        out.append({"load": load, "level": level,
                    "throughput_ratio": spec.output_tokens_per_s / plain.output_tokens_per_s
                    if plain.output_tokens_per_s else None,
                    "itl_p50_ratio": (spec.itl_s["p50"] / plain.itl_s["p50"])
                    if spec.itl_s["p50"] and plain.itl_s["p50"] else None})
    return out


def table(runs: list[RunResult], rows: list[dict]) -> str:
    ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    head = (f"{'load':12s} {'mode':11s} {'req':>4s} {'req/s':>6s} {'tok/s':>7s} {'ttft p50/p90/p99 ms':>21s} "
            f"{'itl p50/p90/p99 ms':>19s} {'accept':>6s} errors")
    lines = [head, "-" * len(head)]
    for r in runs:
        load = f"c={r.level:g}" if r.load == "concurrency" else f"{r.level:g} req/s"
        lines.append(
            f"{load:12s} {r.mode:11s} {r.requests:4d} {r.requests_per_s:6.2f} {r.output_tokens_per_s:7.1f} "
            f"{'/'.join(ms(r.ttft_s[k]) for k in ('p50', 'p90', 'p99')):>21s} "
            f"{'/'.join(ms(r.itl_s[k]) for k in ('p50', 'p90', 'p99')):>19s} "
            f"{'-' if r.acceptance_rate is None else f'{r.acceptance_rate:.2f}':>6s} {r.errors or ''}")
    lines.append("")
    lines.append("speculative / plain:")
    for row in rows:
        load = f"c={row['level']:g}" if row["load"] == "concurrency" else f"{row['level']:g} req/s"
        tput = "-" if row["throughput_ratio"] is None else f"{row['throughput_ratio']:.2f}x"
        itl = "-" if row["itl_p50_ratio"] is None else f"{row['itl_p50_ratio']:.2f}x"
        lines.append(f"  {load:12s} output tokens/s {tput:>6s}   itl p50 {itl:>6s}")
    return "\n".join(lines)


def plot(runs: list[RunResult], out_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for load, xlabel in (("concurrency", "concurrent streams"), ("poisson", "arrival rate (requests/s)")):
        points = [r for r in runs if r.load == load]
        if not points:
            continue
        fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
        for mode, style in (("speculative", "o-"), ("plain", "s--")):
            rs = sorted((r for r in points if r.mode == mode), key=lambda r: r.level)
            x = [r.level for r in rs]
            ax_t.plot(x, [r.output_tokens_per_s for r in rs], style, label=mode)
            ax_l.plot(x, [1000 * (r.itl_s["p50"] or np.nan) for r in rs], style, label=f"{mode} ITL p50")
            ax_l.plot(x, [1000 * (r.ttft_s["p50"] or np.nan) for r in rs], style, alpha=0.5,
                      label=f"{mode} TTFT p50")
        ax_t.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
        ax_l.set(xlabel=xlabel, ylabel="ms", title="Latency", yscale="log")
        for ax in (ax_t, ax_l):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if load == "concurrency":
                ax.set_xscale("log", base=2)
        fig.tight_layout()
        path = out_prefix.with_name(f"{out_prefix.name}_{load}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson arrival rates, requests/s")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per load point (default: max(8, 2 x concurrency); 16 per Poisson rate)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    ap.add_argument("--out", default="bench/results/load_bench", help="prefix of the .json and .png outputs")
    args = ap.parse_args(argv)

    async def go():
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        async with httpx.AsyncClient(base_url=args.base, timeout=600, headers=headers, limits=limits) as client:
            return await run_all(args, client)

    runs = asyncio.run(go())
    rows = ratios(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": [asdict(r) for r in runs],
                                                    "speculative_vs_plain": rows}, indent=2))
    pngs = plot(runs, out)
    print(table(runs, rows))
    print(f"\nwrote {out.with_suffix('.json')} " + " ".join(str(p) for p in pngs))


if __name__ == "__main__":
    main()
