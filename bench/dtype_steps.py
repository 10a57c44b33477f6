"""The static runner's step times per target dtype, in one process (issue 16). Not a timed test.

    python -m bench.dtype_steps float32,bfloat16,int8 [ROUNDS]   # SmolLM2-135M, 2 threads

For each (batch, tokens per row): the batch's 100-token prompts prefilled in one call (ms), then the median of 6
steps of that width (ms). The dtypes alternate within each round, so machine drift hits them alike. `int8` is the
weight-only int8 copy a draft runs. SPECSERVE_CPU_OPS=aten gives ATen's operators (the path before the kernel).
"""
import random
import statistics
import sys
import time

import torch

from engine.factory import EngineConfig, build_target

SHAPES = [(1, 1), (1, 4), (8, 1), (8, 4), (16, 1)]  # (batch, tokens per row): decode and 4-token verify


def step_ms(runner, batch: int, width: int, rng: random.Random, steps: int = 6) -> tuple[float, float]:
    """(median step ms, prefill ms of the batch's prompts)."""
    ids = [f"s{i}" for i in range(batch)]
    for seq_id in ids:
        runner.add(seq_id)
    start = time.perf_counter()
    runner.forward(ids, [[rng.randrange(100, 40000) for _ in range(100)] for _ in ids], [1] * batch)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        tokens = [[rng.randrange(100, 40000) for _ in range(width)] for _ in ids]
        start = time.perf_counter()
        runner.forward(ids, tokens, [width] * batch)
        times.append(time.perf_counter() - start)
    for seq_id in ids:
        runner.release(seq_id)
    return round(statistics.median(times) * 1e3, 1), round(prefill * 1e3)


def main() -> None:
    torch.set_num_threads(2)
    dtypes = (sys.argv[1] if len(sys.argv) > 1 else "float32,bfloat16,int8").split(",")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    runners = {d: build_target(EngineConfig(target="smollm2", target_dtype=d, max_model_len=2048))[0] for d in dtypes}
    rng = random.Random(0)
    print("round batch width " + " ".join(f"{d}:(step ms, prefill ms)" for d in dtypes))
    for r in range(rounds):
        for batch, width in SHAPES:
            order = dtypes if r % 2 == 0 else dtypes[::-1]
            got = {d: step_ms(runners[d], batch, width, rng) for d in order}
            print(r, batch, width, " ".join(str(got[d]) for d in dtypes), flush=True)


if __name__ == "__main__":
    main()
