"""The seam (engine/request/logits_processing.py) with a processor of its own, as structured outputs will plug in: a
per-row callable sees each scored position's history (committed tokens, then the drafts before it), after the
built-ins of its row, and rows are processed in their own order."""

import torch

from engine.request.settings import SequenceSettings
from engine.request.logits_processing import RowContext, RowProcessing, process_logits
from engine.request.sampling import SamplingParams

VOCAB = 12


class NoImmediateRepeat:
    """A toy stateful-looking processor: bans, at each position, the token right before it."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []  # the histories it was shown, per position

    def __call__(self, logits: torch.Tensor, context: RowContext) -> torch.Tensor:  # [T, V]
        for t in range(logits.shape[0]):
            history = context.history(t)
            self.seen.append(history)
            logits[t, history[-1]] = float("-inf")
        return logits


def test_a_custom_processor_sees_each_positions_history_after_the_builtins():
    bias = SequenceSettings.of(SamplingParams(logit_bias=((4, 50.0),)), 0, 2).processors()
    custom = NoImmediateRepeat()
    row = RowProcessing(bias + (custom,), [3, 5, 4], 2)
    logits = torch.zeros(1, 3, VOCAB)
    got = process_logits(logits, [row], [[6, 4]])[0]
    assert custom.seen == [[3, 5, 4], [3, 5, 4, 6], [3, 5, 4, 6, 4]]
    assert got[0, 4] == float("-inf") and got[1, 4] == 50.0 and got[2, 4] == float("-inf"), (
        "the ban comes after the bias (a row's own order)")
    assert got[1, 6] == float("-inf") and got[0, 6] == 0.0


def test_a_draft_step_context_counts_the_tokens_drafted_so_far():
    context = RowContext([1, 2, 3, 4], 2, drafts=[7, 8], first=2)
    assert context.num_output == 2 and context.outputs_before(0) == 4
    assert list(context.speculative(0)) == [7, 8] and context.history(0) == [1, 2, 3, 4, 7, 8]
    reading = RowContext([1, 2], 5)  # a long prompt read in chunks: no output yet
    assert reading.num_output == 0
