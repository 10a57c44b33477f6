"""Speculative decoding under a grammar (engine/request/grammar.py through engine/spec/accept.py and the proposers): the
sampled marginal is the masked, processed target distribution; greedy speculative equals greedy plain decoding under the
same grammar; drafts outside the grammar are rejected; finished outputs parse."""

import json
import re

import jsonschema
import pytest
import torch

from engine import DraftModelProposer, ModelRunner, NgramProposer, SamplingParams, SpeculativeEngine
from engine.proposers.base import Proposal
from engine.request.grammar import GrammarCompiler, GrammarSpec, SequenceGrammars
from engine.request.sampling import BatchSampling, logits_to_probs
from engine.spec.accept import RowVerify, verify_rows
from engine.spec.proposal import CompactProposal, RowScheme
from engine.spec.randomness import DRAFT, gumbel, inverse_cdf, uniforms
from tests.conftest import (
    BYTE_VOCAB,
    EOS_ID,
    make_byte_tokenizer,
    make_tiny_model,
    perturbed_copy,
    total_variation_bound,
)

TOKENIZER = make_byte_tokenizer()
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
PROMPTS = [TOKENIZER("hello")["input_ids"], TOKENIZER("a longer prompt, with words")["input_ids"]]


# ---- the accept step under masks: the marginal is the masked processed target distribution ----------------------
VOCAB, SAMPLES = 6, 12_000


def masked_sampler_case(k: int, coupled: bool, one_hot: bool):
    """N rows of one prompt: fixed target logits, per-position grammar masks, drafts drawn from an UNMASKED draft
    distribution (much of its mass outside the masks), through verify_rows."""
    gen = torch.Generator().manual_seed(7 + k)
    target_logits = torch.randn(k + 1, VOCAB, generator=gen) * 0.6
    allowed = torch.ones(k + 1, VOCAB, dtype=torch.bool)
    for j in range(k + 1):  # each position refuses the target's second and third most likely tokens
        allowed[j, target_logits[j].argsort(descending=True)[1:3]] = False
    # the draft: close to the constrained target (so later positions are reached), but its first draft favours a
    # token the grammar refuses there
    draft_logits = target_logits[:k].masked_fill(~allowed[:k], -2.0) + torch.randn(k, VOCAB, generator=gen) * 0.3
    draft_logits[0, target_logits[0].argsort(descending=True)[1]] += 2.0
    params = SamplingParams(temperature=0.9, seed=None if not coupled else 0)
    batch = BatchSampling.from_params([params])
    draft_p = logits_to_probs(draft_logits[None], batch)[0]  # [K, V]
    seeds = torch.arange(SAMPLES, dtype=torch.long) + 1000 * k
    positions = torch.arange(k + 1)[None, :].expand(SAMPLES, -1) + 17
    if coupled:
        drafts = (draft_p.log()[None] + gumbel(seeds, positions, VOCAB)[:, :k]).argmax(-1)
    else:
        u = uniforms(seeds, positions[:, :k], DRAFT)
        drafts = torch.stack([inverse_cdf(draft_p[i].expand(SAMPLES, -1), u[:, i]) for i in range(k)], dim=1)
    order = draft_p.argsort(dim=-1, descending=True)
    proposal = None if one_hot or coupled else CompactProposal(order.int(), draft_p.gather(-1, order))
    rows = [RowVerify(params, RowScheme(params.greedy, coupled, int(seeds[i]), 17), drafts[i].tolist(), proposal,
                      allowed=allowed)
            for i in range(SAMPLES)]
    verdicts = verify_rows(target_logits[None].expand(SAMPLES, -1, -1), rows)
    masked = logits_to_probs(target_logits.masked_fill(~allowed, float("-inf"))[None], batch)[0]
    plain = logits_to_probs(target_logits[None], batch)[0]
    return verdicts, drafts, allowed, masked, plain


# one-hot (n-gram) drafts are accepted with the target's own probability: too few reach position 3 at this size
@pytest.mark.parametrize("k, scheme", [(1, "rejection"), (3, "rejection"), (1, "gumbel"), (3, "gumbel"),
                                       (1, "one-hot"), (2, "one-hot")])
def test_the_sampled_marginal_is_the_masked_processed_target_distribution(k, scheme):
    verdicts, drafts, allowed, masked, plain = masked_sampler_case(k, scheme == "gumbel", scheme == "one-hot")
    off = sum(not bool(allowed[0, d[0]]) for d in drafts.tolist())
    assert off > SAMPLES // 10, "many drafts fall outside the grammar"
    for pos in range(k + 1):
        tokens = torch.tensor([v.tokens[pos] for v in verdicts if len(v.tokens) > pos])
        assert len(tokens) >= 1000, "too few samples reach this position for the check to mean anything"
        assert allowed[pos, tokens].all(), "no emitted token lies outside the grammar"
        got = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
        bound = total_variation_bound(VOCAB, len(tokens))
        assert 0.5 * (got - masked[pos]).abs().sum() < bound, f"position {pos}: {got} vs {masked[pos]}"
        # the check can fail: the unconstrained target distribution is measurably different
        assert 0.5 * (plain[pos] - masked[pos]).abs().sum() > 2 * bound
    rejected_off = [v.num_accepted == 0 for v, d in zip(verdicts, drafts.tolist()) if not allowed[0, d[0]]]
    assert all(rejected_off), "a first draft outside the grammar is always rejected"


# ---- the engine under a grammar ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_model():
    return make_tiny_model("llama", vocab=BYTE_VOCAB, seed=0)


