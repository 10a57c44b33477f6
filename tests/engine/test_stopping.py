"""engine/stopping.py directly: where EOS, max_tokens and stop strings cut a round's chunk of tokens, and what text
may be streamed before the sequence is done."""

from __future__ import annotations

import pytest

from engine.stopping import Cut, OutputText, cut_at_eos_and_length

EOS = frozenset({1, 9})


@pytest.mark.parametrize("tokens,remaining,cut", [
    ([5, 6, 7], 10, Cut(3, None)),  # nothing stops it
    ([5, 1, 7], 10, Cut(2, "stop", True)),  # EOS kept, what follows it dropped
    ([9, 1], 10, Cut(1, "stop", True)),  # the first of several EOS ids
    ([5, 6, 7, 8], 2, Cut(2, "length")),  # max_tokens inside the chunk
    ([5, 6], 2, Cut(2, "length")),  # exactly the last allowed tokens
    ([5, 1, 7], 2, Cut(2, "stop", True)),  # EOS as the last allowed token: a stop, not a length cut
    ([5, 6, 1], 2, Cut(2, "length")),  # EOS beyond the limit is never reached
    ([5], 0, Cut(0, "length")),
    ([], 3, Cut(0, None)),
])
def test_cut_at_eos_and_length(tokens, remaining, cut):
    assert cut_at_eos_and_length(tokens, EOS, remaining) == cut


def test_without_eos_ids_only_the_length_cuts():
    assert cut_at_eos_and_length([1, 9, 1], frozenset(), 5) == Cut(3, None)


class ByteTokenizer:
    """Token id = one UTF-8 byte, so a character can arrive split over two rounds (like byte-level BPE)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_a_stop_string_inside_a_chunk_keeps_the_fewest_tokens_that_contain_it():
    out = OutputText(ByteTokenizer(), stop=["END"])
    assert out.extend(ids("hello ")) is None
    kept = out.extend(ids("worldEND and more"))
    assert kept == len("worldEND")  # the tokens up to the stop string's last one
    assert out.text == "hello world"  # the stop string itself is not output
    assert out.token_ids == ids("hello worldEND")


def test_a_stop_string_split_across_rounds_is_found():
    out = OutputText(ByteTokenizer(), stop=["STOP"])
    assert out.extend(ids("go ST")) is None
    assert out.extend(ids("OP!")) == 2
    assert out.text == "go "


def test_the_earliest_of_several_stop_strings_wins():
    out = OutputText(ByteTokenizer(), stop=["zz", "b"])
    assert out.extend(ids("abzz")) == 2
    assert out.text == "a"


def test_streaming_holds_back_a_possible_stop_prefix_until_it_is_decided():
    out = OutputText(ByteTokenizer(), stop=["STOP"])
    out.extend(ids("abc ST"))
    assert out.take_delta(final=False) == "abc "  # "ST" may begin the stop string
    out.extend(ids("AY"))
    assert out.take_delta(final=False) == "STAY"  # it did not
    assert out.take_delta(final=False) == ""  # nothing is handed out twice
    out.extend(ids(" S"))
    assert out.take_delta(final=True) == " S"  # the end: everything goes


def test_streaming_holds_back_an_incomplete_utf8_character():
    out = OutputText(ByteTokenizer(), stop=[])
    e_acute = "é".encode()
    out.extend([ord("a"), e_acute[0]])
    assert out.text == "a\ufffd"
    assert out.take_delta(final=False) == "a"
    out.extend([e_acute[1]])
    assert out.take_delta(final=False) == "é"
    assert out.text == "aé"
