"""Acceptance with and without a JSON schema: does constraining the output change what speculation gains?

    python -m bench.structured_bench [--max-tokens 96] [--k 3] [--limit N] [--out bench/plots/structured_bench.json]

Target: SmolLM2-135M-Instruct fp32 (the default model), in-process engine (engine/speculative.py), greedy, batch 1,
K fixed. Drafts: the default int8 draft model (which masks its own drafts with its own matcher,
engine/request/grammar.py) and n-gram lookup (unmasked drafts: the target's mask rejects those outside the grammar).
Each prompt asks for JSON and runs unconstrained and under its schema (`response_format` json_schema's grammar), plus
plain decoding (K = 0) under the schema, the greedy reference the speculative outputs must equal.

Reported per config: acceptance rate (accepted / drafted) and mean acceptance length (1 + accepted / drafting
rounds, vLLM's convention), tokens/s, outputs that validate against the schema, outputs equal to plain decoding's,
and the grammar compile time. Waits while /tmp/QUIET exists (someone is measuring on this machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from engine.factory import EngineConfig, build_engine
from engine.request.grammar import GrammarSpec
from engine.request.sampling import SamplingParams
from engine.spec.stats import SpecStats

QUIET = Path("/tmp/QUIET")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
FRUITS = {"type": "object", "properties": {"fruits": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}},
    "required": ["name", "color"], "additionalProperties": False}, "minItems": 3, "maxItems": 3}},
    "required": ["fruits"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"}, "genres": {"type": "array",
                                                                                 "items": {"type": "string"}}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "number"},
                                            "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}},
           "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}
PROMPTS = [
    ("Describe a fictional person as JSON with the keys name, age and city.", PERSON),
    ("List three fruits and their colors as JSON: {\"fruits\": [{\"name\": ..., \"color\": ...}, ...]}.", FRUITS),
    ("Give a JSON object for a famous novel with title, author, year and genres.", BOOK),
    ("Report today's weather in Paris as JSON with city, temperature_c and conditions.", WEATHER),
    ("Reply with JSON only: a person called Ada who is 36 and lives in London (keys name, age, city).", PERSON),
]


def wait_quiet() -> None:
    while QUIET.exists():
        print("waiting: /tmp/QUIET exists (someone is measuring)", flush=True)
        time.sleep(60)


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_config(engine, prompts: list[list[int]], schemas: list[dict], constrained: bool, k: int,
               max_tokens: int) -> dict:
    engine.stats = SpecStats()  # fresh counters for this config
    outs, tokens, seconds = [], 0, 0.0
    for ids, schema in zip(prompts, schemas):
        wait_quiet()
        params = SamplingParams(max_tokens=max_tokens,
                                grammar=GrammarSpec.json_schema(schema) if constrained else None)
        start = time.perf_counter()
        out = engine.generate([ids], params, k=k)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outs.append(out)
    stats = engine.stats
    return {"acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
            "num_draft_tokens": stats.num_draft_tokens, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "valid": sum(valid(o.text, s) for o, s in zip(outs, schemas)),
            "finished_stop": sum(o.finish_reason == "stop" for o in outs),
            "token_ids": [o.token_ids for o in outs], "texts": [o.text for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--limit", type=int, default=len(PROMPTS))
    parser.add_argument("--out", default="bench/plots/structured_bench.json")
    args = parser.parse_args()
    wait_quiet()
    torch.manual_seed(0)
    results, compile_stats = {}, {}
    for draft in ("smollm2", "ngram"):
        engine = build_engine(EngineConfig(draft=draft, num_speculative_tokens=args.k))
        chat = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
                for p, _ in PROMPTS[: args.limit]]
        schemas = [s for _, s in PROMPTS[: args.limit]]
        name = "draft-int8" if draft == "smollm2" else "ngram"
        if draft == "smollm2":  # the greedy reference under the schema (one per machine is enough)
            results["plain/schema"] = run_config(engine, chat, schemas, True, 0, args.max_tokens)
        for constrained in (False, True):
            key = f"{name}/{'schema' if constrained else 'free'}"
            results[key] = run_config(engine, chat, schemas, constrained, args.k, args.max_tokens)
            print(key, {k: v for k, v in results[key].items() if k not in ("token_ids", "texts")}, flush=True)
        compile_stats[name] = engine.grammars.compiler.stats.as_dict()
    reference = results["plain/schema"]["token_ids"]
    for key, res in results.items():
        if key.endswith("/schema"):
            res["equal_to_plain"] = sum(a == b for a, b in zip(res["token_ids"], reference))
    print(f"\n{'config':<20}{'accept':>8}{'mean len':>10}{'tok/s':>8}{'valid':>7}{'= plain':>9}")
    for key, res in results.items():
        print(f"{key:<20}{res['acceptance_rate']:>8.3f}{res['mean_acceptance_length']:>10.2f}"
              f"{res['tokens_per_s']:>8.1f}{res['valid']:>4}/{len(reference)}"
              f"{res.get('equal_to_plain', '-')!s:>7}")
    print("grammar compile:", compile_stats)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
              "cpu_threads": torch.get_num_threads(), "k": args.k, "max_tokens": args.max_tokens,
              "results": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in results.items()},
              "grammar_compile": compile_stats}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
