"""GPU runner benchmark: decode and K+1-token verify of a Llama-3.1-8B-shaped model against the memory roofline.

Random weights (the timing does not depend on their values), bf16, on one CUDA device. For batch 1, 8 and 32 and
widths 1 (decode) and K+1 (verify), it times `StaticRunner.forward` (CUDA graphs captured at start, and eager) and the
transformers runner (`ModelRunner`, eager) on sequences of `--context` tokens, and compares with the roofline: the
bytes a step must read (weights + the rows' keys/values) over the device bandwidth measured here with a large
device-to-device copy. Not a test; needs a GPU and no Ray:

    python -m bench.gpu_runner_bench --out bench/results/gpu_runner_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def measured_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Bytes per second of a device-to-device copy (on a CPU, a host copy), counting bytes read and written (the
    median of 10)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = int(gib * (1 << 30)) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)  # written: untouched host pages would read as zeros
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * n * 2 / statistics.median(times[2:])


def build_model(layers: int, device: torch.device, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_31_8B, "num_hidden_layers": layers, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    return model.eval()


def _sequences(runner, batch: int, width: int, context: int) -> tuple[list[str], list[int]]:
    """`batch` sequences of `context` prompt tokens in the runner's cache: (their ids, the prompt)."""
    ids = [f"b{batch}w{width}-{i}" for i in range(batch)]
    prompt = [(7 * t) % 30000 + 5 for t in range(context)]
    for s in ids:
        runner.add(s)
        runner.forward([s], [runner.sync(s, prompt)], [1])
    return ids, prompt


def _timed_step(runner, ids: list[str], prompt: list[int], width: int) -> float:
    """Seconds of one forward of `width` new tokens on each sequence, from exactly the prompt's tokens."""
    for s in ids:
        runner.sync(s, prompt + [9])  # back to exactly `context` tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.forward(ids, [[11] * width] * len(ids), [width] * len(ids))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_steps(runner, batch: int, width: int, context: int, reps: int) -> float:
    """Median seconds of one forward of `width` new tokens on each of `batch` sequences of `context` tokens."""
    ids, prompt = _sequences(runner, batch, width, context)
    times = [_timed_step(runner, ids, prompt, width) for _ in range(reps + 3)]
    for s in ids:
        runner.release(s)
    return statistics.median(times[3:])


def profile_steps(runner, batch: int, width: int, context: int, steps: int = 5, top: int = 20) -> dict:
    """Where a step's device time goes (torch.profiler; kernels inside graph replays included): kernels per step,
    device ms per step, and the `top` kernels by device time, each with its launches and ms per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    ids, prompt = _sequences(runner, batch, width, context)
    _timed_step(runner, ids, prompt, width)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _timed_step(runner, ids, prompt, width)
    for s in ids:
        runner.release(s)
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    kernels.sort(key=device_us, reverse=True)
    return {"batch": batch, "width": width, "kernels_per_step": sum(e.count for e in kernels) / steps,
            "device_ms_per_step": sum(device_us(e) for e in kernels) / steps / 1e3,
            "top": [{"kernel": e.key[:90], "launches_per_step": e.count / steps,
                     "ms_per_step": device_us(e) / steps / 1e3} for e in kernels[:top]]}


def main() -> None:
    from engine.models.static.runner import KVBudget, StaticRunner
    from engine.models.transformers_runner import ModelRunner

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--runners", default="static,eager,transformers")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the static runner's graph step at batch 1 (widths 1 and K+1): kernels by time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = measured_bandwidth(device)
    model = build_model(args.layers, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 128 * 2
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
               "bandwidth_gb_s": bandwidth / 1e9, "weight_gb": weight_bytes / 1e9, "context": args.context,
               "k": args.k, "rows": []}
    print(f"{results['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB",
          flush=True)
    budget = KVBudget(gib=16.0, max_num_seqs=max(batches))
    for kind in args.runners.split(","):
        if kind == "transformers":
            runner = ModelRunner(model, max_model_len=args.max_model_len)
        else:
            start = time.perf_counter()
            runner = StaticRunner(model, max_model_len=args.max_model_len, budget=budget,
                                  compile="auto" if kind == "static" else "off")
            if kind == "static":  # CUDA graphs, one per (batch bucket, width), captured before serving as a worker does
                runner.warm_up(args.k)
            print(f"{kind}: built in {time.perf_counter() - start:.1f} s"
                  + (f" ({len(runner.graphs.graphs)} CUDA graphs captured)" if runner.graphs else ""), flush=True)
        for batch in batches:
            for width in (1, args.k + 1):
                if kind == "transformers" and batch > 8:
                    continue  # its dense masks and growing caches: slow at large batch, and not the path served
                start = time.perf_counter()
                seconds = time_steps(runner, batch, width, args.context, args.reps)
                print(f"  ({time.perf_counter() - start:.0f} s with compilation)", flush=True)
                read = weight_bytes + batch * (args.context + width) * kv_bytes_per_token
                roofline = read / bandwidth
                row = {"runner": kind, "batch": batch, "width": width, "ms": seconds * 1e3,
                       "roofline_ms": roofline * 1e3, "x_roofline": seconds / roofline,
                       "tokens_per_s": batch * width / seconds}
                results["rows"].append(row)
                print(f"{kind:12s} batch {batch:3d} width {width}: {seconds * 1e3:8.2f} ms  roofline "
                      f"{roofline * 1e3:6.2f} ms  x{seconds / roofline:5.2f}", flush=True)
        if kind == "static" and args.profile:
            for width in (1, args.k + 1):
                found = profile_steps(runner, 1, width, args.context)
                results.setdefault("profile", []).append(found)
                print(f"profile batch 1 width {width}: {found['kernels_per_step']:.0f} kernels, "
                      f"{found['device_ms_per_step']:.2f} device ms a step", flush=True)
                for k in found["top"]:
                    print(f"  {k['ms_per_step']:7.3f} ms {k['launches_per_step']:6.0f}x  {k['kernel']}", flush=True)
        del runner
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
