"""Engine benchmark: our speculative engine vs HF transformers and vLLM, same prompts, same machine, one run.

    python -m bench.engine_bench [--limit N] [--max-tokens 64] [--k K] [--skip-hf] [--skip-vllm]

Target: SmolLM2-135M-Instruct in fp32. Draft: the same weights, int8 weight-only (the engine's default draft).
Every prompt of bench/prompts.jsonl (chat, summarization, code) goes through the chat template; decoding is
greedy with at most --max-tokens new tokens (EOS stops early). Configs, in order:

* ours/plain      our engine with K = 0, at batch 1 and batch 8 (the baselines for our speculative configs)
* hf/generate     HF `generate()` on the target, one prompt at a time
* hf/assisted     HF assisted generation, `assistant_model=` the same int8 draft, K tokens a round, constant
* hf/lookup       HF prompt lookup, `prompt_lookup_num_tokens=K`, `max_matching_ngram_size=4`
* ours/draft      our engine with the int8 draft, batch 1 (prompts one by one) and batch 8 (8 sequences at once)
* ours/ngram      our engine with n-gram lookup (n = 2..4), batch 1 and batch 8
* vllm/*          bench/vllm_peer.py in bench/.vllm-venv: plain, ngram, self_draft (fp32 model as its own draft)

Per config: generated tokens, wall seconds (prefill included, warm-up excluded), tokens/s, acceptance rate
(accepted / drafted tokens, vLLM's definition), mean acceptance length (1 + accepted / rounds that drafted),
speedup over plain decoding of the same framework at the same batch size, and for our configs the ideal speedup
of Leviathan et al. (arXiv 2211.17192), ideal = E * T_target / (K * T_draft + T_verify):
T_target = the plain run's seconds per round (= per token at batch 1); K * T_draft and T_verify = the engine's
measured draft and verify seconds per round; E = (1 - a^(d+1)) / (1 - a) averaged over the rounds' draft lengths
d (d = K for a draft model; n-gram lookup often finds fewer or none, then E = 1), where a is the per-token
acceptance probability the formula assumes, estimated as accepted / (accepted + rejections). (accepted / drafted
counts positions after a rejection, never tested, as failures; `ideal_literal` in the JSON plugs it in with
d = K and T_draft = draft seconds per drafted token, which predicts less.) Greedy outputs of every config are
compared with our plain batch-1 token ids (vLLM: decoded text). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.factory import EngineConfig
from engine.loading import load_causal_lm, load_tokenizer, resolve
from engine.model_runner import ModelRunner
from engine.proposers import DraftModelProposer, NgramProposer
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine
from engine.stats import EngineTimings, SpecStats

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "bench" / ".vllm-venv" / "bin" / "python"
VLLM_CONFIGS = ("plain", "ngram", "self_draft")
WARMUP = [{"role": "user", "content": "Say hello in one short sentence."}]
BATCH = 8


def encode(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    import transformers
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "avx2": " avx2" in flags, "avx512f": " avx512f" in flags, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "python": platform.python_version(), "loadavg_before": os.getloadavg()}


def result(name, batch, tokens, seconds, stats=None, timings=None, outputs=None, **extra) -> dict:
    return {"name": name, "batch": batch, "tokens": tokens, "seconds": round(seconds, 3),
            "tok_per_s": round(tokens / seconds, 2) if seconds else None,
            "spec": stats.as_dict() if stats and stats.num_drafts else None,
            "timings": vars(timings) | {"mean_batch": timings.mean_batch} if timings else None,
            "outputs": outputs, **extra}


def run_engine(name, target, tokenizer, proposer, k, eos, prompts, batch, max_tokens, bar) -> dict:
    """Batch 1: one generate() per prompt. Batch 8: generate() over 8 prompts at once (cycled to fill)."""
    engine = SpeculativeEngine(ModelRunner(target, EngineConfig.max_model_len), tokenizer, proposer, k, eos)
    engine.generate([encode(tokenizer, WARMUP)], SamplingParams(max_tokens=8))
    engine.stats, engine.timings = SpecStats(), EngineTimings()
    params = SamplingParams(max_tokens=max_tokens)
    n = -(-len(prompts) // batch) * batch
    order = [i % len(prompts) for i in range(n)]
    outputs, seconds = [], 0.0
    for start in range(0, n, batch):
        chunk = order[start:start + batch]
        t0 = time.perf_counter()
        done = engine.generate([prompts[i] for i in chunk], params)
        seconds += time.perf_counter() - t0
        outputs += [c.token_ids for c in done]
        bar.update(min(len(chunk), len(prompts) - start) if start < len(prompts) else 0)
    return result(name, batch, sum(map(len, outputs)), seconds, engine.stats, engine.timings, outputs,
                  framework="ours", k=k, prompt_index=order)


@contextlib.contextmanager
def hf_spec_counter(stats: SpecStats, timings: EngineTimings):
    """Count HF's drafts and acceptances by wrapping its candidate generators (restored afterwards)."""
    from transformers.generation import candidate_generator as cg

    classes = (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator)
    saved = [(c, c.__dict__.get("get_candidates"), c.__dict__.get("update_candidate_strategy")) for c in classes]
    last = {}

    def wrap_get(orig):
        def get_candidates(self, input_ids, *a, **kw):
            t0 = time.perf_counter()
            out = orig(self, input_ids, *a, **kw)
            timings.draft_seconds += time.perf_counter() - t0
            last["drafted"] = out[0].shape[1] - input_ids.shape[1]
            return out
        return get_candidates

    def wrap_update(orig):
        def update_candidate_strategy(self, input_ids, scores, num_matches):
            stats.record(last.pop("drafted", 0), int(num_matches), int(num_matches) + 1)
            timings.rounds += 1
            return orig(self, input_ids, scores, num_matches)
        return update_candidate_strategy

    for cls in classes:
        cls.get_candidates = wrap_get(cls.get_candidates)
        cls.update_candidate_strategy = wrap_update(cls.update_candidate_strategy)
    try:
        yield
    finally:
        for cls, get, update in saved:
            for attr, orig in (("get_candidates", get), ("update_candidate_strategy", update)):
                if orig is None:
                    delattr(cls, attr)
                else:
                    setattr(cls, attr, orig)


