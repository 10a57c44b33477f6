"""Engine benchmark: our speculative engine vs HF transformers and vLLM, same prompts, same machine, one run.

    python -m bench.engine_bench [--limit N] [--max-tokens 64] [--k K] [--policy fixed] [--skip-hf] [--skip-vllm]

Target: SmolLM2-135M-Instruct, fp32. Draft: the same weights, int8 weight-only (the engine's default draft).
Every prompt of bench/prompts.jsonl (chat, summarization, code) goes through the chat template; decoding is
greedy, at most --max-tokens new tokens (EOS stops earlier), K = EngineConfig's default unless --k, planned per
round as the served round plans it (engine/spec/plan.plan_ks on costs measured at start; --policy fixed: K up to
max_batch_for_speculation live sequences). Configs:

* ours/plain   our engine with K = 0, batch 1 and batch 8 (the baselines of our speculative configs)
* hf/generate  HF `generate()`; hf/assisted: `assistant_model=` the same int8 draft module, K tokens a round
               (constant schedule, no confidence cut); hf/lookup: `prompt_lookup_num_tokens=K`, n-grams up to 4
* ours/draft   our engine with the int8 draft; ours/ngram: n-gram lookup (n = 2..4). Batch 1 = prompts one by
               one; batch 8 = one generate() over 8 sequences (prompts cycled to fill the last group)
* vllm/*       bench/vllm_peer.py in bench/.vllm-venv: plain, ngram, self_draft (the fp32 model drafting itself)

All our and HF configs are loaded and warmed up first, then run interleaved: prompt by prompt (group of 8 by
group of 8), each config in turn, so load from other users of the machine falls on all of them alike. vLLM
runs after them, one process per config.

Reported: tokens, wall seconds (prefill in, warm-up out), tokens/s, acceptance rate (accepted / drafted, vLLM's
definition), mean acceptance length (1 + accepted / drafting rounds), speedup over the same framework's plain
run at the same batch, and for ours the ideal speedup of Leviathan et al. (arXiv 2211.17192),
ideal = E * T_target / (K * T_draft + T_verify): T_target = plain seconds per round (= per token at batch 1),
K * T_draft and T_verify = our engine's measured draft and verify seconds per round, E = (1 - a^(d+1)) / (1 - a)
averaged over the rounds' draft lengths d (K for a draft model; n-gram lookup may find fewer or none), a = the
per-token acceptance probability the formula assumes = accepted / (accepted + rejections). `id.lit` plugs in
accepted / drafted and d = K instead (that ratio counts untested positions after a rejection as failures).
Greedy outputs are compared with ours/plain at batch 1 (token ids; vLLM: decoded text).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from tqdm import tqdm

from engine.calibration.measure import measure_profile
from engine.factory import EngineConfig
from engine.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve
from engine.models.transformers_runner import ModelRunner
from engine.proposers.draft_model import DraftModelProposer
from engine.proposers.ngram import NgramProposer
from engine.request.sampling import SamplingParams
from engine.spec.stats import EngineTimings, SpecStats
from engine.speculative import SpeculativeEngine

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "bench" / ".vllm-venv" / "bin" / "python"
VLLM_CONFIGS = ("plain", "ngram", "self_draft")
WARMUP = [{"role": "user", "content": "Say hello in one short sentence."}]
BATCH = 8


@dataclass
class BenchStats(SpecStats):
    """SpecStats plus what the ideal speedup needs: rejections and the rounds' draft lengths."""

    rejections: int = 0  # drafted rounds that rejected a token (at most one per round)
    draft_lengths: Counter = field(default_factory=Counter)  # draft length -> sequence-rounds

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        super().record(num_draft, num_accepted, num_emitted)
        self.rejections += num_accepted < num_draft
        self.draft_lengths[num_draft] += 1

    def as_dict(self) -> dict:
        accepted = self.num_accepted_tokens
        token_rate = accepted / (accepted + self.rejections) if accepted + self.rejections else 0.0
        return super().as_dict() | {"rejections": self.rejections, "per_token_acceptance": round(token_rate, 4),
                                    "draft_lengths": dict(sorted(self.draft_lengths.items()))}


