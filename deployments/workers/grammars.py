"""Structured outputs in the model workers (deployments/workers/draft.py): the grammar compiler's start-up, and the
typed per-row failure (messages.RowFailure) of a request whose grammar fails on a worker.

The honesty rule: a grammar that cannot be compiled on a worker (after the router compiled it before admission: a
tokenizer that differs, or none that llguidance can read) or whose matcher breaks mid-request fails that request
alone with a clear error; its row never runs unconstrained, and the other rows of its call go on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deployments.transport.messages import RowFailure
from engine.request.grammar import GrammarError, SequenceGrammars

log = logging.getLogger(__name__)


def prepare_grammars(grammars: SequenceGrammars | None, worker: str) -> None:
    """Build the grammar compiler's tokenizer table at start-up (engine/request/grammar.GrammarCompiler.prepare), not in
    the first constrained round, which it would stall for every row of the batch (bench/RESULTS.md). A
    tokenizer llguidance cannot read (or no llguidance) leaves the worker serving: the error is kept, and every
    request with a grammar fails with it (grammar_failure), never unconstrained."""
    if grammars is None:
        return
    try:
        grammars.compiler.prepare()
    except GrammarError as exc:
        log.error("structured outputs are unavailable on this %s worker: %s", worker, exc)
        return
    log.info("%s worker: grammar tokenizer table built in %.2f s", worker, grammars.compiler.stats.tokenizer_seconds)


def grammar_failure(worker: str, seq_id: str, exc: GrammarError) -> RowFailure:
    """The RowFailure of a sequence whose grammar failed on this worker (logged)."""
    log.error("structured outputs failed for %s on the %s worker: %s", seq_id, worker, exc)
    return RowFailure("structured_outputs_failed", f"structured outputs failed on the {worker} worker: {exc}; the "
                                                   "request was stopped rather than continue unconstrained")


def failed_grammars(grammars: SequenceGrammars | None, seq_ids: Sequence[str], worker: str) -> dict[int, RowFailure]:
    """The failures of the sequences (by index in `seq_ids`) whose grammar failed here, now or before
    (SequenceGrammars remembers it until the sequence is released)."""
    failed = {}
    for i, seq_id in enumerate(seq_ids):
        try:
            if grammars is not None:
                grammars.check(seq_id)
        except GrammarError as exc:
            failed[i] = grammar_failure(worker, seq_id, exc)
    return failed
