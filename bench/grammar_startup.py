"""Where the grammar tokenizer table is built: the first constrained round's stall, and the workers' start-up.

    python -m bench.grammar_startup [--repeats 3] [--out bench/plots/grammar_startup.json]

The worker cores of deployments/workers/draft.py in-process (no Ray), on the default model (SmolLM2-135M-Instruct fp32
target, its int8 copy as the draft, eager static runner). Measured: each core's start-up (load, grammar table,
warm-up), then verify calls of a batch where a decoding row is joined by a new row: a plain one (the control), the
worker's first row with a grammar (where a lazily built table stalls the round for every row), a second grammar.
The same for the draft's first call of a row. Reported: each call's own compute (the worker's `seconds`), median of
`--repeats` control joins. Waits while /tmp/QUIET exists.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from deployments.transport.messages import DraftCall, VerifyCall
from engine.request.delta import SeqDelta, first_delta
from engine.request.sampling import SamplingParams
from deployments.workers.draft import DraftWorkerCore
from deployments.workers.target import TargetWorkerCore
from engine.factory import EngineConfig
from engine.models.loading import load_tokenizer, resolve
from engine.request.grammar import GrammarSpec

QUIET = Path("/tmp/QUIET")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def delta(seq_id: str, start: int, tokens: list[int], spec: GrammarSpec | None = None) -> SeqDelta:
    """A sequence's first delta (start 0: its settings, the grammar in them) or a continuation (tokens only)."""
    if start:
        return SeqDelta(seq_id, start, tokens)
    return first_delta(seq_id, tokens, SamplingParams(grammar=spec), 7)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    while QUIET.exists():
        time.sleep(5)
    config = EngineConfig(kv_cache_gib=0.25)
    tokenizer = load_tokenizer(resolve(config.target))
    prompt = tokenizer("Describe a person as JSON with the keys name and age.")["input_ids"]
    result: dict = {}
    start = time.perf_counter()
    target = TargetWorkerCore(config)
    result["target_startup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    draft = DraftWorkerCore(config)
    result["draft_startup_s"] = time.perf_counter() - start

    # a decoding row A, one token a round; new rows join it
    held = list(prompt)
    reply = target.verify([VerifyCall(delta("A", 0, held), []).wire()])
    sent = len(held)
    joins = iter(range(1000))

    def join(spec: GrammarSpec | None) -> float:
        nonlocal held, sent, reply
        held = held + reply[0][0][0]
        new = f"J{next(joins)}"
        reply = target.verify([VerifyCall(delta("A", sent, held[sent:]), []).wire(),
                               VerifyCall(delta(new, 0, list(prompt), spec), []).wire()])
        sent = len(held)
        target.release([new])
        return reply[1]  # the worker's own compute

    plain = [join(None) for _ in range(args.repeats)]
    result["target_join_plain_s"] = statistics.median(plain)
    result["target_join_first_grammar_s"] = join(GrammarSpec.json_schema(PERSON))
    result["target_join_second_grammar_s"] = join(GrammarSpec.json_schema(CITY))

    def first_draft(seq_id: str, spec: GrammarSpec | None) -> float:
        out = draft.propose([DraftCall(delta(seq_id, 0, list(prompt), spec), 3).wire()])
        draft.release([seq_id])
        return out[2]

    result["draft_first_call_plain_s"] = statistics.median(first_draft(f"P{i}", None) for i in range(args.repeats))
    result["draft_first_call_first_grammar_s"] = first_draft("G1", GrammarSpec.json_schema(PERSON))
    result["draft_first_call_second_grammar_s"] = first_draft("G2", GrammarSpec.json_schema(CITY))
    result["target_grammar_stats"] = target.stats()["grammar"]
    result["draft_grammar_stats"] = draft.stats()["grammar"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
