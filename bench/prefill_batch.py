"""New prompts prefilled in one runner call, each row's chunks alone (no forwards shared between prompts) against
rows in neighbouring slots sharing forwards (engine/models/static/prefill_plan.prefill_groups), alternating in one
process. Not a timed test.

    python -m bench.prefill_batch [ROUNDS]   # SmolLM2-135M fp32, 8 prompts of 70-110 random tokens, 2 threads
"""
import random
import statistics
import sys
import time

import torch

from engine.factory import EngineConfig, build_target
from engine.models.static import prefill_plan

torch.set_num_threads(2)
runner, tok = build_target(EngineConfig(target="smollm2", target_dtype="float32", max_model_len=2048))
rng = random.Random(0)
lens = [rng.randint(70, 110) for _ in range(8)]
prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lens]
orig = prefill_plan.prefill_groups
def alone(slots, widths, max_tokens): return [[i] for i in range(len(slots))]
def once(mode):
    prefill_plan.prefill_groups = orig if mode == "grouped" else alone
    ids = [f"{mode}{i}" for i in range(8)]
    for s in ids: runner.add(s)
    t = time.perf_counter(); out = runner.forward(ids, prompts, [1] * 8); dt = time.perf_counter() - t
    for s in ids: runner.release(s)
    return dt, out
once("grouped"); once("alone")
res = {"alone": [], "grouped": []}
outs = {}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    for mode in ("alone", "grouped") if r % 2 == 0 else ("grouped", "alone"):
        dt, outs[mode] = once(mode); res[mode].append(dt)
print("prompt tokens", sum(lens), lens)
for m, v in res.items(): print(m, [round(x*1e3) for x in v], "median ms", round(statistics.median(v)*1e3))
print("ratio alone/grouped per pair", [round(a/g, 2) for a, g in zip(res["alone"], res["grouped"])])
print("max |logit diff|", float((outs["alone"] - outs["grouped"]).abs().max()))
