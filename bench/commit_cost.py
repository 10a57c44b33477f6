"""The router's cost of committing a round (engine/spec/accept.commit: EOS and length cuts, detokenizing, stop strings,
statistics) as a sequence's output grows: thread CPU time per round for a batch of rows, each taking 4 tokens a
round, with SmolLM2's tokenizer (byte-level BPE, 49k tokens) and random token ids. Not a timed test.

    python -m bench.commit_cost [--batch 32] [--lengths 20 200 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine.models.loading import load_tokenizer, resolve
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState
from engine.spec.accept import Verdict, commit
from engine.spec.stats import SpecStats

TOKENS_PER_ROUND = 4  # K = 3 drafts, all accepted, and the bonus token


def measure(tokenizer, batch: int, prior: int, stop: tuple[str, ...], rounds: int = 30) -> float:
    """Median ms of CPU per round committing `batch` rows that already hold `prior` output tokens."""
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=prior + TOKENS_PER_ROUND * (rounds + 1), ignore_eos=True,
                            stop=stop)
    seqs = [SequenceState.create(f"r{i}", [5, 6, 7], params, 3, 1 << 16, frozenset(), tokenizer)
            for i in range(batch)]

    def verdict() -> Verdict:
        return Verdict([rng.randrange(200, 40000) for _ in range(TOKENS_PER_ROUND)], TOKENS_PER_ROUND - 1)

    for seq in seqs:
        for _ in range(prior // TOKENS_PER_ROUND):
            commit(seq, 3, verdict(), SpecStats())
    stats, times = SpecStats(), []
    for _ in range(rounds):
        verdicts = [verdict() for _ in seqs]
        t0 = time.thread_time()
        for seq, v in zip(seqs, verdicts):
            commit(seq, 3, v, stats)
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 200, 1000])
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve("smollm2"), False)
    for prior in args.lengths:
        for stop in ((), ("\n\n", "User:")):
            print(json.dumps({"batch": args.batch, "output_tokens": prior, "stop_strings": len(stop),
                              "commit_cpu_ms_per_round": round(measure(tokenizer, args.batch, prior, stop), 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