def run_hf(name, model, prompts, max_tokens, eos, bar, **kwargs) -> dict:
    stats, timings = SpecStats(), EngineTimings()

    def generate(ids, n):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=eos, **kwargs)
        return out[0, x.shape[1]:].tolist()

    outputs, seconds = [], 0.0
    try:
        generate(prompts[0][:16], 8)  # warm-up
        with hf_spec_counter(stats, timings):
            for ids in prompts:
                t0 = time.perf_counter()
                outputs.append(generate(ids, max_tokens))
                seconds += time.perf_counter() - t0
                bar.update(1)
    except Exception as exc:  # report why HF refused, keep benchmarking the rest
        return {"name": name, "batch": 1, "error": f"{type(exc).__name__}: {exc}"}
    return result(name, 1, sum(map(len, outputs)), seconds, stats, timings if timings.rounds else None,
                  outputs, framework="hf", prompt_index=list(range(len(prompts))))


def run_vllm(model_dir, prompts_file, max_tokens, k, configs, out_dir, bar) -> list[dict]:
    """bench/vllm_peer.py once per config (a fresh process each); its log goes to <out_dir>/vllm.log."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    results = []
    with open(out_dir / "vllm.log", "w") as log:
        for name in configs:
            part = out_dir / f"vllm-{name}.json"
            cmd = [str(VLLM_PYTHON), str(ROOT / "bench" / "vllm_peer.py"), "--model-dir", str(model_dir),
                   "--prompts", str(prompts_file), "--max-tokens", str(max_tokens), "--k", str(k),
                   "--configs", name, "--out", str(part)]
            bar.set_postfix_str(f"vllm {name}")
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            peer = json.loads(part.read_text()) if proc.returncode == 0 and part.exists() else None
            c = peer["configs"][0] if peer else {"error": f"exit code {proc.returncode}, see vllm.log"}
            if "error" in c:
                results.append({"name": f"vllm/{name}", "batch": 1, "error": c["error"]})
            else:
                acc = c.get("acceptance") or {}
                spec = {key: acc.get(key) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                      "acceptance_rate", "mean_acceptance_length")}
                results.append(result(f"vllm/{name}", 1, c["tokens"], c["wall_s"], framework="vllm",
                                      texts=[r["text"] for r in c["per_prompt"]], vllm=peer["vllm_version"],
                                      speculative_config=c["speculative_config"], omp_threads=env["OMP_NUM_THREADS"])
                               | {"spec": spec if acc else None})
            bar.update(1)
    return results


def ideal_speedup(r: dict, plain: dict) -> float | None:
    """Leviathan et al.: E * T_target / (K * T_draft + T_verify), a = measured acceptance rate."""
    spec, t, k = r.get("spec"), r.get("timings"), r.get("k", 0)
    if not spec or not t or not k or not plain or not plain["timings"]["rounds"]:
        return None
    a = spec["acceptance_rate"]
    expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    t_target = plain["seconds"] / plain["timings"]["rounds"]
    draft_steps = spec["num_draft_tokens"] / t["mean_batch"]  # batched rows draft together
    t_draft = t["draft_seconds"] / draft_steps
    t_verify = t["verify_seconds"] / t["rounds"]
    return expected * t_target / (k * t_draft + t_verify)


def annotate(runs: list[dict], tokenizer, reference: list[list[int]] | None) -> None:
    """Speedup over the same framework's plain run at the same batch, ideal speedup, greedy equality."""
    plain_of = {(r["name"].split("/")[0], r["batch"]): r for r in runs
                if "error" not in r and r["name"].split("/")[1] in ("plain", "generate")}
    ref_text = [tokenizer.decode(t, skip_special_tokens=True) for t in reference] if reference else None
    for r in runs:
        if "error" in r:
            continue
        plain = plain_of.get((r["name"].split("/")[0], r["batch"]))
        r["speedup"] = round(r["tok_per_s"] / plain["tok_per_s"], 3) if plain else None
        ideal = ideal_speedup(r, plain)
        r["ideal_speedup"] = round(ideal, 3) if ideal else None
        r["measured_over_ideal"] = round(r["speedup"] / ideal, 3) if ideal and r["speedup"] else None
        if reference and r.get("outputs") is not None:
            same = [out == reference[i] for out, i in zip(r["outputs"], r["prompt_index"])]
        elif ref_text and r.get("texts") is not None:
            same = [a.strip() == b.strip() for a, b in zip(r["texts"], ref_text)]
        else:
            continue
        r["greedy_equal"] = [sum(same), len(same)]


