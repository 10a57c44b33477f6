"""Greedy speculative decoding against plain decoding of the same target, in one process, per target dtype (issue
16): how many of bench/prompts.jsonl's texts come out identical, and where the first differs. Not a test.

    python -m bench.greedy_agreement bfloat16 [TOKENS] [DRAFT]   # DRAFT: ngram (default) or smollm2 (int8 copy)
"""
import json
import sys

import torch

from engine import EngineConfig, SamplingParams
from engine.factory import build_proposer, build_target
from engine.speculative import SpeculativeEngine


def main() -> None:
    torch.set_num_threads(2)
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    draft = sys.argv[3] if len(sys.argv) > 3 else "ngram"
    config = EngineConfig(target="smollm2", target_dtype=dtype, draft=draft, draft_dtype="int8", max_model_len=2048)
    runner, tokenizer = build_target(config)
    proposer = build_proposer(config, tokenizer, runner.vocab_size)
    prompts = [tokenizer.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True, tokenize=False)
               for line in open("bench/prompts.jsonl")]
    ids = [tokenizer(p).input_ids for p in prompts]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = SpeculativeEngine(runner, tokenizer, None, 0).generate(ids, params)
    spec = SpeculativeEngine(runner, tokenizer, proposer, 3).generate(ids, params)
    same = 0
    for p, s in zip(plain, spec):
        if p.token_ids == s.token_ids:
            same += 1
        else:
            first = next(i for i, (a, b) in enumerate(zip(p.token_ids, s.token_ids)) if a != b)
            print(f"differs at token {first} of {tokens}")
    print(f"{dtype}, draft {draft}, K=3, {tokens} tokens: {same} of {len(ids)} texts identical")


if __name__ == "__main__":
    main()
