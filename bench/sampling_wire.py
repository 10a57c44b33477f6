"""Bytes on the wire per row per round, and the router's CPU time per round, for sampled speculative rounds
(issue 18: sampling at the target). Not a timed test.

One chained round (router -> draft worker -> target worker rank 0 -> router) is driven by hand through the real
worker cores (deployments/workers/draft.py, no Ray, no sockets): every message is pickled as the channel pickles it
(protocol 5), so the byte counts are the channel's payloads. The router's CPU per round is its own work around the
workers' calls: pickling its calls, unpickling the replies, and accepting and committing each row (thread CPU time,
so the workers' compute, which runs in this thread too, is not counted). Rows without stop strings have their text
decoded by their requests' consumers, not in the round loop; that is reported apart (`consumer_text_cpu_ms_per_round`).

`--impl after` measures this tree; `--impl before --code DIR` measures the tree in DIR (e.g. `git archive 545b6bc`),
where the target sent [K+1, V] and the draft [K, V] float32 probabilities of every sampled row to the router, which
ran the rejection sampler. Both run the same models: a tiny random-weight Llama (2 layers, hidden 64) with a 128,256
token vocabulary, and a perturbed copy as the draft, sampled at temperature 1 with K = 3.

    python -m bench.sampling_wire --out bench/plots/sampling_wire.json           # before (in a subprocess) + after
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 128_256
K = 3
BATCHES = (1, 8, 32)
ROUNDS = 8  # measured rounds per batch size (after one prefill round)
PROMPT_LEN = 8


def _size(obj) -> int:
    return len(pickle.dumps(obj, protocol=5))


def _models(root: Path):
    import torch

    from tests.conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

    target = make_tiny_model("llama", vocab=VOCAB, seed=0)
    draft = perturbed_copy(target, 0.02)
    tokenizer = make_tiny_tokenizer(VOCAB)
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config.eos_token_id = 1
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)
    torch.set_num_threads(2)
    return root / "target", root / "draft", tokenizer


class _Relay:
    def send(self, route, method, *args) -> None:
        self.sent = (method, args)


def measure(impl: str, seeded: bool) -> list[dict]:
    import engine

    print(f"{impl}: engine from {engine.__file__}", file=sys.stderr)
    from deployments.transport import messages
    from deployments.workers.draft import DraftWorkerCore
    from deployments.workers.target import TargetWorkerCore
    from engine.factory import EngineConfig
    from engine.request.sampling import SamplingParams
    from engine.request.sequence import SequenceState
    from engine.spec.stats import SpecStats

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir, tokenizer = _models(Path(tmp))
        config = EngineConfig(target=str(target_dir), draft=str(draft_dir), draft_dtype="float32",
                              num_speculative_tokens=K, max_model_len=256, kv_cache_gib=0.2, max_num_seqs=40,
                              runner="auto", compile=False)
        draft, target = DraftWorkerCore(config, torch_threads=2), TargetWorkerCore(config, torch_threads=2)
        relay = _Relay()
        draft._relay = relay
        results = []
        for batch in BATCHES:
            params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=7 if seeded else None)
            seqs = [SequenceState.create(f"b{batch}-r{i}", [2 + (i + j) % 50 for j in range(PROMPT_LEN)], params, K,
                                         256, frozenset(), tokenizer) for i in range(batch)]
            sent_draft, sent_target = [0] * batch, [0] * batch
            stats = SpecStats()
            totals = {"router_to_draft": 0, "draft_to_target": 0, "draft_to_router": 0, "router_to_target": 0,
                      "target_to_router": 0}
            cpu, commit_cpu, text_cpu = [], [], []
            for round_no in range(ROUNDS + 1):
                c0 = time.thread_time()
                delta = _delta_factory(impl, messages)
                draft_calls = [messages.DraftCall(delta(s, sent_draft[i]), K).wire() for i, s in enumerate(seqs)]
                verify_calls = [messages.VerifyCall(delta(s, sent_target[i]), []).wire() for i, s in enumerate(seqs)]
                members = list(range(batch))
                router_out = (_size(draft_calls), _size(verify_calls))
                cpu_calls = time.thread_time() - c0
                if impl == "before":
                    first = draft.propose_chained(draft_calls, verify_calls, members, True, ("t", 1))
                else:
                    first = draft.propose_chained(draft_calls, verify_calls, members, ("t", 1))
                method, args = relay.sent
                relayed = _size(args)
                reply = getattr(target, method)(*args)
                reply_bytes = pickle.dumps(reply, protocol=5)
                first_bytes = None if first is None else pickle.dumps(first, protocol=5)
                c1 = time.thread_time()
                outs, cpu_commit = _accept_and_commit(impl, messages, seqs, reply_bytes, first_bytes, stats)
                cpu_accept = time.thread_time() - c1
                c2 = time.thread_time()  # the requests' consumers read the texts, between rounds (engine/request/stopping.py)
                for out in outs:
                    out.new_text  # noqa: B018 (decoded on first read)
                cpu_text = time.thread_time() - c2
                for i, s in enumerate(seqs):
                    sent_draft[i] = sent_target[i] = s.num_tokens - len(outs[i].new_token_ids)
                if round_no == 0:
                    continue  # the prefill round
                cpu.append(cpu_calls + cpu_accept)
                commit_cpu.append(cpu_commit)
                text_cpu.append(cpu_text)
                totals["router_to_draft"] += router_out[0]
                totals["router_to_target"] += router_out[1]
                totals["draft_to_target"] += relayed
                totals["draft_to_router"] += 0 if first_bytes is None else len(first_bytes)
                totals["target_to_router"] += len(reply_bytes)
            draft.release([s.request_id for s in seqs])
            target.release([s.request_id for s in seqs])
            per_row = {name: round(v / ROUNDS / batch) for name, v in totals.items()}
            results.append({"impl": impl, "scheme": ("gumbel" if seeded else "rejection") if impl == "after"
                            else "rejection", "batch": batch, "k": K, "vocab": VOCAB,
                            "bytes_per_row_per_round": per_row,
                            "router_cpu_ms_per_round": round(1e3 * statistics.median(cpu), 3),
                            "router_cpu_ms_per_round_mean": round(1e3 * statistics.mean(cpu), 3),
                            # of which committing the tokens (detokenizing, stop strings): the same work before
                            # and after, not sampling
                            "router_commit_cpu_ms_per_round": round(1e3 * statistics.median(commit_cpu), 3),
                            # the rows' text, decoded by each request's consumer after the round loop handed the
                            # round on (without stop strings; trees before 2026-11-24 decoded it in the commit)
                            "consumer_text_cpu_ms_per_round": round(1e3 * statistics.median(text_cpu), 3),
                            "acceptance_rate": round(stats.acceptance_rate, 3)})
            print(json.dumps(results[-1]), flush=True)
        return results


def _delta_factory(impl, messages):
    """A SeqDelta for `seq` from `start`, in the tree's own spelling (this tree sends the settings once, with a
    sequence's first delta: engine/request/delta.seq_delta)."""
    def delta(seq, start):
        p = seq.params
        if impl == "before":
            return messages.SeqDelta(seq.request_id, start, seq.tokens[start:], p.temperature, p.top_k, p.top_p,
                                     p.seed)
        from engine.request.delta import seq_delta

        return seq_delta(seq, start)
    return delta