def encode(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def machine_info() -> dict:
    import transformers
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(), "avx2": " avx2" in cpuinfo,
            "avx512f": " avx512f" in cpuinfo, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "loadavg_before": os.getloadavg(),
            "git_commit": git("rev-parse", "--short", "HEAD"), "engine_uncommitted": git("status", "--short", "engine")}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def result(name, batch, tokens, seconds, stats=None, timings=None, **extra) -> dict:
    return {"name": name, "batch": batch, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_per_s": round(tokens / seconds, 2) if seconds else None,
            "spec": stats.as_dict() if stats and stats.num_drafts else None,
            "timings": vars(timings) | {"mean_batch": timings.mean_batch} if timings else None, **extra}


@dataclass
class Config:
    """One configuration; `run` maps a group of prompts to their output token ids."""

    name: str
    batch: int
    framework: str
    run: Callable[[list[list[int]]], list[list[int]]]
    stats: BenchStats
    timings: EngineTimings
    k: int = 0
    seconds: float = 0.0
    outputs: list = field(default_factory=list)
    loads: list = field(default_factory=list)  # 1-minute load average after each group
    error: str | None = None

    def report(self, order: list[int]) -> dict:
        if self.error:
            return {"name": self.name, "batch": self.batch, "error": self.error}
        return result(self.name, self.batch, sum(map(len, self.outputs)), self.seconds, self.stats,
                      self.timings if self.timings.rounds else None, framework=self.framework, k=self.k,
                      outputs=self.outputs, prompt_index=order, loadavg_1m=round(sum(self.loads) / len(self.loads), 2))


def engine_config(name, batch, target, tokenizer, proposer, k, eos, max_tokens, adaptive=True) -> Config:
    """Our engine; `adaptive` (the served default): K planned per round from costs measured here, at start, as the
    served replicas measure theirs (engine.calibration.measure.measure_profile), else the fixed max_batch_for_speculation."""
    cfg = EngineConfig()  # as build_engine() does, bar loading: one target module serves every config
    runner = ModelRunner(target, cfg.max_model_len)
    profile = None
    if adaptive and k > 0 and proposer is not None:
        profile = measure_profile(runner, proposer.runner if isinstance(proposer, DraftModelProposer) else None, k)
    engine = SpeculativeEngine(runner, tokenizer, proposer, k, eos,
                               max_batch_for_speculation=cfg.max_batch_for_speculation, profile=profile)
    engine.generate([encode(tokenizer, WARMUP)], SamplingParams(max_tokens=8))
    engine.stats, engine.timings = BenchStats(), EngineTimings()
    params = SamplingParams(max_tokens=max_tokens)
    return Config(name, batch, "ours", lambda group: [c.token_ids for c in engine.generate(group, params)],
                  engine.stats, engine.timings, k)


@contextlib.contextmanager
def hf_spec_counter(stats: BenchStats, timings: EngineTimings):
    """Count HF's drafts and acceptances by wrapping its candidate generators' methods for a while."""
    from transformers.generation import candidate_generator as cg

    drafted = []

    def get_candidates(self, orig, input_ids, *args, **kwargs):
        t0 = time.perf_counter()
        out = orig(self, input_ids, *args, **kwargs)
        timings.draft_seconds += time.perf_counter() - t0
        drafted.append(out[0].shape[1] - input_ids.shape[1])
        return out

    def update_candidate_strategy(self, orig, input_ids, scores, num_matches):
        stats.record(drafted.pop() if drafted else 0, int(num_matches), int(num_matches) + 1)
        timings.rounds += 1
        return orig(self, input_ids, scores, num_matches)

    with contextlib.ExitStack() as stack:
        for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
            for wrapper in (get_candidates, update_candidate_strategy):
                orig = getattr(cls, wrapper.__name__)
                stack.enter_context(mock.patch.object(cls, wrapper.__name__, functools.partialmethod(wrapper, orig)))
        yield


def hf_config(name, model, warmup, max_tokens, eos, **kwargs) -> Config:
    """HF generate() one prompt at a time (assisted generation is batch 1 only)."""
    stats, timings = BenchStats(), EngineTimings()

    def generate(ids, n):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=eos, **kwargs)
        return out[0, x.shape[1]:].tolist()

    def run(group):
        with hf_spec_counter(stats, timings):
            return [generate(ids, max_tokens) for ids in group]

    generate(warmup, 8)
    return Config(name, 1, "hf", run, stats, timings)


