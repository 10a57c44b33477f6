"""An EAGLE-3 head's drafting cost beside the target's step, on the Llama-3.1-8B shape (issue 48's GPU check).

A random-weight target of Llama-3.1-8B's shape (bench/gpu_runner_bench.build_model) on the static runner (CUDA graphs
on a GPU, the aux-layer states captured inside them) and a random-weight head of the shape of
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (one layer of the target's width, 32000-token draft vocabulary, aux layers
2 / 16 / 29), written in speculators' format and loaded back as `model.draft: eagle3:DIR` would. For each batch size
it times the target's decode step and the head's K drafts after a one-token pass (the head's catch-up over that
position, then K - 1 steps), and reports the drafting cost per draft token as a share of a target step. Acceptance
is meaningless for random weights and is not reported. Not a test:

    python -m bench.eagle3_cost --out bench/results/eagle3_cost.json          # a GPU (bench/gpu_check.sh eagle3)
    python -m bench.eagle3_cost --tiny                                        # a reduced shape, to check it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from bench.gpu_runner_bench import LLAMA_31_8B, build_model

TINY = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2}


def random_head(target_config, draft_vocab: int, seed: int = 0, aux_layers: tuple[int, ...] | None = None):
    """A head of the target's width (EAGLE-3's Llama-3.1-8B head is one such layer), random weights; reading
    `aux_layers` (default: low, middle and high)."""
    from transformers import LlamaConfig

    from engine.proposers.eagle3_head import (
        Eagle3Config,
        Eagle3Head,
        default_aux_layers,
    )

    c = target_config
    layer = LlamaConfig(**{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                                      "max_position_embeddings")},
                        num_hidden_layers=1, rope_parameters=getattr(c, "rope_parameters", None))
    head = Eagle3Head(Eagle3Config(layer, draft_vocab, aux_layers or default_aux_layers(c.num_hidden_layers),
                                   c.hidden_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02)
        head.set_draft_vocab(torch.randperm(c.vocab_size, generator=gen)[:draft_vocab].sort().values)
    return head


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(runner, drafter, batch: int, k: int, context: int, reps: int) -> dict:
    from engine.spec.target_drafts import DraftFrom

    ids = [f"b{batch}-{i}" for i in range(batch)]
    prompt = [(7 * t) % 3000 + 5 for t in range(context)]
    for s in ids:
        runner.add(s)
        runner.forward([s], [runner.sync(s, prompt)], [1])
    device = runner.device
    steps, drafts = [], []
    for _ in range(reps + 2):  # the first two warm up (the head's first catch-up covers the whole prompt)
        for s in ids:
            runner.sync(s, prompt + [9])
        steps.append(timed(device, lambda: runner.forward(ids, [[11]] * batch, [1] * batch)))
        rows = [DraftFrom(s, b, 0, context + 2, 13, k) for b, s in enumerate(ids)]
        drafts.append(timed(device, lambda rows=rows: drafter.draft(runner, rows, None)))
    for s in ids:
        runner.release(s)
    step, draft = statistics.median(steps[2:]), statistics.median(drafts[2:])
    return {"batch": batch, "target_step_ms": step * 1e3, "draft_ms_per_round": draft * 1e3,
            "draft_ms_per_token": draft * 1e3 / k, "draft_token_over_step": draft / k / step}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="a reduced width and vocabulary (a CPU check that it runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from engine.models.kv_budget import KVBudget
    from engine.models.static.runner import StaticRunner
    from engine.proposers.eagle3 import Eagle3Drafter
    from engine.proposers.eagle3_checkpoint import load_eagle3, save_speculators

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    model = build_model(args.layers, device, **(TINY if args.tiny else {}))
    draft_vocab = min(args.draft_vocab, model.config.vocab_size // 2) if args.tiny else args.draft_vocab
    with tempfile.TemporaryDirectory() as directory:  # the head goes through the checkpoint format, as served
        save_speculators(random_head(model.config, draft_vocab), directory)
        head = load_eagle3(directory, model.config.hidden_size, model.config.vocab_size, args.layers)
    runner = StaticRunner(model, budget=KVBudget(max_num_seqs=max(batches)), max_model_len=args.context + 64)
    drafter = Eagle3Drafter(head, runner)  # before the warm-up: the captured steps copy the aux states
    runner.warm_up(args.k)
    rows = [measure(runner, drafter, b, args.k, args.context, args.reps) for b in batches]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "target": {**LLAMA_31_8B, "num_hidden_layers": args.layers, **(TINY if args.tiny else {})},
              "draft_vocab": draft_vocab,
              "aux_layers": list(head.config.aux_layers), "k": args.k, "context": args.context,
              "step_mode": "graphs" if runner.graphs is not None else "eager", "rows": rows}
    print(f"{'batch':>5s} {'target step':>12s} {'K drafts':>9s} {'per draft':>10s} {'share of a step':>16s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['target_step_ms']:10.2f}ms {r['draft_ms_per_round']:7.2f}ms "
              f"{r['draft_ms_per_token']:8.2f}ms {100 * r['draft_token_over_step']:15.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
