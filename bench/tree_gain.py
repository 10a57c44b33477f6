"""Token trees against chains, in process, one stream: mean accepted length per round and tokens/s of a draft source
with `speculation.tree` off (chains) and on (trees of --nodes nodes), alternating prompt by prompt so load from other
users of the machine falls on both alike. Greedy; the outputs of the two are compared (they must be equal).

    python -m bench.tree_gain --draft eagle3:DIR --prompts bench/prompts_fresh.jsonl [--limit 24] [--nodes 8]
    python -m bench.tree_gain --draft ngram --prompts bench/prompts_fresh.jsonl

`--compare staged` instead compares a draft model's rounds with and without staged speculative decoding's second
stage (`speculation.staged`: n-gram lookup guesses the draft's own steps), chains both; it reports the draft passes.

The embedded target (SmolLM2-135M-Instruct) at --dtype (bf16 by default: this CPU computes it natively), K =
--k drafts per round pinned (the plan cannot switch drafting off: the shapes are compared, not the planner). Each
prompt goes through the chat template. Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.factory import EngineConfig, build_engine
from engine.request.sampling import SamplingParams
from engine.spec.options import SpeculationOptions
from engine.spec.plan import TreeSettings
from engine.spec.stats import SpecStats


def encode(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def run_one(engine, prompt: list[int], params: SamplingParams, k: int) -> tuple[list[int], float, SpecStats]:
    engine.stats = SpecStats()
    rid = f"tree-gain-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params, SpeculationOptions(k=k, adaptive=False))
    tokens: list[int] = []
    start = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens, time.perf_counter() - start, engine.stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="model.draft: ngram, self, medusa:DIR, eagle3:DIR, a model")
    ap.add_argument("--prompts", default="bench/prompts_fresh.jsonl")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compare", choices=("tree", "staged"), default="tree")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    engine = build_engine(EngineConfig(draft=args.draft, target_dtype=args.dtype,
                                       num_speculative_tokens=args.k, max_batch_for_speculation=64))
    lines = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [encode(engine.tokenizer, line["messages"]) for line in lines[: args.limit]]
    params = SamplingParams(max_tokens=args.max_tokens)
    if args.compare == "tree":
        shapes = {"chain": lambda: setattr(engine, "tree", TreeSettings("off")),
                  "tree": lambda: setattr(engine, "tree", TreeSettings("on", args.nodes))}
    else:
        from engine.proposers.ngram import NgramProposer
        lookup = NgramProposer()
        shapes = {"one-stage": lambda: setattr(engine.proposer, "lookup", None),
                  "two-stage": lambda: setattr(engine.proposer, "lookup", lookup)}
    first, second = shapes
    totals = {name: {"tokens": 0, "seconds": 0.0, "rounds": 0, "drafting_rounds": 0, "accepted": 0}
              for name in shapes}
    same = 0
    shapes[first]()
    run_one(engine, prompts[0], params, args.k)  # warm-up
    for i, prompt in enumerate(prompts):
        outputs = {}
        order = list(shapes) if i % 2 == 0 else list(shapes)[::-1]
        for name in order:
            shapes[name]()
            before = list(getattr(engine.proposer, "lookup_steps", (0, 0)))
            tokens, seconds, stats = run_one(engine, prompt, params, args.k)
            after = getattr(engine.proposer, "lookup_steps", (0, 0))
            totals[name]["draft_passes"] = totals[name].get("draft_passes", 0) + after[0] - before[0]
            totals[name]["staged_drafts"] = totals[name].get("staged_drafts", 0) + after[1] - before[1]
            outputs[name] = tokens
            t = totals[name]
            t["tokens"] += len(tokens)
            t["seconds"] += seconds
            t["rounds"] += stats.rounds
            t["drafting_rounds"] += stats.num_drafts
            t["accepted"] += stats.num_accepted_tokens
        same += outputs[first] == outputs[second]
    report = {"compare": args.compare, "draft": args.draft, "k": args.k, "nodes": args.nodes, "dtype": args.dtype,
              "prompts": len(prompts),
              "max_tokens": args.max_tokens, "same_output": f"{same}/{len(prompts)}", "shapes": {}}
    for name, t in totals.items():
        report["shapes"][name] = {
            **t, "tok_per_s": round(t["tokens"] / t["seconds"], 2),
            "mean_accepted_length": round(1 + t["accepted"] / max(1, t["drafting_rounds"]), 3),
            "tokens_per_round": round(t["tokens"] / max(1, t["rounds"]), 3)}
    chain, tree = report["shapes"][first], report["shapes"][second]
    report[f"{second}_over_{first}"] = {"mean_accepted_length": round(tree["mean_accepted_length"]
                                                               / chain["mean_accepted_length"], 3),
                                 "tok_per_s": round(tree["tok_per_s"] / chain["tok_per_s"], 3)}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
