"""engine/request/builtin_processors.py through the seam (engine/request/logits_processing.process_logits): each scored
position gets vLLM's processing with its own history, against a dense one-position reference; the settings' wire form;
the SamplingParams ranges; min-p in logits_to_probs."""

import pytest
import torch

from engine.request.builtin_processors import LogitBias, MinTokens, Penalties
from engine.request.settings import SequenceSettings
from engine.request.logits_processing import RowProcessing, process_logits
from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from tests.engine.reference_processing import reference_logits

VOCAB = 16
PROMPT = [3, 4, 5, 3]
OUTPUT = [6, 6, 7]
EOS = (1,)
PARAMS = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6, min_tokens=5,
                        logit_bias=((8, 2.5), (2, -1.0)), stop_token_ids=(9,), max_tokens=20)


def _logits(positions, seed=0):
    return torch.randn(1, positions, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(params=PARAMS, output=OUTPUT):
    settings = SequenceSettings.of(params, 0, len(PROMPT), EOS)
    return RowProcessing(settings.processors(), PROMPT + output, len(PROMPT))


def test_each_verify_position_is_processed_with_the_drafts_before_it():
    drafts = [7, 8, 6]
    logits = _logits(len(drafts) + 1)
    got = process_logits(logits, [_row()], [drafts])[0]
    for t in range(len(drafts) + 1):
        want = reference_logits(logits[0, t], PROMPT, OUTPUT + drafts[:t], PARAMS, EOS)
        assert torch.allclose(got[t], want, atol=1e-5), f"position {t}"
    # the control: processing with the committed tokens alone differs at the later positions (and the min_tokens
    # mask is lifted at position 2, where 5 output tokens precede it)
    committed_only = reference_logits(logits[0, 2], PROMPT, OUTPUT, PARAMS, EOS)
    assert not torch.allclose(got[2], committed_only, atol=1e-3)
    assert got[1, 1] == float("-inf") and got[2, 1] > float("-inf") and got[1, 9] == float("-inf")


def test_a_draft_step_sees_the_tokens_drafted_so_far():
    drafted = [7, 8]
    logits = _logits(1, seed=1)
    got = process_logits(logits, [_row()], [drafted], [2])[0, 0]
    assert torch.allclose(got, reference_logits(logits[0, 0], PROMPT, OUTPUT + drafted, PARAMS, EOS), atol=1e-5)


def test_rows_are_batched_each_with_its_own_history_and_rows_without_processors_pass_unchanged():
    logits = _logits(4, seed=2).expand(3, 4, VOCAB).clone()
    assert process_logits(logits, [None, None, None], [[], [], []]) is logits, "nothing to do: no copy"
    other = SamplingParams(repetition_penalty=0.5, presence_penalty=-1.0, logit_bias=((3, 4.0),))
    drafts = [[7], [5, 5, 5], [9, 9, 2]]
    got = process_logits(logits, [_row(), None, _row(other, [9])], drafts)
    assert torch.equal(got[1], logits[1])
    for t in range(2):  # row 0 scores 2 positions (1 draft + bonus)
        want = reference_logits(logits[0, t], PROMPT, OUTPUT + drafts[0][:t], PARAMS, EOS)
        assert torch.allclose(got[0, t], want, atol=1e-5)
    for t in range(4):
        want = reference_logits(logits[2, t], PROMPT, [9] + drafts[2][:t], other, EOS)
        assert torch.allclose(got[2, t], want, atol=1e-5)
    assert torch.equal(logits, _logits(4, seed=2).expand(3, 4, VOCAB)), "the caller's logits are not written"


def test_processors_come_in_vllms_order_and_only_when_set():
    assert SequenceSettings.of(SamplingParams(), 0, 3, EOS).processors() == ()
    kinds = [type(p) for p in SequenceSettings.of(PARAMS, 0, 3, EOS).processors()]
    assert kinds == [MinTokens, LogitBias, Penalties]
    # bias before the repetition penalty: a token biased positive is then divided, as vLLM does
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((4, 3.0),))
    logits = torch.zeros(1, 1, VOCAB)
    got = process_logits(logits, [_row(params, [4])], [[]])[0, 0]
    assert got[4] == pytest.approx(1.5)