def run_interleaved(configs: list[Config], prompts: list[list[int]], bar) -> dict[int, list[int]]:
    """Group by group (a prompt at batch 1, 8 prompts at batch 8), every config in turn, the turn order rotated.

    Others share this machine, so its load changes by the minute; interleaving spreads that over all configs
    alike instead of hitting whichever config runs then. Returns each batch size's prompt order (cycled to fill).
    """
    orders = {}
    for batch in sorted({c.batch for c in configs}):
        members = [c for c in configs if c.batch == batch and not c.error]
        orders[batch] = order = [i % len(prompts) for i in range(-(-len(prompts) // batch) * batch)]
        for g, start in enumerate(range(0, len(order), batch)):
            group = [prompts[i] for i in order[start:start + batch]]
            for c in members[g % len(members):] + members[: g % len(members)]:
                bar.set_postfix_str(f"{c.name} b{batch}")
                if not c.error:
                    try:
                        t0 = time.perf_counter()
                        c.outputs += c.run(group)
                        c.seconds += time.perf_counter() - t0
                    except Exception as exc:  # e.g. HF refusing a setting: report it, go on with the rest
                        c.error = f"{type(exc).__name__}: {exc}"
                    c.loads.append(os.getloadavg()[0])
                bar.update(max(0, min(batch, len(prompts) - start)))
    return orders


def run_vllm(model_dir, prompts_file, max_tokens, k, configs, out_dir, bar) -> list[dict]:
    """bench/vllm_peer.py once per config (each loads its own LLM); its log goes to <out_dir>/vllm.log.

    vLLM keeps its own CPU thread setup: 1 torch thread pinned to core 0, the other core left to its engine
    process. On 2 cores that beat OMP_NUM_THREADS=2 and binding both cores (plain, 3 prompts, one run each:
    20.6 vs 17.2 vs 9.6 tok/s).
    """
    results = []
    with open(out_dir / "vllm.log", "w") as log:
        for name in configs:
            part = out_dir / f"vllm-{name}.json"
            part.unlink(missing_ok=True)
            bar.set_postfix_str(f"vllm/{name}")
            proc = subprocess.run([VLLM_PYTHON, ROOT / "bench" / "vllm_peer.py", "--model-dir", model_dir,
                                   "--prompts", prompts_file, "--max-tokens", str(max_tokens), "--k", str(k),
                                   "--configs", name, "--out", part], stdout=log, stderr=subprocess.STDOUT,
                                  cwd=ROOT)
            peer = json.loads(part.read_text()) if proc.returncode == 0 and part.exists() else None
            c = peer["configs"][0] if peer else {"error": f"exit code {proc.returncode}, see {out_dir}/vllm.log"}
            bar.update(1)
            if "error" in c:
                results.append({"name": f"vllm/{name}", "batch": 1, "error": c["error"]})
                continue
            acc = c.get("acceptance")
            spec = acc and {key: acc.get(key) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                          "acceptance_rate", "mean_acceptance_length")}
            results.append(result(f"vllm/{name}", 1, c["tokens"], c["wall_s"], framework="vllm",
                                  vllm=peer["vllm_version"], speculative_config=c["speculative_config"],
                                  texts=[r["text"] for r in c["per_prompt"]])
                           | {"spec": spec, "loadavg_1m_after": os.getloadavg()[0]})
    return results


def expected_len(a: float, d: int) -> float:
    return d + 1.0 if a >= 1 else (1 - a ** (d + 1)) / (1 - a)


def ideal_speedups(r: dict, plain: dict | None) -> tuple[float, float] | None:
    """(ideal, ideal_literal) per Leviathan et al.; see the module docstring."""
    spec, t, k = r.get("spec"), r.get("timings"), r.get("k", 0)
    if not (spec and t and k and plain and plain["timings"]["rounds"]):
        return None
    t_target = plain["seconds"] / plain["timings"]["rounds"]
    lengths = {int(d): n for d, n in spec["draft_lengths"].items()}
    a = spec["per_token_acceptance"]
    e = sum(n * expected_len(a, d) for d, n in lengths.items()) / sum(lengths.values())
    ideal = e * t_target / ((t["draft_seconds"] + t["verify_seconds"]) / t["rounds"])
    t_draft = t["draft_seconds"] / (spec["num_draft_tokens"] / t["mean_batch"])  # batched rows draft together
    literal = expected_len(spec["acceptance_rate"], k) * t_target / (k * t_draft + t["verify_seconds"] / t["rounds"])
    return ideal, literal


def annotate(runs: list[dict], tokenizer) -> None:
    """Speedup over the same framework's plain run at the same batch, ideal speedups, greedy equality."""
    plain_of = {(r["name"].split("/")[0], r["batch"]): r for r in runs
                if "error" not in r and r["name"].split("/")[1] in ("plain", "generate")}
    reference = plain_of.get(("ours", 1), {}).get("outputs")
    ref_text = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in reference or []]
    for r in (r for r in runs if "error" not in r):
        plain = plain_of.get((r["name"].split("/")[0], r["batch"]))
        r["speedup"] = round(r["tok_per_s"] / plain["tok_per_s"], 3) if plain else None
        ideal, literal = ideal_speedups(r, plain) or (None, None)
        r["ideal_speedup"], r["ideal_literal"] = ideal and round(ideal, 3), literal and round(literal, 3)
        r["measured_over_ideal"] = round(r["speedup"] / ideal, 3) if ideal and r["speedup"] else None
        if reference and "outputs" in r:
            same = [out == reference[i] for out, i in zip(r["outputs"], r["prompt_index"])]
        elif ref_text and "texts" in r:
            same = [a.strip() == b for a, b in zip(r["texts"], ref_text)]
        else:
            continue
        r["greedy_equal"] = [sum(same), len(same)]


def checks(runs: list[dict]) -> list[dict]:
    by = {f"{r['name']}@{r['batch']}": r for r in runs if "error" not in r}
    tps = {key: r["tok_per_s"] for key, r in by.items()}
    ours1, ours8, hf = tps.get("ours/draft@1"), tps.get("ours/draft@8"), tps.get("hf/assisted@1")
    vllm = max((tps[f"vllm/{c}@1"] for c in VLLM_CONFIGS[1:] if f"vllm/{c}@1" in tps), default=None)
    out = []

    def check(name, value, target, passed):
        out.append({"check": name, "value": value, "target": target,
                    "result": "n/a" if value is None else ("PASS" if passed else "FAIL")})

    check("ours/draft b1 tok/s / hf/assisted tok/s", ours1 and hf and round(ours1 / hf, 3), ">= 1.3",
          ours1 and hf and ours1 / hf >= 1.3)
    check("ours/draft b1 tok/s vs best vLLM speculative tok/s", ours1 and vllm and f"{ours1:.1f} vs {vllm:.1f}",
          "above", ours1 and vllm and ours1 > vllm)
    check("ours/draft b8 aggregate tok/s / hf/assisted tok/s", ours8 and hf and round(ours8 / hf, 3), ">= 4",
          ours8 and hf and ours8 / hf >= 4)
    for key in ("ours/draft@1", "ours/ngram@1", "ours/draft@8", "ours/ngram@8"):
        ratio = by.get(key, {}).get("measured_over_ideal")
        check(f"{key} measured / ideal speedup", ratio, ">= 0.9", ratio is not None and ratio >= 0.9)
    return out


def table(runs: list[dict], report: list[dict]) -> str:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{'config':<16}{'batch':>6}{'tokens':>7}{'sec':>7}{'tok/s':>7}{'accept':>7}{'len':>6}{'speedup':>8}"
             f"{'ideal':>7}{'meas/id':>8}{'id.lit':>7}{'greedy==':>9}"]
    lines.append("-" * len(lines[0]))
    for r in runs:
        if "error" in r:
            lines.append(f"{r['name']:<16}{r['batch']:>6}  ERROR {r['error'][:200]}")
            continue
        s, eq = r.get("spec") or {}, r.get("greedy_equal")
        lines.append(f"{r['name']:<16}{r['batch']:>6}{r['tokens']:>7}{r['seconds']:>7.1f}{r['tok_per_s']:>7.1f}"
                     f"{f(s.get('acceptance_rate')):>7}{f(s.get('mean_acceptance_length')):>6}"
                     f"{f(r.get('speedup')):>8}{f(r.get('ideal_speedup')):>7}{f(r.get('measured_over_ideal')):>8}"
                     f"{f(r.get('ideal_literal')):>7}{f'{eq[0]}/{eq[1]}' if eq else '-':>9}")
    lines += ["", "targets:"] + [f"  [{c['result']:>4}] {c['check']}: {c['value']} (target {c['target']})"
                                 for c in report]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    ap.add_argument("--limit", type=int, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=EngineConfig.num_speculative_tokens)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_bench.json"))
    ap.add_argument("--policy", choices=("adaptive", "fixed"), default="adaptive",
                    help="K per round: planned from costs measured at start (the served default), or fixed K up to "
                         "max_batch_for_speculation live sequences (the tables before the planner was shared)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-configs", nargs="+", default=list(VLLM_CONFIGS), choices=VLLM_CONFIGS)
    args = ap.parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    records = [json.loads(ln) for ln in Path(args.prompts).read_text().splitlines() if ln.strip()][: args.limit]
    prompts_file = out.parent / "prompts-used.jsonl"  # what vllm_peer.py reads (--limit applied)
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records))

    cfg, k = EngineConfig(), args.k
    resolved = resolve(cfg.target)
    tokenizer = load_tokenizer(resolved)
    target = load_causal_lm(resolved, cfg.target_dtype)  # our runners switch its Linear kernels in place,
    hf_target = load_causal_lm(resolved, cfg.target_dtype)  # so HF gets its own, stock copy
    draft = load_causal_lm(resolved, cfg.draft_dtype)  # one int8 draft module for HF and for us
    draft.generation_config.num_assistant_tokens = k  # HF reads these from the assistant's own config
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # 0 = no early stop of the draft
    eos = sorted(eos_token_ids(resolved.directory, tokenizer))
    prompts = [encode(tokenizer, r["messages"]) for r in records]
    vocab = target.get_input_embeddings().weight.shape[0]

    warmup = encode(tokenizer, WARMUP)
    proposers = {"ours/plain": (lambda: None, 0),
                 "ours/draft": (lambda: DraftModelProposer(ModelRunner(draft, cfg.max_model_len), vocab), k),
                 "ours/ngram": (lambda: NgramProposer(cfg.ngram_min, cfg.ngram_max), k)}
    hf_kwargs = {} if args.skip_hf else {
        "hf/generate": {}, "hf/assisted": {"assistant_model": draft},
        "hf/lookup": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": cfg.ngram_max}}
    configs = []
    for name, batch in [(n, 1) for n in ("ours/plain", *hf_kwargs, "ours/draft", "ours/ngram")] + [
            (n, BATCH) for n in ("ours/plain", "ours/draft", "ours/ngram")]:
        try:  # load and warm up everything before timing anything
            if name in hf_kwargs:
                configs.append(hf_config(name, hf_target, warmup, args.max_tokens, eos[0], **hf_kwargs[name]))
            else:
                make, kk = proposers[name]
                configs.append(engine_config(name, batch, target, tokenizer, make(), kk, eos, args.max_tokens,
                                             adaptive=args.policy == "adaptive"))
        except Exception as exc:  # e.g. HF refusing the assistant: report why
            configs.append(Config(name, batch, "", None, None, None, error=f"{type(exc).__name__}: {exc}"))
    vllm_configs = [] if args.skip_vllm or not VLLM_PYTHON.exists() else args.vllm_configs
    with tqdm(total=len(prompts) * len(configs) + len(vllm_configs), unit="prompt") as bar:
        orders = run_interleaved(configs, prompts, bar)
        runs = [c.report(orders.get(c.batch, [])) for c in configs]
        if vllm_configs:
            runs += run_vllm(resolved.directory, prompts_file, args.max_tokens, k, vllm_configs, out.parent, bar)
    if not args.skip_vllm and not vllm_configs:
        runs.append({"name": "vllm", "batch": 1, "error": f"no {VLLM_PYTHON}: run bash bench/setup_vllm_venv.sh"})

    annotate(runs, tokenizer)
    report = checks(runs)
    info["loadavg_after"] = os.getloadavg()
    text = table(runs, report)
    out.write_text(json.dumps({"machine": info, "command": "python -m bench.engine_bench " + " ".join(
        sys.argv[1:]), "model": str(resolved.directory), "target_dtype": cfg.target_dtype,
        "draft_dtype": cfg.draft_dtype, "k": k, "policy": args.policy, "max_tokens": args.max_tokens, "batch": BATCH,
        "prompt_ids": [r["id"] for r in records], "configs": runs, "checks": report, "table": text}, indent=1))
    print(text)
    print(f"\nloadavg before {info['loadavg_before']} after {info['loadavg_after']}; wrote {out}")


if __name__ == "__main__":
    main()
