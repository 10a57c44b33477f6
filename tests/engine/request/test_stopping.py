"""engine/request/stopping.py directly: where EOS, max_tokens and stop strings cut a round's chunk of tokens, and what
text may be streamed before the sequence is done."""

from __future__ import annotations

import pytest

from engine.request.stopping import Cut, OutputText, cut_at_eos_and_length

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
    assert out.take_delta(final=False) == "a"
    out.extend([e_acute[1]])
    assert out.take_delta(final=False) == "é"
    assert out.text == "aé"
    out.extend([e_acute[0]])  # the sequence ends inside a character: as the full decoding ends
    assert out.take_delta(final=True) == "\ufffd" and out.text == "aé\ufffd"


def byte_level_tokenizer():
    """A fast (Rust-backed) byte-level BPE tokenizer: token id = one byte, as GPT-2-style vocabularies split text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> character table: printable bytes stand for themselves, the others map past 255
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_incremental_decoding_equals_decoding_the_whole_output():
    """The streaming decoder (a fast tokenizer's) against a full decode after every round, stop strings included."""
    import random

    tokenizer = byte_level_tokenizer()
    assert tokenizer.backend_tokenizer is not None and tokenizer.decode(ids("héllo ✓")) == "héllo ✓"
    text = "plain words, é accents, ✓ marks and 🙂 faces; then STOP and what follows"
    rng = random.Random(0)
    for trial in range(20):
        out, tokens, streamed = OutputText(tokenizer, stop=["STOP"]), ids(text), ""
        kept = None
        while tokens and kept is None:
            n = rng.randint(1, 5)
            chunk, tokens = tokens[:n], tokens[n:]
            kept = out.extend(chunk)
            streamed += out.take_delta(final=kept is not None)
            if kept is None:  # the text so far: all of it unless the round ended inside a character
                full = tokenizer.decode(out.token_ids)
                assert full.startswith(out.text) and (out.text == full or full.endswith("\ufffd"))
        assert streamed == out.text == text[: text.index("STOP")]
        assert out.token_ids == ids(text[: text.index("STOP") + 4])


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_after_it():
    out = OutputText(ByteTokenizer(), stop=["END"], include_stop_str=True)
    assert out.extend(ids("helloEND and more")) == len("helloEND")
    assert out.text == "helloEND"


def test_a_stop_string_within_the_first_min_tokens_does_not_count():
    out = OutputText(ByteTokenizer(), stop=["ab"], min_tokens=4)
    assert out.extend(ids("ab")) is None and out.extend(ids("x")) is None, "ends inside the first 4 tokens"
    assert out.extend(ids("ab")) == 2 and out.text == "abx", "this 'ab' ends at token 5, past the first 4"
    out = OutputText(ByteTokenizer(), stop=["ab"], min_tokens=4)
    assert out.extend(ids("abxyab")) == 6 and out.text == "abxy", "the first 'ab' past min_tokens stops it"
    straddle = OutputText(ByteTokenizer(), stop=["xyz"], min_tokens=2)
    assert straddle.extend(ids("xyz")) == 3 and straddle.text == "", "it may begin inside, if it ends past them"


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str():
    out = OutputText(ByteTokenizer(), stop=[])
    assert out.extend(ids("ok!"), ends_with_stop_token=True) is None
    assert out.take_delta(final=True) == "ok"
    assert out.text == "ok" and out.token_ids == ids("ok!"), "the stop token is emitted, its text is not"
    kept = OutputText(ByteTokenizer(), stop=[], include_stop_str=True)
    kept.extend(ids("ok!"), ends_with_stop_token=True)
    assert kept.take_delta(final=True) == "ok!" and kept.text == "ok!"


def test_skip_special_tokens(tiny_tokenizer):
    special = [0, 5, 1, 6]  # <pad> w5 </s> w6
    assert OutputText(tiny_tokenizer, stop=[]).extend(special) is None
    skipped, shown = OutputText(tiny_tokenizer, stop=[]), OutputText(tiny_tokenizer, stop=[], skip_special_tokens=False)
    skipped.extend(special)
    shown.extend(special)
    assert skipped.take_delta(final=False) == "w5 w6" and shown.take_delta(final=False) == "<pad> w5 </s> w6"


def test_a_stop_id_within_the_tokens_owed_to_min_tokens_does_not_stop():
    assert cut_at_eos_and_length([1, 5, 9, 7], EOS, 10, min_left=2) == Cut(3, "stop", True)
    assert cut_at_eos_and_length([1, 9], EOS, 10, min_left=2) == Cut(2, None)


class CountingTokenizer(ByteTokenizer):
    """ByteTokenizer that counts its decodes."""

    def __init__(self):
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return super().decode(ids, skip_special_tokens)


def test_without_stop_strings_extend_decodes_nothing_and_each_output_gets_its_own_tokens_text():
    """The round loop's commit decodes no text without stop strings; a consumer reading an output later (after more
    rounds were committed) still gets the text of that output's tokens, and the pieces add up to the full text."""
    tokenizer = CountingTokenizer()
    out = OutputText(tokenizer, stop=[])
    assert out.deferred
    ends = []
    for chunk in ("héllo", " wor", "ld"):
        assert out.extend(ids(chunk)) is None
        ends.append(len(out.token_ids))
    assert tokenizer.decodes == 0 and out.text == "", "nothing decoded in the loop"
    # the consumer reads the three outputs after all three rounds were committed
    pieces = [out.take_delta(False, ends[0]), out.take_delta(False, ends[1]), out.take_delta(True, ends[2])]
    assert pieces == ["héllo", " wor", "ld"]
    assert out.text == "héllo world"


def test_with_stop_strings_extend_decodes_in_the_loop():
    tokenizer = CountingTokenizer()
    out = OutputText(tokenizer, stop=["END"])
    assert not out.deferred
    out.extend(ids("abc"))
    assert tokenizer.decodes > 0 and out.text == "abc"


def test_deferred_streaming_decoding_equals_decoding_the_whole_output_whenever_the_consumer_reads():
    """The streaming decoder without stop strings: outputs read one, two or three rounds late still stream exactly the
    whole output's text, characters split across rounds included."""
    import random

    tokenizer = byte_level_tokenizer()
    text = "plain words, é accents, ✓ marks and 🙂 faces"
    rng = random.Random(1)
    for trial in range(20):
        out, tokens, streamed, unread = OutputText(tokenizer, stop=[]), ids(text), "", []
        while tokens:
            n = rng.randint(1, 5)
            chunk, tokens = tokens[:n], tokens[n:]
            out.extend(chunk)
            unread.append(len(out.token_ids))
            while unread and (not tokens or rng.random() < 0.4):  # the consumer catches up now and then
                upto = unread.pop(0)
                streamed += out.take_delta(final=not tokens and not unread, upto=upto)
        assert streamed == out.text == text