def checks(runs: list[dict]) -> list[dict]:
    by = {r["name"] + f"@{r['batch']}": r for r in runs if "error" not in r}
    tps = lambda key: by[key]["tok_per_s"] if key in by else None  # noqa: E731
    ours1, ours8, hf = tps("ours/draft@1"), tps("ours/draft@8"), tps("hf/assisted@1")
    vllm = max((tps(f"vllm/{c}@1") for c in VLLM_CONFIGS[1:] if tps(f"vllm/{c}@1")), default=None)
    out = []

    def check(name, value, target, passed):
        out.append({"check": name, "value": value, "target": target,
                    "result": "n/a" if value is None else ("PASS" if passed else "FAIL")})

    check("ours/draft b1 tok/s / hf/assisted tok/s", ours1 and hf and round(ours1 / hf, 3), ">= 1.3",
          ours1 and hf and ours1 / hf >= 1.3)
    check("ours/draft b1 tok/s vs best vLLM spec tok/s", ours1 and vllm and f"{ours1:.1f} vs {vllm:.1f}",
          "above", ours1 and vllm and ours1 > vllm)
    check("ours/draft b8 aggregate tok/s / hf/assisted tok/s", ours8 and hf and round(ours8 / hf, 3), ">= 4",
          ours8 and hf and ours8 / hf >= 4)
    for key in ("ours/draft@1", "ours/ngram@1", "ours/draft@8", "ours/ngram@8"):
        ratio = by.get(key, {}).get("measured_over_ideal")
        check(f"{key} measured / ideal speedup", ratio, ">= 0.9", ratio is not None and ratio >= 0.9)
    return out