def test_min_tokens_masks_eos_even_with_ignore_eos_and_the_settings_survive_the_wire():
    import pickle

    settings = SequenceSettings.of(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(7, 7)), 0, 5, (1, 2))
    assert settings.min_tokens_ids == (1, 2, 7)
    assert SequenceSettings.of(SamplingParams(ignore_eos=True), 0, 5, (1, 2)).min_tokens_ids == (), "only for min_tokens"
    assert pickle.loads(pickle.dumps(settings, protocol=5)) == settings
    both = SequenceSettings.of(PARAMS, 9, 4, EOS)
    assert pickle.loads(pickle.dumps(both, protocol=5)).processors() == both.processors()


def test_min_tokens_leaves_the_stop_ids_where_nothing_else_is_left():
    """vLLM's rule under a grammar (its mask applied first): where only stop ids remain (a grammar that can only
    end there), min_tokens does not empty the position; everywhere else under min_tokens it masks them."""
    inf = float("-inf")
    logits = _logits(3)
    logits[0, 1] = inf
    logits[0, 1, 1] = 0.5  # position 1: only EOS is left
    logits[0, 2] = inf
    logits[0, 2, [1, 9]] = 0.0  # position 2: only the stop ids are left
    out = process_logits(logits, [_row(SamplingParams(min_tokens=9, stop_token_ids=(9,)))], [[7, 8]])[0]
    assert out[0, [1, 9]].isneginf().all(), "another token remains: the stop ids are masked"
    assert out[1, 1] == 0.5 and torch.equal(out[2], logits[0, 2]), "kept where nothing else remains"
    assert (out > inf).any(dim=-1).all(), "no position is left with every token masked"
    plain = process_logits(_logits(3), [_row(SamplingParams(min_tokens=9, stop_token_ids=(9,)))], [[7, 8]])[0]
    assert plain[:, [1, 9]].isneginf().all(), "the control: without a prior mask every position masks them"


@pytest.mark.parametrize("penalty,logit", [(1e-30, 5.0), (1e38, -5.0)])
def test_an_extreme_repetition_penalty_leaves_something_to_sample(penalty, logit):
    params = SamplingParams(repetition_penalty=penalty, temperature=1.0)
    logits = torch.full((1, 1, VOCAB), logit)
    every_token = list(range(VOCAB))  # every token seen: all of them penalised
    row = RowProcessing(SequenceSettings.of(params, 0, VOCAB, ()).processors(), every_token, VOCAB)
    probs = logits_to_probs(process_logits(logits, [row], [[]]), BatchSampling.from_params([params]))
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
                                         ("min_p", 1.5), ("min_tokens", 65), ("stop_token_ids", (-1,)),
                                         ("logit_bias", ((-3, 1.0),))])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_is_clamped_and_stop_token_ids_deduplicated_as_vllm_does():
    params = SamplingParams(logit_bias=((5, 300.0), (2, -250.0)), stop_token_ids=(4, 4, 3))
    assert params.logit_bias == ((2, -100.0), (5, 100.0)) and params.stop_token_ids == (4, 3)


def test_min_p_keeps_the_tokens_within_min_p_of_the_top_one_after_temperature():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.1, 0.06, 0.04]]]))
    params = SamplingParams(temperature=1.0, min_p=0.25)
    probs = logits_to_probs(logits, BatchSampling.from_params([params]))[0, 0]
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]))
    hot = logits_to_probs(logits, BatchSampling.from_params([SamplingParams(temperature=2.0, min_p=0.4)]))[0, 0]
    assert (hot[:3] > 0).all() and (hot[3:] == 0).all(), "at temperature 2 (probabilities as sqrt p) the third token is within 0.4 of the top"
    greedy = logits_to_probs(logits, BatchSampling.from_params([SamplingParams(min_p=1.0)]))[0, 0]
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
