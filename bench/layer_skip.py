"""Self-speculative drafts by skipping middle layers (Draft & Verify, Zhang et al. 2023, arXiv 2309.08168; SWIFT, Xia
et al. 2024) against the early exit `draft: self` serves (engine/proposers/early_exit.py), at the same number of
layers run: each layer set's greedy agreement with the whole model over the target's own answers to unseen prompts
(engine/proposers/early_exit.exit_agreement, which runs any layer set). A draft step's cost grows with the layers it
runs, so at equal counts the set that agrees more drafts better.

    .venv/bin/python -m bench.layer_skip [--prompts bench/prompts_fresh.jsonl] [--num-prompts 6] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layer_sets(total: int, kept: int) -> dict[str, tuple[int, ...]]:
    """Ways of running `kept` of `total` layers: the first ones (an early exit, the last layers' final norm and LM
    head after them), and sets that keep the first and last layers and skip in the middle."""
    first_two_thirds = -(-2 * kept // 3)
    sets = {
        "early exit": tuple(range(kept)),
        "skip a middle block (keep 2/3 first)": tuple(range(first_two_thirds)) + tuple(
            range(total - (kept - first_two_thirds), total)),
        "skip a middle block (keep 1/2 first)": tuple(range(kept // 2)) + tuple(range(total - (kept - kept // 2), total)),
    }
    edge = min(4, kept // 3)
    middle = list(range(edge, total - edge))
    step = len(middle) / max(1, kept - 2 * edge)
    picked = sorted({middle[int(i * step)] for i in range(kept - 2 * edge)})
    sets["every n-th middle layer"] = tuple(range(edge)) + tuple(picked) + tuple(range(total - edge, total))
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "prompts_fresh.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96, help="answer tokens generated per prompt")
    ap.add_argument("--kept", type=int, nargs="+", default=[12, 16, 20, 24])
    args = ap.parse_args()

    import yaml

    from deployments.config import SpecServeConfig
    from engine.factory import build_target
    from engine.proposers.early_exit import exit_agreement, target_text
    from engine.training.prompts import encode_prompt

    serve_args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    runner, tokenizer = build_target(SpecServeConfig.model_validate(serve_args).engine_config())
    total = len(runner.model.layers)
    lines = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    texts = []
    for item in lines[: args.num_prompts]:
        prompt = encode_prompt(tokenizer, item["messages"])
        texts.append((prompt, target_text(runner, prompt, args.tokens)))
    print(f"{total} layers, {len(texts)} unseen prompts, {args.tokens} answer tokens each; agreement with the whole "
          f"model's greedy token")
    for kept in args.kept:
        sets = layer_sets(total, kept)
        scores = {name: 0.0 for name in sets}
        for prompt, text in texts:
            agreement = exit_agreement(runner, text, list(sets.values()), first=len(prompt) - 1)
            for name, ids in sets.items():
                scores[name] += agreement[ids] / len(texts)
        for name, ids in sets.items():
            print(f"  {kept:2d} layers  {name:40s} {scores[name]:.3f}  {list(ids)}")


if __name__ == "__main__":
    main()