class OffGrammarProposer:
    """Drafts the same tokens every round (`x`, `}` and EOS: almost never what the grammar allows), unmasked."""

    def __init__(self) -> None:
        self.tokens = TOKENIZER("x}")["input_ids"] + [EOS_ID]

    def propose(self, requests, stop=None) -> Proposal:
        k_max = max(r.k for r in requests)
        ids = torch.tensor([(self.tokens * k_max)[:k_max] for _ in requests])
        return Proposal(token_ids=ids, num_tokens=torch.tensor([r.k for r in requests]))

    def release(self, seq_id) -> None:
        pass


def engine_with(target_model, draft: str, k: int) -> SpeculativeEngine:
    runner = ModelRunner(target_model)
    if draft == "model":  # the draft masks its own proposals with its own matchers
        grammars = SequenceGrammars(GrammarCompiler(TOKENIZER, runner.vocab_size, [EOS_ID]))
        proposer = DraftModelProposer(ModelRunner(perturbed_copy(target_model, 0.05)), runner.vocab_size,
                                      grammars=grammars)
    else:
        proposer = {"ngram": lambda: NgramProposer(1, 3), "off-grammar": OffGrammarProposer, "none": lambda: None}[
            draft]()
    return SpeculativeEngine(runner, TOKENIZER, proposer, k, eos_token_ids=[EOS_ID])


def check_output(spec: GrammarSpec, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.source))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.source, text), text
    elif spec.kind == "choice":
        assert text in json.loads(spec.source)


SPECS = [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", EMAIL), GrammarSpec.choice(["yes", "no", "maybe"])]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("draft", ["model", "ngram", "off-grammar"])
def test_greedy_speculative_equals_plain_decoding_under_a_grammar(target_model, draft, k):
    engine = engine_with(target_model, draft, k)
    for spec in SPECS:
        params = SamplingParams(max_tokens=100, grammar=spec)
        spec_out = engine.generate(PROMPTS, params)
        plain = engine.generate(PROMPTS, params, k=0)
        for s, p in zip(spec_out, plain):
            assert s.token_ids == p.token_ids, spec.kind
            assert s.finish_reason == "stop", "the grammar completed and the row stopped"
            check_output(spec, s.text)
    assert engine.stats.num_draft_tokens > 0
    if draft == "model":
        assert engine.stats.acceptance_rate > 0.3, "the draft's own masks keep its drafts in the grammar"
    if draft == "off-grammar":
        assert engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens // 10, "off-grammar drafts rejected"
    assert len(engine.grammars) == 0, "finished requests release their matchers"


def test_unconstrained_greedy_decoding_would_not_parse(target_model):
    """The control: without the grammar the same model and prompts produce no JSON at all."""
    out = engine_with(target_model, "none", 0).generate(PROMPTS, SamplingParams(max_tokens=40))
    for o in out:
        with pytest.raises(ValueError):
            json.loads(o.text)


@pytest.mark.parametrize("seeded", [True, False], ids=["gumbel", "rejection"])
def test_sampled_outputs_under_a_schema_always_validate(target_model, seeded):
    spec = SPECS[0]
    engine = engine_with(target_model, "model", 3)
    params = [SamplingParams(temperature=1.0, max_tokens=120, grammar=spec, seed=i if seeded else None)
              for i in range(6)]
    outs = engine.generate([PROMPTS[i % 2] for i in range(6)], params)
    assert sum(o.finish_reason == "stop" for o in outs) >= 4
    for o in outs:
        if o.finish_reason == "stop":
            check_output(spec, o.text)
    if seeded:  # drafter invariance holds under the grammar too: off-grammar drafts change nothing
        rogue = engine_with(target_model, "off-grammar", 3).generate([PROMPTS[i % 2] for i in range(6)], params)
        assert [o.token_ids for o in rogue] == [o.token_ids for o in outs]


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_min_tokens_with_a_grammar_that_can_end_early(target_model, draft):
    """vLLM's rule (vllm-project/vllm#54218): min_tokens keeps EOS out only while the grammar allows something
    else; where the grammar can only end, the row ends there (finish "stop", short of min_tokens) instead of
    sampling from an all -inf row (token 0, outside the grammar) or emitting EOS until min_tokens. Speculation
    changes nothing: greedy speculative equals plain decoding, and sampled rows stay in the grammar."""
    engine = engine_with(target_model, draft, 3)
    choice, digits = GrammarSpec.choice(["yes", "no"]), GrammarSpec("regex", "[0-9]{1,30}")
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=40, grammar=digits), k=0)
    floor = max(len(o.token_ids) for o in free) + 3  # binding: more than the grammar's row emits without it
    for temperature in (0.0, 1.0):
        for spec, min_tokens in ((choice, 12), (digits, floor)):
            params = SamplingParams(temperature=temperature, max_tokens=40, min_tokens=min_tokens, grammar=spec,
                                    seed=5 if temperature else None)
            outs = engine.generate(PROMPTS, params)
            if temperature == 0.0:
                assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(PROMPTS, params, k=0)]
            for o in outs:
                assert o.finish_reason == "stop", (spec.kind, o)
                check_output(spec, o.text)
                if spec is choice:
                    assert len(o.token_ids) < min_tokens, "the grammar ended the row before min_tokens"
                else:
                    assert len(o.text) >= min_tokens - 1, "the grammar could go on: min_tokens held it open"
    assert len(engine.grammars) == 0
