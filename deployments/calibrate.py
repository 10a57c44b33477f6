"""`specserve-calibrate`: measure what drafting and verifying cost on this machine for a config's model pair.

Loads the config's target and draft in this process, times verify passes and draft steps by batch size
(engine/calibration/measure.py) and writes the cost profile that `speculation.calibration` points the router's K policy
at. It prints the table and, for a few acceptance rates, the K the round plan (engine/spec/plan.plan_round) gives a
round of that many rows that all accept at that rate, and the largest such round that still drafts (the knee). Each
model is measured at the batch sizes its KV cache holds (`runner.max_num_seqs`, the KV budget); the profile
extrapolates beyond them (engine/spec/policy.cost_at). Without a profile file the Draft and Target replicas measure
the same costs themselves at start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import yaml

from deployments.config import SpecServeConfig, config_from_args
from engine.calibration.measure import measure_draft_costs, measure_target_costs, profile_from_costs
from engine.factory import build_proposer, build_target, capture_graphs
from engine.spec.plan import RowOutlook, plan_round
from engine.spec.policy import CostProfile

ACCEPTANCES = (0.5, 0.7, 0.9)
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def planned_k(profile: CostProfile, batch: int, acceptance: float, max_k: int) -> int:
    """The K the served rounds' plan gives a round of `batch` rows that all accept at `acceptance`."""
    return max(plan_round(profile, [RowOutlook(acceptance, max_k)] * batch))


def knee(profile: CostProfile, acceptance: float, max_k: int) -> int:
    """The largest round (up to 4x the largest measured batch) whose plan still drafts at this acceptance; 0: none."""
    return max((b for b in range(1, 4 * profile.batch_sizes[-1] + 1) if planned_k(profile, b, acceptance, max_k)),
               default=0)


def config_from(path: str, app: str | None) -> SpecServeConfig:
    """The validated args of one application in a serve config file."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    apps = doc.get("applications", [])
    chosen = [a for a in apps if app is None or a.get("name") == app]
    if not chosen:
        raise SystemExit(f"no application {app!r} in {path}")
    return config_from_args(chosen[0].get("args"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve-calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="serve_config.yaml", help="serve config whose model pair to measure")
    parser.add_argument("--app", default=None, help="application name (default: the first)")
    parser.add_argument("--out", default="calibration.json", help="where to write the cost profile")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement (the minimum is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)

    import torch

    cfg = config_from(args.config, args.app)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_config = cfg.engine_config()
    max_k = max(cfg.speculation.num_speculative_tokens, 1)
    start = time.perf_counter()
    target, tokenizer = build_target(engine_config)
    capture_graphs(target, max_k)  # costs of the steps as served: graph replays on CUDA
    target_costs = measure_target_costs(target, max_k, args.reps)
    draft_costs = None
    proposer = build_proposer(engine_config, tokenizer, target.vocab_size)
    runner = getattr(proposer, "runner", None)
    if runner is not None:  # a draft model (n-gram lookup and "none" cost no model steps)
        del target
        capture_graphs(runner, max_k)
        draft_costs = measure_draft_costs(runner, args.reps)
    profile = profile_from_costs(target_costs, draft_costs)
    meta = {"target": cfg.model.target, "target_dtype": cfg.model.target_dtype, "draft": cfg.model.draft,
            "draft_dtype": cfg.model.draft_dtype, "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "machine": platform.machine(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}
    profile.to_json(args.out, **meta)

    print(f"measured in {time.perf_counter() - start:.1f} s ({json.dumps(meta)})")
    print("batch  " + "  ".join(f"verify k={k} ms" for k in range(max_k + 1)) + "  draft step ms")
    for i, batch in enumerate(profile.batch_sizes):  # those the target's KV cache holds
        row = "  ".join(f"{1000 * t:14.1f}" for t in profile.verify_seconds[i])
        print(f"{batch:5d}  {row}  {1000 * profile.draft_step_seconds[i]:13.1f}")
    print(f"draft prefill: {1000 * profile.draft_prefill_seconds_per_token:.2f} ms per prompt token")
    print("\nK the round plan gives b rows that all accept at a (the per-token acceptance rate):")
    print("a      " + " ".join(f"b={b:<3d}" for b in BATCHES) + "  knee (largest batch that drafts)")
    for a in ACCEPTANCES:
        ks = " ".join(f"{planned_k(profile, b, a, max_k):<5d}" for b in BATCHES)
        print(f"{a:<5}  {ks}  {knee(profile, a, max_k)}")
    print(f"\nwrote {args.out}; point `speculation.calibration` at it to use it instead of measuring at start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
