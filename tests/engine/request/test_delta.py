"""engine/request/delta.py: what a model's side learns of a sequence, delta by delta; the settings come once."""

import pytest

from engine.request.delta import KnownSequences, SeqDelta, UnknownSequenceError, first_delta, seq_delta
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState

PENALISED = SamplingParams(presence_penalty=1.0, logit_bias=((5, 2.0),), temperature=1.0)


def test_the_settings_come_with_the_first_delta_and_stay_with_the_tokens():
    known = KnownSequences()
    assert known.apply(first_delta("s", [4, 5, 6], PENALISED, seed=9)) == [4, 5, 6]
    settings = known.settings("s")
    assert settings.seed == 9 and settings.prompt_len == 3 and not settings.coupled
    assert known.apply(SeqDelta("s", 3, [7, 8])) == [4, 5, 6, 7, 8], "a continuation: tokens only"
    assert known.apply(SeqDelta("s", 4, [9])) == [4, 5, 6, 7, 9], "rolled back to the agreeing prefix"
    processing = known.processing("s")
    assert processing.prompt_len == 3 and list(processing.tokens) == [4, 5, 6, 7, 9] and len(processing.processors) == 2
    assert known.settings("s") is settings, "continuations never change them"
    known.apply(first_delta("s", [1, 2]))  # a re-send from scratch brings the settings again
    assert known.settings("s").params == SamplingParams() and known.processing("s") is None


def test_a_delta_that_continues_what_is_not_held_is_refused():
    known = KnownSequences()
    with pytest.raises(UnknownSequenceError):
        known.apply(SeqDelta("t", 2, [5]))
    with pytest.raises(UnknownSequenceError):
        known.apply(SeqDelta("t", 0, [5, 6]))  # a first delta without the settings
    known.apply(first_delta("t", [5, 6]))
    with pytest.raises(UnknownSequenceError):
        known.apply(SeqDelta("t", 3, [7]))  # past what is held
    known.pop("t")
    with pytest.raises(UnknownSequenceError):
        known.apply(SeqDelta("t", 2, [7]))


def test_a_sequences_deltas_carry_its_settings_once_and_its_prompt_fields_while_it_scores(tiny_tokenizer):
    params = SamplingParams(prompt_logprobs=2, max_tokens=4)
    seq = SequenceState.create("p", [3, 4, 5, 6, 7], params, 2, 64, frozenset({1}), tiny_tokenizer)
    chunk = seq_delta(seq, 0, 3)
    assert chunk.settings is seq.settings and chunk.tokens == [3, 4, 5]
    assert (chunk.prompt_logprobs, chunk.prompt_next) == (2, 6), "a chunk: its last logits score the next prompt token"
    rest = seq_delta(seq, 3)
    assert rest.settings is None and rest.tokens == [6, 7] and rest.prompt_next is None
    seq.prompt_unscored = 0  # every prompt token scored: the fields stop
    assert seq_delta(seq, 3).prompt_logprobs is None
