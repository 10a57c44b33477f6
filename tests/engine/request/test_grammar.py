"""Grammar specs, the compile cache and the per-sequence matcher (engine/request/grammar.py) on the tiny byte tokenizer:
masks at every draft position, advance, rollback, EOS only where the grammar accepts."""

import json

import pytest
import torch

from engine.request.grammar import GrammarCompiler, GrammarError, GrammarProcessor, GrammarSpec, SequenceGrammars
from tests.conftest import BYTE_VOCAB, EOS_ID, make_byte_tokenizer

TOKENIZER = make_byte_tokenizer()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, BYTE_VOCAB, [EOS_ID])


def ids(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


def fresh(compiler, spec, output):
    matcher = compiler.matcher(spec)
    matcher.sync(output)
    return matcher


def test_each_distinct_spec_compiles_once_and_the_time_is_reported():
    compiler = GrammarCompiler(TOKENIZER, BYTE_VOCAB, [EOS_ID])
    a, b = GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", "ab+c")
    for spec in (a, b, a, GrammarSpec.json_schema(json.dumps(SCHEMA, separators=(",", ":"))), b):
        compiler.matcher(spec)
    assert (compiler.stats.compiles, compiler.stats.cache_hits) == (2, 3)
    assert compiler.stats.seconds > 0 and compiler.stats.tokenizer_seconds > 0


@pytest.mark.parametrize("spec, fragment", [
    (GrammarSpec("json", '{"type": "frobnicate"}'), "frobnicate"),
    (GrammarSpec("json", "{not json"), None),
    (GrammarSpec("regex", "(ab"), "unclosed"),
    (GrammarSpec("grammar", "start: missing_rule"), "missing_rule"),
])
def test_bad_grammars_are_refused_with_the_librarys_reason(compiler, spec, fragment):
    with pytest.raises(GrammarError, match=fragment):
        compiler.compile(spec)


def test_a_choice_needs_strings():
    with pytest.raises(GrammarError):
        GrammarSpec.choice([])
    with pytest.raises(GrammarError):
        GrammarSpec("yaml", "")


def test_masks_at_each_position_are_the_state_after_the_drafts_before_it(compiler):
    spec = GrammarSpec.json_schema(SCHEMA)
    output = ids('{"name": "ab')
    drafts = ids('c", "ok": tr')
    matcher = fresh(compiler, spec, output)
    before = matcher.allowed()
    masks = matcher.masks(drafts)
    assert masks.shape == (len(drafts) + 1, BYTE_VOCAB)
    for j in range(len(drafts) + 1):
        assert torch.equal(masks[j], fresh(compiler, spec, output + drafts[:j]).allowed()), j
    assert torch.equal(matcher.allowed(), before), "probing the drafts leaves the matcher where it was"
    assert not masks[:, 272:].any(), "ids past the tokenizer (padding rows) are never allowed"


def test_probing_stops_at_the_first_draft_the_grammar_refuses(compiler):
    spec = GrammarSpec("regex", "ab+c")
    bad = ids("x")[0]
    drafts = ids("ab") + [bad] + ids("b")
    masks = fresh(compiler, spec, []).masks(drafts)
    assert not masks[1, bad], "the refused draft has no mass at its position: the target rejects it there"
    assert masks[2].all(), "positions past a refused draft are never read"


def test_eos_is_allowed_exactly_where_the_grammar_accepts(compiler):
    spec = GrammarSpec.choice(["cd", "cdcd"])
    a, b = ids("c")[0], ids("d")[0]
    masks = fresh(compiler, spec, []).masks([a, b, a, b, EOS_ID])
    assert [bool(m[EOS_ID]) for m in masks] == [False, False, True, False, True, True]
    assert masks[4].sum() == 1, "a finished grammar allows EOS alone"
    assert masks[5].sum() == 1, "past an EOS only EOS"


def test_sync_rolls_back_rejected_drafts_and_keeps_accepted_ones(compiler):
    spec = GrammarSpec.json_schema(SCHEMA)
    text = ids('{"name": "ab", "ok": true}')
    matcher = compiler.matcher(spec)
    matcher.sync(text[:6])  # committed
    matcher.advance(text[6:9])  # a round's drafts, all consumed
    matcher.sync(text[:7] + ids("x"))  # the round accepted one, then a recovered token
    assert torch.equal(matcher.allowed(), fresh(compiler, spec, text[:7] + ids("x")).allowed())
    matcher.rollback(2)
    assert torch.equal(matcher.allowed(), fresh(compiler, spec, text[:6]).allowed())
    matcher.sync(text)
    assert matcher.accepting and matcher.allowed().nonzero().flatten().tolist() == [EOS_ID]


def test_an_output_off_the_grammar_gives_no_mask_until_rolled_back(compiler):
    spec = GrammarSpec("regex", "ab+c")
    matcher = compiler.matcher(spec)
    matcher.sync(ids("ax"))  # a draft worker's guessed continuation may leave the grammar
    assert matcher.off_grammar and matcher.allowed() is None and matcher.masks(ids("b")) is None
    matcher.sync(ids("ab"))
    assert not matcher.off_grammar
    assert torch.equal(matcher.allowed(), fresh(compiler, spec, ids("ab")).allowed())


def test_an_eos_where_the_grammar_does_not_accept_is_off_the_grammar(compiler):
    matcher = fresh(compiler, GrammarSpec("regex", "ab+c"), ids("ab") + [EOS_ID])
    assert matcher.off_grammar and matcher.allowed() is None


def test_sequence_grammars_cover_the_output_only_and_release(compiler):
    rows = SequenceGrammars(compiler)
    prompt = ids("zzz")  # the prompt is outside the grammar
    rows.track("s", GrammarSpec("regex", "ab+c"), len(prompt))
    masks = rows.masks("s", prompt + ids("a"), ids("b"))
    assert torch.equal(masks[0], fresh(compiler, GrammarSpec("regex", "ab+c"), ids("a")).allowed())
    assert rows.masks("other", prompt, []) is None
    rows.release("s")
    assert len(rows) == 0 and rows.masks("s", prompt, []) is None


def test_a_sequence_whose_grammar_failed_keeps_failing_until_released(compiler, monkeypatch):
    """No silent fallback: the grammar travels with a sequence's first call only, so a sequence whose grammar
    would not compile must not look like one without a grammar on its later calls; release forgets it."""
    rows = SequenceGrammars(compiler)
    spec = GrammarSpec("regex", "ab+c")

    def broken(_spec):
        raise GrammarError("no such grammar here")

    with monkeypatch.context() as patch:
        patch.setattr(compiler, "compile", broken)
        with pytest.raises(GrammarError, match="no such grammar"):
            rows.track("s", spec, 0)
    rows.track("t", spec, 0)  # the other sequences are untouched
    for call in (lambda: rows.check("s"), lambda: rows.masks("s", ids("a"), []), lambda: rows.matcher("s", [])):
        with pytest.raises(GrammarError, match="no such grammar"):
            call()
    assert rows.masks("t", ids("a"), []) is not None
    rows.release("s")
    rows.check("s")
    assert rows.masks("s", ids("a"), []) is None, "released: a new sequence of that id starts clean"


def test_a_broken_matcher_fails_its_sequence_with_a_grammar_error(compiler, monkeypatch):
    rows = SequenceGrammars(compiler)
    rows.track("s", GrammarSpec("regex", "ab+c"), 0)
    rows.masks("s", ids("abb"), [])
    matcher = rows.matcher("s", ids("abb"))

    class RefusesRollback:  # llguidance's matcher, except that it refuses to roll back
        def __init__(self, inner):
            self._inner = inner

        def rollback(self, n):
            return False

        def __getattr__(self, name):
            return getattr(self._inner, name)

    monkeypatch.setattr(matcher, "_matcher", RefusesRollback(matcher._matcher))
    with pytest.raises(GrammarError, match="rollback"):
        rows.masks("s", ids("ab"), [])  # a rolled-back token, which llguidance refuses here
    with pytest.raises(GrammarError, match="rollback"):
        rows.check("s")


def test_the_tokenizer_table_is_built_by_prepare_and_an_unreadable_tokenizer_is_kept_as_the_error():
    compiler = GrammarCompiler(TOKENIZER, BYTE_VOCAB, [EOS_ID])
    compiler.prepare()
    assert compiler.stats.tokenizer_seconds > 0 and compiler.unavailable is None
    built = compiler.stats.tokenizer_seconds
    compiler.compile(GrammarSpec("regex", "ab+c"))
    assert compiler.stats.tokenizer_seconds == built, "not built again by the first compile"

    from tests.conftest import make_tiny_tokenizer  # a WordPiece decoder, which llguidance cannot read

    unreadable = GrammarCompiler(make_tiny_tokenizer(), 64, [1])
    with pytest.raises(GrammarError, match="cannot read this model's tokenizer"):
        unreadable.prepare()
    assert unreadable.unavailable is not None
    with pytest.raises(GrammarError, match="cannot read this model's tokenizer"):
        unreadable.compile(GrammarSpec("regex", "a"))


def test_the_grammar_as_a_logits_processor_masks_each_position_of_the_seam(compiler):
    """GrammarProcessor through engine/request/logits_processing.process_logits: the target's rows (each draft's
    position and the bonus one) and a draft step (`first`) get the matcher's masks after their own history."""
    from engine.request.logits_processing import RowProcessing, process_logits

    spec = GrammarSpec.json_schema(SCHEMA)
    prompt, output = ids("zz"), ids('{"name": "ab')
    drafts = ids('c", "ok": tr')
    row = RowProcessing((GrammarProcessor(compiler.matcher(spec)),), prompt + output, len(prompt))
    logits = torch.randn(1, len(drafts) + 1, BYTE_VOCAB)
    out = process_logits(logits, [row], [drafts])
    want = fresh(compiler, spec, output).masks(drafts)
    assert torch.equal(out[0].isfinite(), want)
    step = process_logits(logits[:, :1], [row], [drafts[:2]], [2])  # a draft step after two drafts
    assert torch.equal(step[0, 0].isfinite(), want[2])
