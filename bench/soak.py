"""Soak benchmark: steady mixed load for a fixed time; lost requests, errors, memory growth and p99 stability.

Start the server on this machine (`make run`), then:

    python -m bench.soak --minutes 10 --rate 0.3

Poisson arrivals at `--rate` requests/s, half streaming and half not, prompts cycled from bench/prompts.jsonl.
Every request is awaited with a timeout, so a request is either answered (200 or an error status) or counted as
hung; "lost" = sent - answered - hung. Resident memory (VmRSS from /proc, so the server must run on this machine)
of every Serve replica and model worker is sampled each window; growth is measured from the end of the warm-up
window to the end. Prints a per-window table and writes JSON (bench/results/soak.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import numpy as np

from bench.load_bench import load_prompts, one_request

PROCESS_MARKERS = ("ray::ServeReplica:", "ray::DraftWorkerCore", "ray::TargetWorkerCore", "ray::ProxyActor")


def replica_rss_mb() -> dict[str, float]:
    """Resident memory of each Serve replica, proxy and model worker process on this machine, by pid."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not any(m in cmd for m in PROCESS_MARKERS):
                continue
            rss_kb = next(int(line.split()[1]) for line in (proc / "status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        name = cmd.split()[0].split(".")[0]  # Ray appends the running method to the process title
        out[f"{name}[{proc.name}]"] = rss_kb / 1024
    return out


async def non_streaming(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    try:
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                            "max_tokens": max_tokens, "temperature": 0})
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__, "e2e": time.perf_counter() - start}
    ok = r.status_code == 200
    return {"ok": ok, "error": None if ok else f"http_{r.status_code}", "e2e": time.perf_counter() - start}


async def soak(args) -> dict:
    prompts = load_prompts(args.prompts)
    rng = random.Random(args.seed)
    windows: list[dict] = []
    results: list[tuple[float, dict]] = []  # (finish time, result)
    sent = hung = 0
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=args.base, timeout=args.timeout, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal hung
            messages = prompts[i % len(prompts)]
            try:
                if i % 2 == 0:
                    r = await asyncio.wait_for(one_request(client, args.model, messages, args.max_tokens, 0.0, True),
                                               args.timeout)
                    res = {"ok": r.ok, "error": r.error, "e2e": r.e2e}
                else:
                    res = await asyncio.wait_for(non_streaming(client, args.model, messages, args.max_tokens),
                                                 args.timeout)
            except asyncio.TimeoutError:
                hung += 1
                return
            results.append((time.perf_counter(), res))

        start = time.perf_counter()
        end = start + 60 * args.minutes
        tasks = []
        next_window = start + args.window_s
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(one(sent)))
            sent += 1
            await asyncio.sleep(rng.expovariate(args.rate))
            while time.perf_counter() >= next_window:
                windows.append({"t_s": round(next_window - start), "rss_mb": replica_rss_mb()})
                next_window += args.window_s
        await asyncio.gather(*tasks)
        windows.append({"t_s": round(time.perf_counter() - start), "rss_mb": replica_rss_mb()})

    # per-window latency and errors (by finish time)
    bounds = [start + w["t_s"] for w in windows]
    lo = start
    for w, hi in zip(windows, bounds):
        in_window = [res for t, res in results if lo <= t < hi] if w is not windows[-1] else [
            res for t, res in results if t >= lo]
        lat = [res["e2e"] for res in in_window if res["ok"]]
        w.update(answered=len(in_window), errors=sum(not r["ok"] for r in in_window),
                 p99_s=float(np.percentile(lat, 99)) if lat else None)
        lo = hi
    warm = windows[0]["rss_mb"] if len(windows) > 1 else {}
    last = windows[-1]["rss_mb"]
    growth = {name: (last[name] - mb) / mb for name, mb in warm.items() if name in last and mb > 0}
    steady = [w for w in windows[1:] if w["p99_s"] is not None]
    p99s = [w["p99_s"] for w in steady]
    errors_by_type: dict[str, int] = {}
    for _, res in results:
        if not res["ok"]:
            errors_by_type[res["error"]] = errors_by_type.get(res["error"], 0) + 1
    return {
        "args": vars(args), "sent": sent, "answered": len(results), "hung": hung,
        "lost": sent - len(results) - hung, "errors": errors_by_type,
        "steady_state_errors": sum(w["errors"] for w in windows[1:]),
        "max_rss_growth_after_warmup": max(growth.values()) if growth else None, "rss_growth": growth,
        "p99_s_min_max": [min(p99s), max(p99s)] if p99s else None, "windows": windows,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=0.3, help="requests/s (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--window-s", type=float, default=60.0, help="reporting window; the first is the warm-up")
    ap.add_argument("--timeout", type=float, default=180.0, help="a request unanswered after this is 'hung'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args(argv)
    report = asyncio.run(soak(args))
    print(f"{'t (s)':>6s} {'answered':>8s} {'errors':>6s} {'p99 s':>7s} {'RSS MB (sum)':>13s}")
    for w in report["windows"]:
        p99 = "-" if w["p99_s"] is None else f"{w['p99_s']:.2f}"
        print(f"{w['t_s']:6d} {w['answered']:8d} {w['errors']:6d} {p99:>7s} {sum(w['rss_mb'].values()):13.0f}")
    growth = report["max_rss_growth_after_warmup"]
    print(f"\nsent {report['sent']}, answered {report['answered']}, hung {report['hung']}, lost {report['lost']}, "
          f"errors {report['errors'] or 0} (after warm-up: {report['steady_state_errors']})")
    print(f"largest per-process RSS growth after warm-up: {'-' if growth is None else f'{100 * growth:.1f}%'}; "
          f"p99 per window min/max: {report['p99_s_min_max']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