def _accept_and_commit(impl, messages, seqs, reply_bytes, first_bytes, stats):
    """The router's side of a round after the replies arrive: what deployments/router/round.py does."""
    from engine.spec.accept import commit

    result = messages.VerifyResult.from_wire(pickle.loads(reply_bytes))
    if impl == "after":
        drafts = result.draft.drafts
        c0 = time.thread_time()
        outs = [commit(s, len(drafts[b]), result.verdicts[b], stats) for b, s in enumerate(seqs)]
        return outs, time.thread_time() - c0
    import torch

    from engine.spec.accept import TargetScores, accept

    draft = messages.DraftResult.from_wire(pickle.loads(first_bytes))
    scores = TargetScores(result.argmax, {b: torch.from_numpy(p) for b, p in result.probs.items()})
    draft_probs = {b: torch.from_numpy(p) for b, p in draft.probs.items()}
    verdicts = accept(draft.drafts, scores, draft_probs, [s.generator for s in seqs])
    c0 = time.thread_time()
    outs = [commit(s, len(draft.drafts[b]), verdicts[b], stats) for b, s in enumerate(seqs)]
    return outs, time.thread_time() - c0


def acceptance(prompts: int, max_tokens: int) -> list[dict]:
    """Acceptance of the two schemes on the default pair (SmolLM2-135M-Instruct, its int8 self-draft), in process:
    the same chat prompts at temperature 1, K = 3, with a seed each (Gumbel coupling) and without (rejection)."""
    from engine.cli import encode_prompt
    from engine.factory import EngineConfig, build_engine
    from engine.request.sampling import SamplingParams

    engine = build_engine(EngineConfig(num_speculative_tokens=K, max_batch_for_speculation=64))
    root = Path(__file__).resolve().parent
    chats = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines() if line.strip()]
    ids = [encode_prompt(engine.tokenizer, c["messages"][-1]["content"], True)
           for c in chats if c.get("kind") == "chat"][:prompts]
    out = []
    top_n = engine.proposer.top_n
    for scheme in ("rejection", "rejection-full-proposal", "gumbel"):
        # the full-proposal variant ships the whole distribution (what the router got before): truncation's cost
        engine.proposer.top_n = engine.proposer.target_vocab_size if scheme.endswith("full-proposal") else top_n
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                 seed=1000 + i if scheme == "gumbel" else None) for i in range(len(ids))]
        engine.stats = type(engine.stats)()
        start = time.perf_counter()
        engine.generate(ids, params, k=K)
        st = engine.stats
        out.append({"scheme": scheme, "pair": "SmolLM2-135M-Instruct fp32 / int8 self-draft", "k": K,
                    "prompts": len(ids), "max_tokens": max_tokens, "acceptance_rate": round(st.acceptance_rate, 3),
                    "mean_acceptance_length": round(st.num_emitted_tokens / max(st.rounds, 1), 3),
                    "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["after", "before", "both"], default="both")
    parser.add_argument("--acceptance", type=int, default=0, metavar="PROMPTS",
                        help="instead: the two schemes' acceptance on the default SmolLM2 pair over PROMPTS prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--code", default="/tmp/specserve-545b6bc", help="the 'before' tree (git archive 545b6bc)")
    parser.add_argument("--out", default=None, help="JSON file for the results (with --impl both)")
    args = parser.parse_args()
    if args.acceptance:
        text = json.dumps({"machine": _machine(), "results": acceptance(args.acceptance, args.max_tokens)}, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
    if args.impl == "before":
        sys.path.insert(0, args.code)
        sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this tree's tests/ helpers stay importable
        print(json.dumps(measure("before", False)))
        return
    if args.impl == "after":
        print(json.dumps(measure("after", False) + measure("after", True)))
        return
    results = []
    for impl in ("before", "after"):  # each in its own interpreter: the two trees' modules share names
        out = subprocess.run([sys.executable, "-m", "bench.sampling_wire", "--impl", impl, "--code", args.code],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
                             env={**__import__("os").environ, "PYTHONPATH": args.code if impl == "before" else ""})
        results += json.loads(out.stdout.strip().splitlines()[-1])
    text = json.dumps({"machine": _machine(), "results": results}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _machine() -> str:
    import os
    import platform

    import torch

    return f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
