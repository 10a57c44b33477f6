"""Tensor-parallel runner benchmark on CPU: a decode step and a K+1-token verify at tp=1 (static runner) against
tp=2 over gloo (the transformers runner and the static runner on each rank's shard), alternating in one run.

A random-weight Llama (default: hidden 1024, 8 heads, 4 key/value heads, MLP 2816, 8 layers, vocabulary 32000,
fp32) is saved as safetensors; two spawned ranks (gloo, 1 torch thread each) load their shards from it with
engine/models/shard_loading.py and build both runners; this process runs the tp=1 static runner over the whole model
with as many threads as the two ranks together, and with one. Every round times each configuration and shape in turn
(the order rotates per round), `--steps` forwards each, so a slow patch of the shared machine hits all of them alike. A
step is `Runner.forward` of `width` new tokens on each of `batch` sequences of `--context` tokens, rolled back after (as
the target worker does after a rejection). Not a test:

    GOMP_SPINCOUNT=20000 flock /tmp/specserve-heavy.lock .venv/bin/python -m bench.tp_runner_bench \
        --out bench/plots/tp_runner_bench.json

(GOMP_SPINCOUNT as the served workers get it, deployments/workers/replicas.py: on a shared machine an OpenMP
team's threads otherwise spin at barriers while a descheduled peer holds them up.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch

SHAPES = [(1, 1), (1, 4), (8, 1), (8, 4)]  # (batch, width): decode and a K=3 verify at batch 1 and 8
CONFIGS = ["tp1-static", "tp1-static-1thread", "tp2-transformers", "tp2-static"]
MAX_MODEL_LEN = 512


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def runner_kwargs():
    from engine.models.static.runner import KVBudget

    return dict(max_model_len=MAX_MODEL_LEN, budget=KVBudget(gib=1.0, max_num_seqs=16), compile=False,
                prefill_chunk=256)


def prepare(runner, context: int) -> dict:
    """Sequences for each batch size, prefilled to `context` tokens (untimed)."""
    prompt = [(7 * t) % (runner.vocab_size - 10) + 5 for t in range(context)]
    seqs = {}
    for batch in sorted({b for b, _ in SHAPES}):
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for s in ids:
            runner.add(s)
            runner.forward([s], [runner.sync(s, prompt)], [1])
        seqs[batch] = ids
    return {"prompt": prompt, "seqs": seqs}


def time_block(runner, state: dict, batch: int, width: int, steps: int) -> list[float]:
    """Seconds of `steps` forwards of `width` tokens on `batch` sequences of the prepared context."""
    ids, prompt = state["seqs"][batch], state["prompt"]
    times = []
    for _ in range(steps):
        feeds = [runner.sync(s, prompt) + [11] * (width - 1) for s in ids]  # back to the context, then width tokens
        start = time.perf_counter()
        runner.forward(ids, feeds, [width] * batch)
        times.append(time.perf_counter() - start)
    return times


def _rank(rank, world, port, directory, commands, replies, context):
    import torch.distributed as dist

    from engine.models.loading import resolve
    from engine.models.shard_loading import load_shard
    from engine.models.static.runner import StaticRunner
    from engine.models.transformers_runner import ModelRunner

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    kwargs = runner_kwargs()
    shard = load_shard(resolve(directory), "float32", "cpu", rank, world)
    runners = {"tp2-static": StaticRunner(shard, **kwargs),
               "tp2-transformers": ModelRunner(shard, max_model_len=MAX_MODEL_LEN,
                                               vocab_size=shard.config.vocab_size)}
    states = {name: prepare(r, context) for name, r in runners.items()}
    replies.put((rank, "ready"))
    while True:
        command = commands[rank].get()
        if command is None:
            break
        name, batch, width, steps = command
        times = time_block(runners[name], states[name], batch, width, steps)
        replies.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from engine.models.loading import load_causal_lm, resolve
    from engine.models.static.runner import StaticRunner
    from tests.engine.spawn_ranks import free_port

    threads = torch.get_num_threads()
    tmp = tempfile.mkdtemp(prefix="tp-bench-")
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    ctx = mp.get_context("spawn")
    commands, replies = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, tmp, commands, replies, args.context)) for r in range(2)]
    for p in procs:
        p.start()
    single = StaticRunner(load_causal_lm(resolve(tmp)), **runner_kwargs())
    single_state = prepare(single, args.context)
    for _ in range(2):
        replies.get(timeout=600)
    times: dict[str, list[float]] = {f"{c} b{b} w{w}": [] for c in CONFIGS for b, w in SHAPES}
    try:
        for round_no in range(args.rounds):
            order = CONFIGS[round_no % len(CONFIGS):] + CONFIGS[: round_no % len(CONFIGS)]
            for batch, width in SHAPES:
                for name in order:
                    key = f"{name} b{batch} w{width}"
                    if name.startswith("tp1"):
                        torch.set_num_threads(1 if name.endswith("1thread") else threads)
                        times[key] += time_block(single, single_state, batch, width, args.steps)
                        continue
                    for q in commands:
                        q.put((name, batch, width, args.steps))
                    got = dict(replies.get(timeout=600) for _ in range(2))
                    times[key] += got[0]  # rank 0's wall time (rank 1 waits on it in the collectives anyway)
            print(f"round {round_no + 1}/{args.rounds} done", flush=True)
    finally:
        for q in commands:
            q.put(None)
        for p in procs:
            p.join(60)
    summary = {}
    for key, values in times.items():
        ms = sorted(1000 * v for v in values)
        summary[key] = {"median_ms": statistics.median(ms), "p10_ms": ms[len(ms) // 10],
                        "p90_ms": ms[(9 * len(ms)) // 10], "n": len(ms)}
    print(f"random Llama: {params / 1e6:.1f}M params fp32, hidden {args.hidden}, {args.heads} heads, "
          f"{args.kv_heads} KV heads, {args.layers} layers, context {args.context}; tp=1 with {threads} threads, "
          f"tp=2 ranks 1 thread each (gloo); GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    print("| config | batch | width | median ms | p10-p90 ms | n |")
    print("|---|---|---|---|---|---|")
    for c in CONFIGS:
        for b, w in SHAPES:
            s = summary[f"{c} b{b} w{w}"]
            print(f"| {c} | {b} | {w} | {s['median_ms']:.1f} | {s['p10_ms']:.1f}-{s['p90_ms']:.1f} | {s['n']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": params, "threads_tp1": threads, "summary": summary,
                       "times_ms": {k: [1000 * v for v in vals] for k, vals in times.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
