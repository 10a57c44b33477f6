"""Speculation policies against each other over HTTP: fixed K, overlapped drafting, adaptive K, both.

For each variant the benchmark writes serve_config.yaml with that variant's `speculation` settings, starts it
the way the README does (a local Ray head, then `serve run`), and runs the load benchmark's fixed-concurrency
clients (bench/load_bench.py: streaming chat requests from bench/prompts.jsonl) at each concurrency, speculative
(the server's policy) and plain (the same requests with `"speculative": {"enabled": false}`, same server). Then
it reads the router's /stats (rounds, ahead drafts used, K) and stops the server. One speculative and one plain
request warm the server up first (not measured).

    python -m bench.policy_bench                       # all variants, concurrency 1 and 16
    python -m bench.policy_bench --variants fixed fixed+overlap --concurrency 1

Reported ratios (issue targets in brackets):
- overlap at batch 1: tokens/s of `X+overlap` / `X` at concurrency 1 [>= 1.2];
- speculative / plain at the highest concurrency, per variant [>= 1.0 for the default];
- adaptive's speedup over plain at concurrency 1 / fixed K's speedup over plain [>= 0.9].
Writes JSON and a PNG chart next to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import yaml
from tqdm import tqdm

from bench.load_bench import load_prompts, run_concurrency, summarize
from tests.deployments.serve_cluster import BASE, ROOT, serve_app

VARIANTS = {
    "fixed": {"adaptive": False},
    "fixed+overlap": {"adaptive": False, "overlap": True},
    "adaptive": {"adaptive": True},
    "adaptive+overlap": {"adaptive": True, "overlap": True},
}


def variant_config(base: Path, speculation: dict, out: Path) -> Path:
    doc = yaml.safe_load(base.read_text())
    app = doc["applications"][0]
    app["args"]["speculation"] = {**app["args"].get("speculation", {}), **speculation}
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


async def measure(args, prompts) -> tuple[list, dict]:
    runs = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=BASE, timeout=600, limits=limits) as client:
        # warm-up, not measured: the first requests wait for the replicas' start (model load, cost measurement)
        with tqdm(total=2, desc="warm-up", leave=False) as bar:
            await run_concurrency(client, args.model, prompts, 1, 1, 8, 0.0, True, bar, True)
            await run_concurrency(client, args.model, prompts, 1, 1, 8, 0.0, False, bar, True)
        for clients in args.concurrency:
            total = max(args.min_requests, 2 * clients)
            for speculative in (True, False):
                mode = "speculative" if speculative else "plain"
                with tqdm(total=total, desc=f"c={clients} {mode}", leave=False) as bar:
                    results, duration = await run_concurrency(client, args.model, prompts, clients, total,
                                                              args.max_tokens, 0.0, speculative, bar, True)
                runs.append(summarize(mode, "concurrency", clients, results, duration))
        stats = (await client.get("/stats")).json()
    return runs, stats


def tok_s(result: dict, variant: str, mode: str, clients: int) -> float | None:
    for run in result.get(variant, {}).get("runs", []):
        if run["mode"] == mode and run["level"] == clients:
            return run["output_tokens_per_s"]
    return None


def ratios(results: dict, concurrency: list[int]) -> dict:
    low, high = min(concurrency), max(concurrency)
    out: dict[str, float] = {}
    for base in ("fixed", "adaptive"):
        with_overlap, without = tok_s(results, f"{base}+overlap", "speculative", low), tok_s(results, base,
                                                                                               "speculative", low)
        if with_overlap and without:
            out[f"overlap_vs_{base}_c{low}"] = with_overlap / without
    for variant in results:
        for clients in concurrency:
            spec, plain = (tok_s(results, variant, m, clients) for m in ("speculative", "plain"))
            if spec and plain:
                out[f"{variant}_spec_vs_plain_c{clients}"] = spec / plain
    for variant in ("adaptive", "adaptive+overlap"):
        adaptive, fixed = out.get(f"{variant}_spec_vs_plain_c{low}"), out.get(f"fixed_spec_vs_plain_c{low}")
        if adaptive and fixed:
            out[f"{variant}_keeps_of_fixed_speedup_c{low}"] = adaptive / fixed
    plains = [tok_s(results, v, "plain", high) for v in results]
    plains = [p for p in plains if p]
    if plains:
        for variant in results:
            spec = tok_s(results, variant, "speculative", high)
            if spec:
                out[f"{variant}_spec_vs_best_plain_c{high}"] = spec / max(plains)
    return out


def plot(results: dict, concurrency: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(concurrency), figsize=(5 * len(concurrency), 4), squeeze=False)
    for ax, clients in zip(axes[0], concurrency):
        names = list(results)
        spec = [tok_s(results, v, "speculative", clients) or 0 for v in names]
        plain = [tok_s(results, v, "plain", clients) or 0 for v in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], spec, 0.4, label="speculative")
        ax.bar([x + 0.2 for x in xs], plain, 0.4, label="plain (same server)")
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_title(f"concurrency {clients}")
        ax.set_ylabel("output tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="serve_config.yaml", help="the config every variant starts from")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--min-requests", type=int, default=8, help="requests per load point: max(this, 2 x clients)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--out", default="bench/results/policy_bench", help="prefix of the .json and .png outputs")
    args = ap.parse_args(argv)

    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            config = variant_config(ROOT / args.config, VARIANTS[name], Path(tmp) / f"{name}.yaml")
            started = time.perf_counter()
            with serve_app(Path(tmp), config=str(config)):
                up_s = time.perf_counter() - started
                runs, stats = asyncio.run(measure(args, prompts))
            results[name] = {"speculation": VARIANTS[name], "start_s": up_s, "runs": [asdict(r) for r in runs],
                             "router_stats": stats}
            for r in runs:
                print(f"{name:18s} c={int(r.level):<3d} {r.mode:12s} {r.output_tokens_per_s:7.2f} tok/s  "
                      f"ttft p50 {1000 * r.ttft_s.get('p50', 0):7.0f} ms  errors {r.errors or 0}")
            print(f"{name:18s} ahead drafts {stats.get('ahead')}, mean K now {stats.get('current_k')}")
    summary = ratios(results, args.concurrency)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "variants": results, "ratios": summary},
                                                   indent=2))
    plot(results, args.concurrency, out.with_suffix(".png"))
    print("\n".join(f"{k:45s} {v:.3f}" for k, v in summary.items()))
    print(f"wrote {out.with_suffix('.json')} {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
