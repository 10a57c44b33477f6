"""deployments/router/live.py: what a live request's calls carry; its settings go with a worker's first call only."""

import asyncio

from deployments.router.live import LiveRequest
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState
from engine.request.settings import SequenceSettings


def test_the_settings_travel_with_a_sequences_first_call_only(tiny_tokenizer):
    params = SamplingParams(frequency_penalty=1.0, min_p=0.2, logit_bias=((5, 3.0),), temperature=1.0, min_tokens=2)
    seq = SequenceState.create("r", [4, 5, 6], params, 3, 64, frozenset({1}), tiny_tokenizer)
    live = LiveRequest(seq, queue=asyncio.Queue(), target=None)
    first = live.delta(0)
    assert first.settings == SequenceSettings.of(params, seq.seed, 3, (1,)) == seq.settings
    assert first.settings.params.min_p == 0.2 and first.settings.min_tokens_ids == (1,)
    seq.commit([7, 8], 0, 0)
    assert live.delta(3).settings is None and live.delta(3).tokens == [7, 8], "a continuation: tokens only"
    assert live.delta(0).settings == seq.settings, "a re-send from scratch carries them again"
    assert live.draft_delta([]).settings is not None, "the draft worker's first call"
    assert live.draft_delta([9]).settings is None