def table(runs: list[dict], report: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    head = (f"{'config':<18}{'batch':>5}{'tokens':>7}{'sec':>8}{'tok/s':>8}{'accept':>7}{'len':>6}"
            f"{'speedup':>8}{'ideal':>7}{'meas/id':>8}{'greedy==':>9}")
    lines = [head, "-" * len(head)]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['name']:<18}{r['batch']:>5}  ERROR {r['error'][:160]}")
            continue
        spec = r.get("spec") or {}
        eq = r.get("greedy_equal")
        lines.append(f"{r['name']:<18}{r['batch']:>5}{r['tokens']:>7}{r['seconds']:>8.1f}{r['tok_per_s']:>8.1f}"
                     f"{fmt(spec.get('acceptance_rate'), '.2f'):>7}{fmt(spec.get('mean_acceptance_length'), '.2f'):>6}"
                     f"{fmt(r.get('speedup'), '.2f'):>8}{fmt(r.get('ideal_speedup'), '.2f'):>7}"
                     f"{fmt(r.get('measured_over_ideal'), '.2f'):>8}{f'{eq[0]}/{eq[1]}' if eq else '-':>9}")
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
    prompts_file = out.parent / "prompts-used.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records))

    cfg = EngineConfig()
    resolved = resolve(cfg.target)
    tokenizer = load_tokenizer(resolved)
    target = load_causal_lm(resolved, cfg.target_dtype)  # our runners switch its Linear kernels in place
    hf_target = load_causal_lm(resolved, cfg.target_dtype)  # so HF gets its own, untouched copy
    draft = load_causal_lm(resolved, cfg.draft_dtype)
    draft.generation_config.num_assistant_tokens = args.k  # HF reads these from the assistant's config
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    eos_cfg = target.generation_config.eos_token_id
    eos = [eos_cfg] if isinstance(eos_cfg, int) else list(eos_cfg or [])
    prompts = [encode(tokenizer, r["messages"]) for r in records]
    vocab = target.get_input_embeddings().weight.shape[0]
    n, k = len(prompts), args.k

    def draft_proposer():
        return DraftModelProposer(ModelRunner(draft, cfg.max_model_len), vocab)

    def ngram_proposer():
        return NgramProposer(cfg.ngram_min, cfg.ngram_max)

    plan = [("ours/plain", lambda b: run_engine("ours/plain", target, tokenizer, None, 0, eos, prompts, b,
                                                args.max_tokens, bar), (1, BATCH))]
    if not args.skip_hf:
        plan += [(name, lambda b, name=name, kw=kw: run_hf(name, hf_target, prompts, args.max_tokens, eos[0], bar,
                                                           **kw), (1,))
                 for name, kw in (("hf/generate", {}), ("hf/assisted", {"assistant_model": draft}),
                                  ("hf/lookup", {"prompt_lookup_num_tokens": k,
                                                 "max_matching_ngram_size": cfg.ngram_max}))]
    for name, make in (("ours/draft", draft_proposer), ("ours/ngram", ngram_proposer)):
        plan.append((name, lambda b, name=name, make=make: run_engine(name, target, tokenizer, make(), k, eos,
                                                                      prompts, b, args.max_tokens, bar), (1, BATCH)))
    vllm_configs = [] if args.skip_vllm or not VLLM_PYTHON.exists() else args.vllm_configs
    runs = []
    with tqdm(total=n * sum(len(b) for *_, b in plan) + len(vllm_configs), unit="prompt") as bar:
        for name, fn, batches in plan:
            for b in batches:
                bar.set_postfix_str(f"{name} b{b}")
                runs.append(fn(b))
        if vllm_configs:
            runs += run_vllm(resolved.directory, prompts_file, args.max_tokens, k, vllm_configs, out.parent, bar)
    if not vllm_configs and not args.skip_vllm:
        runs.append({"name": "vllm", "batch": 1, "error": f"{VLLM_PYTHON} missing: bash bench/setup_vllm_venv.sh"})

    reference = next((r["outputs"] for r in runs if r["name"] == "ours/plain" and r["batch"] == 1), None)
    annotate(runs, tokenizer, reference)
    report = checks(runs)
    info["loadavg_after"] = os.getloadavg()
    text = table(runs, report)
    doc = {"machine": info, "model": str(resolved.directory), "target_dtype": cfg.target_dtype,
           "draft_dtype": cfg.draft_dtype, "k": k, "max_tokens": args.max_tokens, "prompts": n,
           "prompt_ids": [r["id"] for r in records], "batch": BATCH, "configs": runs, "checks": report,
           "table": text}
    out.write_text(json.dumps(doc, indent=1))
    print(text)
    print(f"\nloadavg before {info['loadavg_before']} after {info['loadavg_after']}; wrote {out}")


if __name__ == "__main__":
    main()
