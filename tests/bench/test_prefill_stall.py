"""bench/prefill_stall.py's pure parts: the long prompt's length, the split of gaps, the percentiles."""

import pytest

from bench.prefill_stall import long_prompt, pct, split_gaps
from tests.conftest import make_tiny_tokenizer


def test_long_prompt_has_the_asked_number_of_tokens():
    tok = make_tiny_tokenizer()
    for n in (40, 300):
        got = len(tok.encode(long_prompt(tok, n), add_special_tokens=False))
        assert n <= got <= n + 12  # the cut, then the instruction's few words


def test_gaps_overlapping_the_prefill_are_told_apart():
    # stream 0 stalls from 1.0 to 3.0 while the prompt (sent 1.5, first token 2.5) prefills; stream 1 after it
    during, other, series = split_gaps([[0.0, 0.5, 1.0, 3.0], [2.6, 2.7]], sent=1.5, first=2.5)
    assert during == [2.0]
    assert other == pytest.approx([0.5, 0.5, 0.1])
    assert len(series) == 4 and series[2] == (1.5, 2.0)


def test_percentiles_in_milliseconds():
    got = pct([0.01] * 99 + [1.0])
    assert got["n"] == 100 and got["p50_ms"] == 10.0 and got["max_ms"] == 1000.0
    assert 10.0 < got["p99_ms"] < 1000.0
    assert pct([]) == {"n": 0}
