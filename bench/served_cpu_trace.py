"""Where a served run's CPU time goes: our server under a streaming client, per-process CPU seconds and the router's
rounds (issue 16; not a timed test).

    .venv/bin/python -m bench.served_cpu_trace --config bench/results/peer_serve_runs/ours-plain.yaml \
        --concurrency 1 8 16 --env SPECSERVE_POOL=openmp --tag openmp

Starts `serve run` of --config as `make run` does (deployments/ray_env.py's HAProxy settings) with any --env
variables added to the server's environment (the Ray workers inherit them), readies it with a completion, then
per concurrency C: one warm-up wave of C requests, then --reps measured runs of max(2C, 8) requests (the prompts
of bench/prompts.jsonl, or --prompts, rendered by the model's chat template, 64 greedy tokens, `ignore_eos`, streamed)
from C concurrent httpx streams. Prints per run: tokens/s over the run's wall time, TTFT and inter-token gaps, the
router's rounds (/stats: count, mean batch, draft/verify/compute/orchestration ms per round, and how much of the wall
time rounds filled), and the CPU seconds of the ten busiest processes on the machine (/proc) against the machine's CPU
seconds in that time. Writes nothing; the output is the record.

The client is a small asyncio loop, not vLLM's benchmark client (bench/peer_serve.py is the comparison with vLLM):
it costs this machine less CPU, so the server's own share is easier to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.cpu_profile import processes
from bench.load_bench import load_prompts
from bench.peer_servers import ManagedServer, serve_run_argv
from bench.prefill_stall import stream
from bench.server_counters import round_timings
from deployments.ray_env import SERVE_ENV

ROOT = Path(__file__).resolve().parents[1]


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(when it was sent, when each chunk with text arrived) of one greedy streaming completion."""
    start, arrivals = time.perf_counter(), []
    await stream(client, model, prompt, max_tokens, arrivals)
    return start, arrivals


async def drive(base_url: str, model: str, prompts: list[str], concurrency: int, n: int,
                max_tokens: int) -> list[tuple[float, list[float]]]:
    queue, records = list(range(n)), []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                records.append(await stream_one(client, model, prompts[i % len(prompts)], max_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a serve config (e.g. one bench.peer_serve wrote)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=str(ROOT / "bench/prompts.jsonl"),
                    help="chat prompts, one {\"messages\": [...]} per line (bench/prompts_long.jsonl: ~900 tokens each)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="added to the server's env")
    ap.add_argument("--tag", default="ours")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)

    app = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    model, target = app["model"]["served_model_name"], app["model"]["target"]
    from transformers import AutoTokenizer

    from engine.models.loading import resolve
    tok = AutoTokenizer.from_pretrained(str(resolve(target).directory))
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in load_prompts(args.prompts)]
    env = {**os.environ, **SERVE_ENV, **dict(item.split("=", 1) for item in args.env)}
    base_url = f"http://127.0.0.1:{args.port}"
    log = Path(f"/tmp/served_cpu_trace_{args.tag}.log")
    server = ManagedServer(args.tag, serve_run_argv(args.config), base_url, model, log, env=env)
    server.start()
    try:
        server.wait_ready(900)
        for c in args.concurrency:
            n = max(2 * c, 8)
            asyncio.run(drive(base_url, model, prompts, c, c, args.max_tokens))  # warm-up wave
            for rep in range(args.reps):
                stats0, cpu0, t0 = httpx.get(base_url + "/stats").json(), processes(), time.perf_counter()
                records = asyncio.run(drive(base_url, model, prompts, c, n, args.max_tokens))
                wall = time.perf_counter() - t0
                cpu1, stats1 = processes(), httpx.get(base_url + "/stats").json()
                tokens = sum(len(arrivals) for _, arrivals in records)
                gaps = sorted(b - a for _, arrivals in records for a, b in zip(arrivals, arrivals[1:]))
                ttft = [arrivals[0] - start for start, arrivals in records]
                rounds = round_timings(stats0, stats1)
                filled = rounds["rounds"] * sum(rounds.get(k, 0.0) for k in (
                    "draft_ms_per_round", "verify_ms_per_round", "orchestration_ms_per_round")) / 1e3
                print(f"[{args.tag} c={c} rep {rep}] {n} requests, wall {wall:.2f} s, {tokens / wall:.1f} tok/s, "
                      f"TTFT mean {1e3 * statistics.mean(ttft):.0f} ms, inter-token mean "
                      f"{1e3 * statistics.mean(gaps):.1f} p50 {1e3 * gaps[len(gaps) // 2]:.1f} "
                      f"p90 {1e3 * gaps[int(0.9 * len(gaps))]:.1f} ms", flush=True)
                print(f"  rounds {json.dumps(rounds)}; rounds filled {filled:.2f} s of the wall time")
                used = sorted(((cpu1[p].seconds - (cpu0[p].seconds if p in cpu0 else 0.0), cpu1[p].name[:80])
                               for p in cpu1), reverse=True)
                total = sum(s for s, _ in used)
                print(f"  CPU seconds: {total:.2f} of the machine's {os.cpu_count() * wall:.2f}")
                for seconds, name in used[:10]:
                    print(f"    {seconds:6.2f}  {name}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
