"""bf16 products on CPU: specserve's VDPBF16PS kernel against AMX tiles (where the CPU has AMX), the widening kernel
and oneDNN (issues 16, 50). Not a timed test; needs a CPU with AVX512_BF16.

    python -m bench.bf16_products matrix     # one 576 x 1536 product at 1..256 rows, weights in cache (ms, GMAC/s)
    python -m bench.bf16_products steps [N]  # SmolLM2-135M bf16 steps and prefills, both kernels, N rounds
    python -m bench.bf16_products choice [4096x14336 ...]  # what engine/models/cpu/bf16_products.py chooses for
                                             # these layer shapes (in x out; default SmolLM2-135M's), its timings

`matrix`: bf16_gemm (packed weights), small_gemm (bf16 weights widened in registers) and ATen's bf16 F.linear
(oneDNN, bf16 activations), each the mean of 50 calls, 2 threads. `steps`: the same bf16 target built twice in one
process, once with bf16_gemm and once with it hidden (the widening kernel), alternating per shape; median step ms
and the batch's 100-token prompts prefilled in one call (`bench.dtype_steps.step_ms`).
"""
import random
import sys
import time

import torch
import torch.nn.functional as F

from engine.models.cpu import extension as cpu_extension
from engine.models.cpu.linear import pack_bf16


def mean_ms(fn, calls: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def matrix() -> None:
    gemm, widening = cpu_extension.bf16_gemm(), cpu_extension.small_gemm()
    if gemm is None:
        sys.exit("bf16_gemm unavailable here (no AVX512_BF16, or the operators did not build)")
    in_features, out_features = 576, 1536
    weight = torch.randn(out_features, in_features).bfloat16()
    packed = pack_bf16(weight)
    amx = cpu_extension.amx_bf16_gemm()
    print(f"AMX: {cpu_extension.amx_unavailable() or 'available'}")
    print("rows  bf16_gemm ms (GMAC/s)  amx ms (GMAC/s)  widening ms  oneDNN ms")
    for rows in (1, 4, 8, 32, 100, 256):
        x = torch.randn(rows, in_features)
        macs = rows * in_features * out_features
        new = mean_ms(lambda: gemm(x, packed, out_features, None))
        tiles = mean_ms(lambda: amx(x, packed, out_features, None)) if amx is not None else float("nan")
        old = mean_ms(lambda: widening(x, weight, None))
        onednn = mean_ms(lambda: F.linear(x.bfloat16(), weight))
        print(f"{rows:4d}  {new:.3f} ({macs / new / 1e6:.0f})  {tiles:.3f} ({macs / tiles / 1e6:.0f})  {old:.3f}  "
              f"{onednn:.3f}")


def steps(rounds: int) -> None:
    from bench.dtype_steps import SHAPES, step_ms
    from engine.factory import EngineConfig, build_target

    config = EngineConfig(target="smollm2", target_dtype="bfloat16", max_model_len=2048)
    packed = build_target(config)[0]
    real = cpu_extension.bf16_gemm
    cpu_extension.bf16_gemm = lambda: None  # projections built now keep [out, in] bf16 weights: the widening kernel
    try:
        widening = build_target(config)[0]
    finally:
        cpu_extension.bf16_gemm = real
    rng = random.Random(0)
    print("round batch width bf16_gemm:(step ms, prefill ms) widening:(step ms, prefill ms)")
    for r in range(rounds):
        for batch, width in SHAPES + [(16, 4)]:
            order = [("new", packed), ("old", widening)] if r % 2 == 0 else [("old", widening), ("new", packed)]
            got = {name: step_ms(runner, batch, width, rng) for name, runner in order}
            print(r, batch, width, got["new"], got["old"], flush=True)


def choice(shapes: list[str]) -> None:
    """The choice bf16_products makes for one layer of each shape (hidden x intermediate: qkv roughly 1.5 hidden wide,
    o, gate_up, down; SmolLM2-135M's 576 x 1536 by default), with SPECSERVE_BF16_PRODUCT=auto."""
    import os

    from engine.models.cpu import bf16_products

    os.environ["SPECSERVE_BF16_PRODUCT"] = "auto"
    found = bf16_products.operators()
    print(f"operators: {sorted(found)}; AMX: {cpu_extension.amx_unavailable() or 'available'}")
    for shape in shapes or ["576x1536"]:
        hidden, intermediate = (int(v) for v in shape.split("x"))
        layer = [(hidden, hidden * 3 // 2), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]
        projections = [(pack_bf16(torch.randn(n, k).bfloat16()), n) for k, n in layer]
        if len(found) > 1:
            print(shape, "agree bit for bit:", bf16_products.agree(found, *projections[0]))
        bf16_products._current = None  # one choice per process: a new one for each shape here
        print(shape, bf16_products.choose(projections).stats(), flush=True)


def main() -> None:
    torch.set_num_threads(2)
    mode = sys.argv[1] if len(sys.argv) > 1 else "matrix"
    if mode == "matrix":
        matrix()
    elif mode == "steps":
        steps(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    elif mode == "choice":
        choice(sys.argv[2:])
    else:
        sys.exit(f"unknown mode {mode!r}: matrix, steps or choice")


if __name__ == "__main__":
    main()
