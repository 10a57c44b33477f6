"""Served speed of a synthetic model pair on one GPU, against the memory roofline (issue 34, item 6).

    python -m bench.gpu_serve --shape 8b --noise 0 --out bench/results/gpu_serve_8b.json
    python -m bench.gpu_serve --shape tiny --device cpu --concurrency 1 2 --max-tokens 8   # the plumbing, on a CPU

One command for a GPU machine, within --budget-s (default 8 minutes) of wall time:
1. writes the synthetic pair of --shape (bench/synthetic_pair.py: a random-weight Llama target whose later layers
   pass the residual through, and a draft that is its first layers, so drafts are accepted; --noise lowers the
   acceptance) under --pair-root, once per shape, noise and seed;
2. measures the device's memory bandwidth (bench/gpu_runner_bench.measured_bandwidth: a large copy), so the
   roofline, a step that reads every weight once (weight bytes / bandwidth; KV-cache reads and compute ignored),
   comes from the same run;
3. serves each of --variants (default `plain`, model.draft: none, then `speculative`, the synthetic draft; also
   `self`, the target's first layers drafting inside it, and `medusa` / `eagle3`, random heads written beside the
   pair, see VARIANTS), each by `serve run` of a
   config derived from serve_config.yaml (validated by deployments.config.SpecServeConfig; one router replica, so
   its /stats sees every round), with Ray Serve's settings of `make run` (deployments/ray_env.py) unless
   --ray-serve-proxy; start-up is launch to /health 200 (and to the first completion);
4. per concurrency C: one warm-up wave of C requests, then C streams of greedy requests (random token prompts of
   --prompt-tokens, --max-tokens each, ignore_eos), each stream sending its next request as its last one ends,
   as vLLM's benchmark client keeps --max-concurrency requests in flight, until --requests-per-stream x C are sent
   or the level's share of the budget is spent (each stream sends at least one).

Reported per variant and C: tok/s (all streams' tokens over the level's wall time), TTFT p50, TPOT p50, mean
accepted length (vLLM's: 1 + accepted / drafting rounds, from the router's /stats) and acceptance rate, host ms
per round (the router's orchestration: round wall time less the workers' compute) against the workers' compute ms
per round (draft + verify: device time plus the workers' own host work) and drafting's share of it (a Draft
worker's compute, or a drafter's inside the target's call), and each figure's ratio to its roofline
(a fraction: roofline time / measured time, measured tok/s / roofline tok/s; speculative decoding may exceed 1
against the plain roofline; the JSON also has its own: rounds at their roofline, each emitting the mean accepted
length). Also the speculative / plain speed-up and whether plain and speculative greedy texts are equal for the
same prompts. Prints a markdown table; writes JSON (--out), and the configs and logs in `<out stem>_runs/`.

The machine's Python may have no console scripts: `serve run` is then started as `python -c` of Ray's CLI
(--serve-cli python; `auto` picks it when the `serve` script is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import yaml

from bench.gpu_runner_bench import measured_bandwidth
from bench.gpu_serve_report import Record, compare_with_plain, level_summary, roofline, roofline_ratios, table
from bench.peer_servers import (ROOT, ManagedServer, derive_ours_config, machine_params, parse_overrides, port_free,
                                serve_run_argv)
from bench.prefill_stall import stream
from bench.synthetic_pair import SHAPES, Shape, default_root, param_counts, write_heads, write_pair

COMPILE = "auto"  # runner.compile: CUDA graphs on CUDA, eager on CPU (deployments/config.py)
# speculative_overlap: the draft drafts round r+1 during round r's verify (speculation.overlap), the disaggregated
# design's reason to exist where the draft has a device of its own (--draft-gpu own)
# self: the target's first draft_layers layers draft inside it (engine/proposers/early_exit.py), the draft model's
# layers by construction, so its acceptance is the draft model's; medusa, eagle3: random heads of the target's shape
# (bench/synthetic_pair.write_heads), whose drafts are random: their cost, and the plan keeping them off
VARIANTS = ("plain", "speculative", "speculative_overlap", "self", "medusa", "eagle3")
HEAD_VARIANTS = ("medusa", "eagle3")
DEFAULT_VARIANTS = ("plain", "speculative")
WARMUP_BASE = 1_000_000  # warm-up prompts' indices: never a measured prompt
LEVEL_PROMPTS = 1000  # level C's prompts are C x LEVEL_PROMPTS onwards
FIRST_PROMPT_ID = 100  # random prompt tokens from here on: above the tokenizer's special tokens
STOP_ESTIMATE_S = 20.0


# ---- pure parts (tests/bench/test_gpu_serve.py) ---------------------------------------------------------------

def draft_of(variant: str, target: Path, draft: Path, shape: Shape) -> str:
    """The variant's `model.draft`."""
    if variant.startswith("speculative"):
        return str(draft)
    if variant == "self":
        return f"self:{shape.draft_layers}"
    if variant in HEAD_VARIANTS:
        return f"{variant}:{target.parent / variant}"  # bench/synthetic_pair.write_heads
    return "none"


