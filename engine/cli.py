"""`specserve generate`: run the speculative engine in-process and print the text and acceptance statistics.
`specserve train-heads`: train Medusa heads for a target on its own answers (engine/training/medusa.py)."""

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
    heads = sub.add_parser("train-heads", help="train Medusa heads or an EAGLE-3 head on the target's own answers "
                           "(self-distillation)")
    heads.add_argument("--target", default=EngineConfig.target, help="alias, .gguf file, HF dir or cached HF id")
    heads.add_argument("--target-dtype", default="auto", help="dtype the answers are generated in (as served)")
    heads.add_argument("--out", required=True, help="checkpoint directory (serve it with model.draft: medusa:OUT or "
                       "eagle3:OUT)")
    heads.add_argument("--method", default="medusa", choices=["medusa", "eagle3"],
                       help="medusa: Medusa-1 heads; eagle3: an EAGLE-3 head with training-time test, written in "
                       "speculators' format (vllm serve reads it too)")
    heads.add_argument("--prompts", default=None, help="JSONL of {'prompt'} or {'messages'} (default: the shipped set)")
    heads.add_argument("--chat-template", default=None, help="a Jinja file: the template the server renders with "
                       "(default: the tokenizer's own)")
    heads.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    heads.add_argument("--max-tokens", type=int, default=256, help="longest answer regenerated per prompt")
    heads.add_argument("--num-heads", type=int, default=3)
    heads.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head")
    heads.add_argument("--shared-lm-head", action="store_true",
                       help="heads end in the target's LM head (one product for all heads; this project's format)")
    heads.add_argument("--draft-vocab", type=int, default=None, help="draft from the N most frequent answer tokens "
                       "only (the LM heads' rows of them: cheaper drafting; 0: the whole vocabulary; default 0 for "
                       "medusa, 8192 for eagle3)")
    heads.add_argument("--ttt-steps", type=int, default=3, help="eagle3: unrolled draft steps per position")
    heads.add_argument("--labels", default="tokens", choices=["tokens", "distribution"],
                       help="eagle3: train against the target's greedy answer tokens, or its next-token "
                       "distribution (EAGLE-3's own loss)")
    heads.add_argument("--epochs", type=int, default=None, help="default 2 (medusa), 4 (eagle3)")
    heads.add_argument("--batch-size", type=int, default=None, help="positions (medusa, default 256) or sequences "
                       "(eagle3, default 4) per step")
    heads.add_argument("--lr", type=float, default=1e-3)
    made = sub.add_parser("make-prompts", help="sample user prompts from the target's own chat turn (Magpie), a "
                          "prompt file for train-heads --prompts")
    made.add_argument("--target", default=EngineConfig.target, help="alias, .gguf file, HF dir or cached HF id")
    made.add_argument("--target-dtype", default="auto")
    made.add_argument("--out", required=True, help="JSONL file to write, one {'prompt'} per line")
    made.add_argument("--count", type=int, default=2000)
    made.add_argument("--seed", type=int, default=0, help="row i samples with seed SEED + i: the same file each run")
    made.add_argument("--max-tokens", type=int, default=96, help="longest prompt kept (longer ones are dropped)")
    made.add_argument("--temperature", type=float, default=1.0)
    made.add_argument("--top-p", type=float, default=1.0)
    made.add_argument("--chat-template", default=None, help="a Jinja file: the template the server renders with "
                      "(default: the tokenizer's own)")
    made.add_argument("--exclude", action="append", default=[],
                      help="a prompt file whose prompts are never written (the benchmarks' held-out prompts)")
    return parser


def _plain_engine(args):
    """The target alone (`--target`, `--target-dtype`), rendering chats with `--chat-template` where given: what
    train-heads and make-prompts generate with."""
    from pathlib import Path

    engine = build_engine(EngineConfig(target=args.target, target_dtype=args.target_dtype, draft="none",
                                       num_speculative_tokens=0))
    if args.chat_template:
        engine.tokenizer.chat_template = Path(args.chat_template).read_text()
    return engine


def make_prompts(args) -> int:
    """`specserve make-prompts` (engine/training/sampled_prompts.py)."""
    from engine.training.prompts import training_prompts
    from engine.training.sampled_prompts import sample_prompts, write_prompts

    engine = _plain_engine(args)
    exclude = {m["content"] for path in args.exclude for messages in training_prompts(path) for m in messages
               if m["role"] == "user"}
    prompts = sample_prompts(engine, args.count, seed=args.seed, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_p=args.top_p, exclude=exclude)
    write_prompts(prompts, args.out)
    print(f"{len(prompts)} prompts written to {args.out}", file=sys.stderr)
    return 0 if len(prompts) == args.count else 1


def train_heads(args) -> int:
    """`specserve train-heads`: answers regenerated by the target (as served: chat template, greedy), then Medusa
    heads or an EAGLE-3 head trained on its float32 hidden states; resumable (OUT/data.pt, OUT/train_state.pt)."""
    from pathlib import Path

    from engine.models.loading import load_causal_lm, resolve
    from engine.training.answers import regenerate
    from engine.training.medusa import TrainSettings, train
    from engine.training.prompts import encode_prompt as encode_messages
    from engine.training.prompts import training_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = _plain_engine(args)
    tokenizer = engine.tokenizer
    conversations = training_prompts(args.prompts)[: args.limit]
    prompts = [encode_messages(tokenizer, messages) for messages in conversations]
    answers = regenerate(engine, prompts, args.max_tokens, out / "data.pt")
    print(f"{len(prompts)} prompts, {answers.answer_tokens} answer tokens regenerated by the target "
          f"(a small set: Medusa's recipe uses ~60k conversations, EAGLE-3's ShareGPT and UltraChat, ~600k)",
          file=sys.stderr)
    del engine
    model = load_causal_lm(resolve(args.target), "float32")
    if args.method == "eagle3":
        from engine.training import eagle3

        settings = eagle3.Eagle3Settings(
            ttt_steps=args.ttt_steps, epochs=args.epochs or 4, batch_size=args.batch_size or 4, lr=args.lr,
            draft_vocab=8192 if args.draft_vocab is None else args.draft_vocab, labels=args.labels)
        # the verifier `vllm serve OUT` loads: the target's HF directory (an alias or GGUF file's converted copy)
        report = eagle3.train(model, answers, out, settings, base_model=str(resolve(args.target).directory))
        print(json.dumps(report, indent=2))
        return 0
    settings = TrainSettings(num_heads=args.num_heads, num_layers=args.num_layers,
                             shared_lm_head=args.shared_lm_head, epochs=args.epochs or 2,
                             batch_size=args.batch_size or 256, lr=args.lr, draft_vocab=args.draft_vocab or 0)
    report = train(model, answers, out, settings, base_model=args.target)
    print(json.dumps(report, indent=2))
    return 0


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train-heads":
        return train_heads(args)
    if args.command == "make-prompts":
        return make_prompts(args)
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
