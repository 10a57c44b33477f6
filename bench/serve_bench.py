"""Serving benchmark, first cut: batch-1 and 8-concurrent tokens/s over HTTP vs the in-process engine.

Start the server first (`make run`, or `serve run serve_config.yaml`), then `python -m bench.serve_bench`.
Measures, on the same prompts (bench/prompts.jsonl), greedy, streaming:
- HTTP batch 1: requests one after another, each pinned to the engine's K (`"speculative": {"k": K, "adaptive":
  false}`: the same models and K on both sides); tokens/s = completion tokens / wall time;
- the in-process engine (same target, draft and K as serve_config.yaml) at batch 1, each prompt right after or
  before its HTTP run (paired, so background load on the machine hits both alike);
- HTTP 8 concurrent streams, with the server's own K policy (what clients get): aggregate tokens/s;
- the router's orchestration overhead per round (GET /stats: round wall time minus worker compute).
Prints a table and writes JSON (bench/results/serve_bench.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import yaml

from bench.load_bench import load_prompts


def http_run(base: str, model: str, messages: list[dict], max_tokens: int, speculative: dict | None = None) -> int:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["speculative"] = speculative
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/serve_bench.json")
    args = ap.parse_args()
    app_args = yaml.safe_load(Path(args.config).read_text())["applications"][0]["args"]
    from deployments.config import SpecServeConfig

    cfg = SpecServeConfig.model_validate(app_args)
    model = cfg.model.served_model_name
    prompts = load_prompts(args.prompts)[: args.limit]
    from engine.factory import build_engine
    from engine.request.sampling import SamplingParams

    engine = build_engine(cfg.engine_config())
    same_k = {"k": cfg.speculation.num_speculative_tokens, "adaptive": False}  # the engine's fixed K
    ids = [engine.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
           ["input_ids"] for p in prompts]
    engine.generate([ids[0]], SamplingParams(max_tokens=8))  # warm-up, both sides
    http_run(args.base, model, prompts[0], 8)

    # batch 1, paired: each prompt runs over HTTP and in-process back to back (alternating which goes first), so
    # the machine's background load hits both sides alike
    before = httpx.get(f"{args.base}/stats").json()
    eng_rounds0 = engine.timings.rounds
    eng_draft0, eng_verify0 = engine.timings.draft_seconds, engine.timings.verify_seconds
    b1_tokens = eng_tokens = 0
    b1_s = eng_s = 0.0
    for n, (p, i) in enumerate(zip(prompts, ids)):
        for side in ((0, 1) if n % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            if side == 0:
                b1_tokens += http_run(args.base, model, p, args.max_tokens, same_k)
                b1_s += time.perf_counter() - t
            else:
                eng_tokens += len(engine.generate([i], SamplingParams(max_tokens=args.max_tokens))[0].token_ids)
                eng_s += time.perf_counter() - t
    after = httpx.get(f"{args.base}/stats").json()
    rounds = after["rounds"] - before["rounds"]
    per_round = {key: (after[key] * after["rounds"] - before[key] * before["rounds"]) / max(1, rounds)
                 for key in ("orchestration_ms_per_round", "draft_compute_ms_per_round",
                             "verify_compute_ms_per_round")}
    orch_ms = per_round["orchestration_ms_per_round"]
    eng_rounds = engine.timings.rounds - eng_rounds0
    eng_draft_ms = 1000 * (engine.timings.draft_seconds - eng_draft0) / max(1, eng_rounds)
    eng_verify_ms = 1000 * (engine.timings.verify_seconds - eng_verify0) / max(1, eng_rounds)
    del engine

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        c8_tokens = sum(pool.map(lambda p: http_run(args.base, model, p, args.max_tokens),
                                 [prompts[i % len(prompts)] for i in range(8)]))
    c8_s = time.perf_counter() - t

    result = {
        "http_batch1_tok_s": b1_tokens / b1_s, "http_concurrent8_tok_s": c8_tokens / c8_s,
        "engine_batch1_tok_s": eng_tokens / eng_s, "engine_ms_per_round_batch1": 1000 * eng_s / max(1, eng_rounds),
        "engine_draft_ms_per_round_batch1": eng_draft_ms, "engine_verify_ms_per_round_batch1": eng_verify_ms,
        "orchestration_ms_per_round_batch1": orch_ms,
        "draft_compute_ms_per_round_batch1": per_round["draft_compute_ms_per_round"],
        "verify_compute_ms_per_round_batch1": per_round["verify_compute_ms_per_round"],
        "http_ms_per_round_batch1": 1000 * b1_s / max(1, rounds),
        "rounds_batch1": rounds, "k": cfg.speculation.num_speculative_tokens, "draft": cfg.model.draft,
        "draft_dtype": cfg.model.draft_dtype, "prompts": len(prompts), "max_tokens": args.max_tokens,
    }
    result["http_vs_engine_batch1"] = result["http_batch1_tok_s"] / result["engine_batch1_tok_s"]
    result["concurrent8_vs_batch1"] = result["http_concurrent8_tok_s"] / result["http_batch1_tok_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")


if __name__ == "__main__":
    main()