def variant_overrides(variant: str, target: Path, draft: Path, shape: Shape, args) -> dict:
    """The dotted overrides (relative to the application's args) of one variant's serve config."""
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    max_len = -(-(args.prompt_tokens + args.max_tokens + 64) // 256) * 256
    drafting = variant != "plain"
    out = {"model.target": str(target), "model.draft": draft_of(variant, target, draft, shape),
           "model.target_dtype": dtype, "model.draft_dtype": dtype, "model.device": args.device,
           "model.served_model_name": f"synthetic-{shape.name}", "model.max_model_len": max_len,
           "limits.max_prompt_tokens": max_len - args.max_tokens, "limits.max_tokens": args.max_tokens,
           "speculation.cost_cache": None, "runner.compile": COMPILE,
           "runner.max_num_seqs": max(args.concurrency),
           "router.min_replicas": 1, "router.max_replicas": 1}  # one router: its /stats sees every round
    for role in ("target", "draft"):
        # draft and target share one GPU, or (--draft-gpu own: two GPUs) each has its own
        out[f"{role}.num_gpus"] = (1.0 if args.draft_gpu == "own" else 0.5) if cuda else 0.0
        out[f"{role}.max_ongoing_requests"] = max(64, 2 * max(args.concurrency))
    if drafting:
        out["speculation.overlap"] = variant == "speculative_overlap"
    if args.k is not None:
        out["speculation.num_speculative_tokens"] = args.k
    if args.fixed_k:
        out["speculation.adaptive"] = False
    if args.kv_cache_gib is not None:
        out["runner.kv_cache_gib"] = args.kv_cache_gib
    return {**out, **parse_overrides(args.set)}


def serve_config(base: dict, overrides: dict, port: int) -> dict:
    """A `serve run` config from serve_config.yaml's, validated here so a typo fails before Ray starts."""
    from deployments.config import SpecServeConfig

    cfg = derive_ours_config(base, overrides, port)
    cfg["http_options"]["host"] = "127.0.0.1"
    SpecServeConfig.model_validate(cfg["applications"][0]["args"])
    return cfg


def prompt_ids(index: int, n_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    """Prompt `index`: random token ids, the same in every run and variant."""
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(n_tokens)]


def level_allowance(time_left_s: float, levels_left: int, later_levels: int, later_startups: int,
                    startup_s: float) -> float:
    """Seconds one level may take: what is left after the later variants' start-ups, shared by every level
    still to run."""
    spare = time_left_s - later_startups * (startup_s + STOP_ESTIMATE_S)
    return max(0.0, spare / max(1, levels_left + later_levels))


# ---- the run ---------------------------------------------------------------------------------------------------

async def one_stream(client: httpx.AsyncClient, model: str, index: int, prompt: list[int],
                     max_tokens: int) -> Record:
    arrivals: list[float] = []
    chunks: list[dict] = []
    sent = time.perf_counter()
    await stream(client, model, prompt, max_tokens, arrivals, {"stream_options": {"include_usage": True}}, chunks)
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return Record(index, sent, arrivals, text, usage["completion_tokens"] if usage else len(arrivals))


async def streams(client: httpx.AsyncClient, model: str, c: int, indices: range, args, vocab: int,
                  allowance_s: float) -> tuple[list[Record], float]:
    """`c` streams, each sending its next request as its last one ends (vLLM's benchmark client with
    --max-concurrency keeps c requests in flight alike), over the indexed prompts in order; once `allowance_s` is
    spent a stream takes no new prompt (each sends at least one). The records and the wall time from the first send
    to the last answer. Waves of c requests that all start together and wait for the slowest would measure fewer
    than c streams wherever requests' lengths in rounds differ, as speculative ones do (a row's accepted lengths),
    and plain ones do not."""
    prompts = iter(indices)
    records: list[Record] = []
    start = time.perf_counter()

    async def one_client() -> None:
        sent = 0
        for i in prompts:  # one iterator shared by the c streams: each prompt is sent once
            if sent and time.perf_counter() - start > allowance_s:
                break
            records.append(await one_stream(client, model, i, prompt_ids(i, args.prompt_tokens, vocab, args.seed),
                                            args.max_tokens))
            sent += 1

    await asyncio.gather(*(one_client() for _ in range(c)))
    return records, time.perf_counter() - start


async def measure_level(base_url: str, model: str, c: int, args, vocab: int, allowance_s: float
                        ) -> tuple[dict, dict[int, str]]:
    """A warm-up of c requests at once, then c streams over up to --requests-per-stream x c prompts (at least
    --min-requests) while the allowance lasts; (summary, texts by prompt)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout) as client:
        await streams(client, model, c, range(WARMUP_BASE, WARMUP_BASE + c), args, vocab, 0.0)  # one request each
        before = (await client.get("/stats")).json()
        first = LEVEL_PROMPTS * c  # each level its own prompts: none is a prefix-cache hit from an earlier level
        count = max(args.requests_per_stream * c, args.min_requests)
        records, wall = await streams(client, model, c, range(first, first + count), args, vocab, allowance_s)
        after = (await client.get("/stats")).json()
    return level_summary(records, wall, before, after), {r.prompt_index: r.text for r in records}


def run_variant(name: str, cfg_path: Path, args, vocab: int, deadline: float, later: int, runs_dir: Path,
                roof: dict) -> tuple[dict, dict]:
    """Start, ready, measure every level and stop one variant's server; (its report, texts by level)."""
    from deployments.ray_env import SERVE_ENV, reap_orphaned_haproxy

    model = yaml.safe_load(cfg_path.read_text())["applications"][0]["args"]["model"]["served_model_name"]
    env = {**os.environ, **({} if args.ray_serve_proxy else SERVE_ENV),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    argv = serve_run_argv(cfg_path, {"auto": None, "script": False, "python": True}[args.serve_cli])
    server = ManagedServer(name, argv, f"http://127.0.0.1:{args.port}", model, runs_dir / f"{name}.log", env=env)
    info: dict = {"command": argv, "config": str(cfg_path), "levels": {}}
    texts: dict = {}
    if not port_free(args.port):
        info["error"] = f"port {args.port} is busy before start"
        return info, texts
    print(f"== {name}: starting, log {server.log_path}", flush=True)
    server.start()
    try:
        server.wait_ready(args.startup_timeout)
        startup = server.timings.get("ready_s", 0.0)
        print(f"== {name}: /health after {server.timings.get('health_s')} s, ready after {startup} s", flush=True)
        for j, c in enumerate(args.concurrency):
            allowance = level_allowance(deadline - time.perf_counter(), len(args.concurrency) - j,
                                        later * len(args.concurrency), later, startup)
            level, texts[c] = asyncio.run(measure_level(server.base_url, model, c, args, vocab, allowance))
            level.update(roofline_ratios(level, c, roof))
            info["levels"][c] = level
            print(f"   {name} @{c}: {level['requests']} requests, {level['tok_s']:.1f} tok/s", flush=True)
    except Exception as exc:  # the other variant's figures still count
        info["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        print(f"!! {name}: {info['error'].splitlines()[0][:300]} (log: {server.log_path})", flush=True)
    finally:
        info["leftover_processes"] = server.stop() + [f"{pid} orphaned haproxy" for pid in reap_orphaned_haproxy()]
        info["startup"] = dict(server.timings)
    return info, texts


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return machine_params().get("machine") or "CPU"


def prepare(args) -> tuple[Shape, Path, Path, dict, dict]:
    """The pair written (or found), the bandwidth measured; (shape, target, draft, roofline, pair report)."""
    import torch

    shape = SHAPES[args.shape]
    start = time.perf_counter()
    target, draft = write_pair(shape, Path(args.pair_root) if args.pair_root else default_root(), args.noise,
                               args.seed, args.device)
    pair = {"shape": shape.name, "noise": args.noise, "seed": args.seed, "vocab": shape.vocab,
            "params": param_counts(shape), "target": str(target), "draft": str(draft),
            "write_s": round(time.perf_counter() - start, 1)}
    if set(args.variants) & set(HEAD_VARIANTS):
        pair["heads"] = {k: str(v) for k, v in write_heads(shape, target, args.seed).items()}
        pair["write_s"] = round(time.perf_counter() - start, 1)
    print(f"== pair ready in {pair['write_s']} s: {target.parent}", flush=True)
    roof = roofline(shape, measured_bandwidth(torch.device(args.device),
                                              args.bandwidth_gib or (4.0 if args.device == "cuda" else 0.5)))
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the servers' workers need the memory this process drew the weights in
    return shape, target, draft, roof, pair


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--noise", type=float, default=0.0, help="noise in the target's pass-through layers "
                    "(x their init std; 0: every greedy draft is accepted)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-stream", type=int, default=3, help="measured requests per level at most, in "
                    "units of its streams (each stream sends its next request as its last ends; see --min-requests)")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="a level may run up to this many requests even past --requests-per-stream (one request is "
                         "one TTFT sample)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall time for the whole run; trims the levels' "
                    "requests")
    ap.add_argument("--k", type=int, default=None, help="speculation.num_speculative_tokens (default: the config's)")
    ap.add_argument("--fixed-k", action="store_true", help="speculation.adaptive: false (draft K every round)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="runner.kv_cache_gib (default: the fraction)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more overrides of the application's args, e.g. speculation.overlap=true")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    ap.add_argument("--draft-gpu", choices=("shared", "own"), default="shared",
                    help="the draft on the target's GPU (0.5 each) or on a GPU of its own (needs two)")
    ap.add_argument("--config", default="serve_config.yaml", help="the serve config the variants derive from")
    ap.add_argument("--serve-cli", choices=("auto", "script", "python"), default="auto",
                    help="how to start `serve run`: its console script, `python -c` of Ray's CLI, or auto")
    ap.add_argument("--ray-serve-proxy", action="store_true", help="Serve's Python proxy, not make run's HAProxy")
    ap.add_argument("--pair-root", default=None, help="where pairs are written (default: $SPECSERVE_CACHE/synthetic)")
    ap.add_argument("--bandwidth-gib", type=float, default=None, help="copy size (default: 4 on CUDA, 0.5 on CPU)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/gpu_serve.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    shape, target, draft, roof, pair = prepare(args)
    out = Path(args.out)
    runs_dir = out.with_name(out.stem + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load((ROOT / args.config if not Path(args.config).is_file() else Path(args.config)).read_text())
    report = {"machine": machine_params(), "device_name": device_name(args.device), "args": vars(args),
              "pair": pair, "roofline": roof, "variants": {}, "greedy_equal": {}, "speedup": {}}
    texts = {}
    for i, name in enumerate(args.variants):
        cfg = serve_config(base, variant_overrides(name, target, draft, shape, args), args.port)
        cfg_path = runs_dir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        report["variants"][name], texts[name] = run_variant(name, cfg_path, args, shape.vocab, deadline,
                                                            len(args.variants) - 1 - i, runs_dir, roof)
    report["greedy_equal"], report["speedup"] = compare_with_plain(report["variants"], texts, args.concurrency)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(report, indent=1))
    print()
    print(table(report))
    print(f"\ntotal {report['total_s']} s (budget {args.budget_s:g}); wrote {out}", flush=True)
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
