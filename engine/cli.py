"""`specserve generate`: run the speculative engine in-process and print the text and acceptance statistics."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from engine.factory import EngineConfig, build_engine
from engine.request.sampling import SamplingParams


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--target", default=EngineConfig.target, help="alias, .gguf file, HF dir or cached HF id")
    gen.add_argument("--target-dtype", default=EngineConfig.target_dtype)
    gen.add_argument("--draft", default=EngineConfig.draft, help="'ngram', 'none', or a draft model source")
    gen.add_argument("--draft-dtype", default=EngineConfig.draft_dtype)
    gen.add_argument("--k", type=int, default=EngineConfig.num_speculative_tokens, help="draft tokens per round")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = EngineConfig(
        target=args.target, target_dtype=args.target_dtype, draft=args.draft, draft_dtype=args.draft_dtype,
        num_speculative_tokens=args.k,
    )
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens,
        stop=tuple(args.stop), seed=args.seed,
    )
    with tqdm(total=2, desc="loading models", unit="model", file=sys.stderr) as bar:
        def loading(role: str, source: str) -> None:
            if role != "target":
                bar.update()  # the model before this one is loaded
            bar.set_postfix_str(f"{role} {source}")

        engine = build_engine(config, on_loading=loading)
        bar.update()
    tokenizer = engine.tokenizer
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompt]
    stream = len(prompts) == 1 and not args.json

    def show(outputs):
        if stream:
            for out in outputs:
                print(out.new_text, end="", flush=True)

    start = time.perf_counter()
    completions = engine.generate(prompts, params, on_round=show)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    summary = {
        "tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(tokens / elapsed, 2),
        "stats": engine.stats.as_dict(),
    }
    if args.json:
        print(json.dumps({"completions": [{"text": c.text, "finish_reason": c.finish_reason} for c in completions],
                          **summary}))
        return 0
    if not stream:
        for i, c in enumerate(completions):
            print(f"--- [{i}] ({c.finish_reason})\n{c.text}")
    s = engine.stats
    print(
        f"\n--- {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s); draft={args.draft} k={args.k}; "
        f"rounds={engine.timings.rounds} drafted={s.num_draft_tokens} accepted={s.num_accepted_tokens} "
        f"acceptance={s.acceptance_rate:.1%} mean acceptance length={s.mean_acceptance_length:.2f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
