"""The static runner's verify pass by width, one row after a 200-token prompt, in one process. Not a test.

    python -m bench.verify_width [--dtype float32] [--widths 1 5 9 12 16] [--passes 8] [--step-limits 8 16]

With --step-limits A B, engine/models/static/forward.STEP_MAX_WIDTH (the widest forward whose fp32 products take
the CPU kernel a decode step runs) is set to each in turn, alternating pass by pass so drift hits both alike: the
limit's effect on wider passes (widths up to both limits run the same code: their ratio is the machine's spread).
Prints the median ms per width and limit.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.factory import EngineConfig, build_target
from engine.models.static import forward


def verify_ms(runner, width: int, rng: random.Random) -> float:
    runner.add("s")
    runner.forward(["s"], [[rng.randrange(100, 40000) for _ in range(200)]], [1])
    tokens = [rng.randrange(100, 40000) for _ in range(width)]
    start = time.perf_counter()
    runner.forward(["s"], [tokens], [width])
    elapsed = time.perf_counter() - start
    runner.release("s")
    return 1e3 * elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 5, 9, 12, 16])
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--step-limits", type=int, nargs="+", default=[forward.STEP_MAX_WIDTH])
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    runner, _ = build_target(EngineConfig(target="smollm2", target_dtype=args.dtype))
    rng = random.Random(0)
    times = {(limit, w): [] for limit in args.step_limits for w in args.widths}
    for n in range(args.passes):
        for limit in args.step_limits if n % 2 == 0 else args.step_limits[::-1]:
            forward.STEP_MAX_WIDTH = limit
            for w in args.widths:
                times[(limit, w)].append(verify_ms(runner, w, rng))
    for w in args.widths:
        print(f"width {w}: " + ", ".join(f"limit {limit} {statistics.median(times[(limit, w)]):.1f} ms"
                                          for limit in args.step_limits))


if __name__ == "__main__":
    main()
