"""How long a long prompt stalls running streams: chunked against unchunked prefill (issue 16, item 5).

For each variant, starts our server (`serve run` of serve_config.yaml with `runner.prefill_chunk` set; one server
at a time, stopped fully after), opens `--streams` greedy streaming completions of `--stream-tokens` tokens
(`ignore_eos`), waits until every stream has produced tokens, then sends one completion whose prompt is
`--prompt-tokens` tokens long. The streams' inter-chunk gaps (the time between two streamed chunks of one stream,
what a reader of the stream sees as a stall) are split into those while the long prompt is in flight (sent until
its first token) and the rest; reported: p50 / p99 / max of each, the long prompt's TTFT, and the `/stats`
`prefill_chunks` count. "Unchunked" is a chunk as long as the context window, so the prompt goes in one forward.

    python -m bench.prefill_stall --chunks 256 2048 --out bench/results/prefill_stall.json

Writes JSON and a PNG of the gaps over time beside it; the servers' logs go to `<out stem>_runs/`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from bench.peer_servers import (
    ROOT,
    ManagedServer,
    derive_ours_config,
    machine_params,
    parse_overrides,
    port_free,
    serve_run_argv,
)


def long_prompt(tokenizer, n_tokens: int) -> str:
    """Text that tokenizes to `n_tokens` tokens (give or take the tokenizer's merges at the cut)."""
    sentence = ("The committee reviewed the quarterly figures, compared them with the previous year, and asked "
                "each department to explain the largest changes in spending and revenue. ")
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tokenizer.encode(sentence, add_special_tokens=False)
    return tokenizer.decode(ids[:n_tokens]) + "\n\nSummarize the text above in one sentence:"


async def stream(client: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int,
                 times: list[float], extra: dict | None = None, chunks: list[dict] | None = None) -> None:
    """A greedy streaming completion; appends the arrival time of each content chunk to `times`, and every parsed
    chunk to `chunks` if given (its text, and with `extra` {"stream_options": {"include_usage": True}} the usage).
    `extra`: more request fields."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunks is not None:
                    chunks.append(chunk)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())


def pct(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1e3
    return {"n": len(values), "p50_ms": round(float(np.percentile(a, 50)), 1),
            "p99_ms": round(float(np.percentile(a, 99)), 1), "max_ms": round(float(a.max()), 1)}


def split_gaps(times: list[list[float]], sent: float, first: float
               ) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Each stream's gaps between consecutive chunks: (those overlapping [sent, first], the others, and every gap
    as (its end - sent, gap))."""
    during, other, series = [], [], []
    for t in times:
        for a, b in zip(t, t[1:]):
            (during if b > sent and a < first else other).append(b - a)
            series.append((b - sent, b - a))
    return during, other, series


async def measure(base_url: str, model: str, prompt: str, args) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        before = (await client.get("/stats")).json()
        times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, model, f"Story {i}: Once upon a time", args.stream_tokens, t))
                 for i, t in enumerate(times)]
        while min(len(t) for t in times) < args.settle_chunks:
            await asyncio.sleep(0.05)
            for task in tasks:
                if task.done():
                    task.result()  # raises the stream's error
        long_times: list[float] = []
        sent = time.perf_counter()
        await stream(client, model, prompt, 8, long_times)
        first = long_times[0]
        await asyncio.gather(*tasks)
        after = (await client.get("/stats")).json()
    during, other, series = split_gaps(times, sent, first)
    return {"long_prompt_ttft_s": round(first - sent, 3), "gaps_while_prefilling": pct(during),
            "gaps_otherwise": pct(other), "all_gaps": pct(during + other),
            "prefill_chunks": after.get("prefill_chunks", 0) - before.get("prefill_chunks", 0),
            "series": [(round(x, 3), round(g * 1e3, 1)) for x, g in series]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 2048], help="runner.prefill_chunk per variant")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--settle-chunks", type=int, default=5, help="chunks every stream has before the prompt")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="override in the config's application args, e.g. model.draft=smollm2")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default="bench/results/prefill_stall.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.models.loading import resolve

    base = yaml.safe_load((ROOT / args.config).read_text())
    model_args = base["applications"][0]["args"]["model"]
    model_dir = str(resolve(model_args["target"]).directory)
    prompt = long_prompt(AutoTokenizer.from_pretrained(model_dir), args.prompt_tokens)
    out = Path(args.out)
    runs_dir = out.with_name(out.stem + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_params(), "args": vars(args), "variants": {}}
    for chunk in args.chunks:
        name = f"prefill_chunk_{chunk}"
        cfg = derive_ours_config(base, {**parse_overrides(args.overrides), "runner.prefill_chunk": chunk}, args.port)
        cfg_path = runs_dir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        if not port_free(args.port):
            raise SystemExit(f"port {args.port} is busy")
        argv = serve_run_argv(cfg_path)
        server = ManagedServer(name, argv, f"http://127.0.0.1:{args.port}", model_args["served_model_name"],
                               runs_dir / f"{name}.log")
        server.start()
        try:
            server.wait_ready(args.startup_timeout)
            result = asyncio.run(measure(server.base_url, server.model_name, prompt, args))
        finally:
            survivors = server.stop()
        result["survivors"] = survivors
        report["variants"][name] = result
        row = {k: v for k, v in result.items() if k != "series"}
        print(name, json.dumps(row), flush=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"{'prefill_chunk':>13} | {'gaps while prefilling p50 / p99 / max (ms)':>42} | {'otherwise p99':>13} | "
          f"{'long TTFT s':>11} | chunks")
    for name, r in report["variants"].items():
        g, o = r["gaps_while_prefilling"], r["gaps_otherwise"]
        print(f"{name.rsplit('_', 1)[1]:>13} | {g.get('p50_ms')!s:>12} / {g.get('p99_ms')!s:>8} / "
              f"{g.get('max_ms')!s:>8}     | {o.get('p99_ms')!s:>13} | {r['long_prompt_ttft_s']:>11} | "
              f"{r['prefill_chunks']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for name, r in report["variants"].items():
            xs, gs = zip(*r["series"]) if r["series"] else ((), ())
            ax.scatter(xs, gs, s=6, label=f"{name} (long TTFT {r['long_prompt_ttft_s']} s)")
        ax.set_xlabel("s since the long prompt was sent")
        ax.set_ylabel("gap between a stream's chunks (ms)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
