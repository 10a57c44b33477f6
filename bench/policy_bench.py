"""Speculation policies against each other over HTTP, paired: fixed K, adaptive K, overlapped drafting, plain.

This machine's speed drifts by tens of percent between minutes, so policies are compared inside one server and
interleaved, not across separate runs. Each mode is a per-request option of the same server
(`"speculative": {...}` in the body):

    plain           {"enabled": false}
    fixed           {"k": K, "adaptive": false, "overlap": false}   K drafts every round, no matter what
    adaptive        {"overlap": false}                              the server's K plan (engine/spec/plan.py)
    fixed+overlap   {"k": K, "adaptive": false}                     on a server with speculation.overlap: true
    adaptive+overlap {}                                             idem

Server 1 is serve_config.yaml as it is (adaptive, no overlap); server 2 the same with `speculation.overlap: true`
(its workers then get half the cores each, because draft and target compute at the same time). Each is started
the way the README does (a local Ray head, then `serve run`).
- Concurrency 1: every prompt runs once in every mode, back to back, the order rotating from prompt to prompt;
  tokens/s of a mode = its output tokens / the sum of its requests' durations.
- Concurrency 16 (server 1): each mode runs 2 x 16 requests with 16 clients, modes alternating (the mode that
  goes first rotating from cycle to cycle), `--cycles` times over (default 2).

    python -m bench.policy_bench                  # both servers
    python -m bench.policy_bench --servers default --prompts-limit 4

Ratios (issue targets in brackets): fixed+overlap / fixed at concurrency 1 [>= 1.2]; adaptive / plain at
concurrency 16 [>= 1.0]; adaptive's speedup over plain / fixed K's at concurrency 1 [>= 0.9]. Greedy, 64 tokens
(EOS ignored), streaming chat requests from bench/prompts.jsonl. Writes JSON and a PNG chart next to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.load_bench import load_prompts, one_request, run_concurrency, summarize
from tests.deployments.serve_cluster import BASE, ROOT, config_variant, serve_app

K = 3


def modes_for(server: str) -> dict[str, dict]:
    fixed = {"k": K, "adaptive": False, "overlap": False}
    if server == "default":
        return {"plain": {"enabled": False}, "fixed": fixed, "adaptive": {"overlap": False}}
    return {"plain": {"enabled": False}, "fixed": fixed, "fixed+overlap": {"k": K, "adaptive": False},
            "adaptive+overlap": {}}


SERVERS = {"default": {}, "overlap": {"overlap": True}}


def tokens_per_s(results) -> float:
    ok = [r for r in results if r.ok]
    return sum(r.output_tokens for r in ok) / max(1e-9, sum(r.e2e for r in ok))


async def paired_c1(client, args, prompts, modes: dict[str, dict]) -> dict:
    by_mode: dict[str, list] = {m: [] for m in modes}
    names = list(modes)
    with tqdm(total=len(prompts) * len(names), desc="c=1 paired", leave=False) as bar:
        for i, messages in enumerate(prompts):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]  # rotate which mode goes first
                by_mode[name].append(await one_request(client, args.model, messages, args.max_tokens, 0.0,
                                                       modes[name], True))
                bar.update(1)
    return {name: {"tokens_per_s": tokens_per_s(res), "requests": len(res),
                   "errors": sum(1 for r in res if not r.ok),
                   "ttft_p50_ms": 1000 * sorted(r.ttft for r in res if r.ttft is not None)[len(res) // 2],
                   "drafted": sum(r.drafted for r in res), "accepted": sum(r.accepted for r in res)}
            for name, res in by_mode.items()}


async def alternating_c16(client, args, prompts, modes: dict[str, dict], clients: int) -> dict:
    runs: dict[str, list] = {m: [] for m in modes}
    total = 2 * clients
    names = list(modes)
    for cycle in range(args.cycles):
        for name in names[cycle % len(names):] + names[: cycle % len(names)]:  # the first mode rotates
            options = modes[name]
            with tqdm(total=total, desc=f"c={clients} {name} ({cycle + 1}/{args.cycles})", leave=False) as bar:
                results, duration = await run_concurrency(client, args.model, prompts, clients, total,
                                                          args.max_tokens, 0.0, options, bar, True)
            runs[name].append(summarize(name, "concurrency", clients, results, duration))
    return {name: {"tokens_per_s": sum(r.output_tokens_per_s for r in rs) / len(rs),
                   "runs": [asdict(r) for r in rs]} for name, rs in runs.items()}


async def measure_server(args, prompts, server: str) -> dict:
    modes = modes_for(server)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=BASE, timeout=600, limits=limits) as client:
        for options in modes.values():  # warm-up, not measured (first requests wait for replicas' start)
            await one_request(client, args.model, prompts[0], 8, 0.0, options, True)
        out = {"c1": await paired_c1(client, args, prompts, modes)} if args.c1 else {}
        if server == "default" and args.clients:
            high = {m: o for m, o in modes.items() if m in args.high_modes} if args.high_modes else modes
            out[f"c{args.clients}"] = await alternating_c16(client, args, prompts, high, args.clients)
        out["router_stats"] = (await client.get("/stats")).json()
    return out


def ratios(results: dict, clients: int) -> dict:
    out = {}
    d, o = results.get("default", {}).get("c1"), results.get("overlap", {}).get("c1")
    if d:
        out["default_c1_fixed_vs_plain"] = d["fixed"]["tokens_per_s"] / d["plain"]["tokens_per_s"]
        out["default_c1_adaptive_vs_plain"] = d["adaptive"]["tokens_per_s"] / d["plain"]["tokens_per_s"]
        out["default_c1_adaptive_speedup_over_fixed_speedup"] = d["adaptive"]["tokens_per_s"] / d["fixed"][
            "tokens_per_s"]
    high = results.get("default", {}).get(f"c{clients}")
    for mode in ("adaptive", "fixed"):
        if high and mode in high and "plain" in high:
            out[f"default_c{clients}_{mode}_vs_plain"] = high[mode]["tokens_per_s"] / high["plain"]["tokens_per_s"]
            cycles = [a["output_tokens_per_s"] / p["output_tokens_per_s"]
                      for a, p in zip(high[mode]["runs"], high["plain"]["runs"])]
            if len(cycles) > 1:  # each cycle runs the modes back to back: its ratio is one paired observation
                mean, sem = statistics.fmean(cycles), statistics.stdev(cycles) / len(cycles) ** 0.5
                out[f"default_c{clients}_{mode}_vs_plain_per_cycle_mean"] = mean
                out[f"default_c{clients}_{mode}_vs_plain_per_cycle_95ci_low"] = mean - 1.96 * sem
                out[f"default_c{clients}_{mode}_vs_plain_per_cycle_95ci_high"] = mean + 1.96 * sem
    if o:
        out["overlap_c1_fixed+overlap_vs_fixed"] = o["fixed+overlap"]["tokens_per_s"] / o["fixed"]["tokens_per_s"]
        out["overlap_c1_fixed+overlap_vs_plain"] = o["fixed+overlap"]["tokens_per_s"] / o["plain"]["tokens_per_s"]
        out["overlap_c1_adaptive+overlap_vs_plain"] = o["adaptive+overlap"]["tokens_per_s"] / o["plain"][
            "tokens_per_s"]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(server, load) for server, res in results.items() for load in res if load.startswith("c")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (server, load) in zip(axes[0], panels):
        modes = results[server][load]
        ax.bar(range(len(modes)), [m["tokens_per_s"] for m in modes.values()])
        ax.set_xticks(range(len(modes)), list(modes), rotation=20)
        ax.set_title(f"{server} server, concurrency {load[1:]}")
        ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve_config.yaml", help="the config both servers start from")
    ap.add_argument("--servers", nargs="*", default=list(SERVERS), choices=list(SERVERS))
    ap.add_argument("--clients", type=int, default=16, help="the high-concurrency point (default server); 0: none")
    ap.add_argument("--prompts-limit", type=int, default=8, help="prompts for the paired concurrency-1 runs")
    ap.add_argument("--no-c1", dest="c1", action="store_false", help="skip the paired concurrency-1 runs")
    ap.add_argument("--cycles", type=int, default=2, help="alternating cycles of the modes at high concurrency")
    ap.add_argument("--high-modes", nargs="*", default=None,
                    help="modes at high concurrency (default: all of the default server's)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--out", default="bench/results/policy_bench", help="prefix of the .json and .png outputs")
    args = ap.parse_args(argv)

    prompts = load_prompts(args.prompts)[: args.prompts_limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        for server in args.servers:
            config = config_variant(ROOT / args.config, {"speculation": SERVERS[server]}, Path(tmp) / f"{server}.yaml")
            with serve_app(Path(tmp), config=str(config)):
                results[server] = asyncio.run(measure_server(args, prompts, server))
            for load, modes in results[server].items():
                if load.startswith("c"):
                    for name, m in modes.items():
                        print(f"{server:8s} {load:4s} {name:17s} {m['tokens_per_s']:7.2f} tok/s")
    summary = ratios(results, args.clients)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "started": started, "servers": results,
                                                    "ratios": summary}, indent=2))
    plot(results, out.with_suffix(".png"))
    print("\n".join(f"{k:50s} {v:.3f}" for k, v in summary.items()))
    print(f"wrote {out.with_suffix('.json')} {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
