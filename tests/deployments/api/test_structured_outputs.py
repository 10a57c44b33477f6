"""Structured outputs over real HTTP through the official `openai` client (router + scheduler + worker cores, no
cluster): response_format json_schema / json_object, vLLM's structured_outputs (json, regex, choice, grammar), bad
grammars refused with a 400 naming their parameter before admission, greedy speculation unchanged by a grammar."""

import concurrent.futures
import json
import math
import re
import time

import jsonschema
import openai
import pytest

from deployments.router.router import Router
from deployments.transport.messages import DraftCall, DraftResult, VerifyCall, VerifyResult
from engine.request.delta import SeqDelta, first_delta
from engine.request.grammar import GrammarError, GrammarSpec
from engine.request.sampling import SamplingParams
from tests.deployments.conftest import LocalBroker, http_server, tiny_config
from tests.deployments.held_rounds import HeldRounds, until

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def served(byte_model_dirs):
    config = tiny_config(byte_model_dirs, speculation={"num_speculative_tokens": 3})
    broker = LocalBroker(config)
    router = Router(config, broker)
    with http_server(router) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), broker, router


def test_json_schema_output_validates_against_its_schema(served):
    client, broker, _ = served
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert r.usage.speculative["num_draft_tokens"] > 0, "the request was speculated"
    stats = broker.cores["target"].stats()["grammar"]
    assert stats["compiles"] >= 1 and stats["compile_seconds"] > 0, "the target reports its compile time"


def test_sampled_json_schema_outputs_validate_on_completions_too(served):
    client, _, _ = served
    r = client.completions.create(model="tiny", prompt="Person:", max_tokens=120, temperature=1.0, n=3, seed=5,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": SCHEMA}}})
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished, "at least one choice completed its schema"
    for c in finished:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_output_is_a_json_object(served):
    client, _, _ = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may fill an open object to max_tokens: still a JSON object's prefix
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_choice_returns_one_of_the_choices(served):
    client, _, _ = served
    choices = ["yes", "no", "maybe later"]
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=temperature,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"


def test_regex_output_matches(served):
    client, _, _ = served
    r = client.completions.create(model="tiny", prompt="Email:", max_tokens=40, temperature=0.8,
                                  extra_body={"structured_outputs": {"regex": EMAIL}})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(EMAIL, r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("grammar", ['root ::= "red" | "green" | "blue"', 'start: "red" | "green" | "blue"'],
                         ids=["ebnf", "lark"])
def test_a_grammar_constrains_the_output(served, grammar):
    client, _, _ = served
    r = client.completions.create(model="tiny", prompt="Colour:", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    assert r.choices[0].text in ("red", "green", "blue")


def test_greedy_speculation_under_a_schema_equals_plain_decoding_and_streams(served):
    client, _, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    texts = []
    for speculative in ({"k": 3, "adaptive": False}, {"enabled": False}):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                           response_format=fmt, extra_body={"speculative": speculative})
        texts.append(r.choices[0].message.content)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                            response_format=fmt, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert texts[0] == texts[1] == streamed
    jsonschema.validate(json.loads(streamed), SCHEMA)


def error_of(exc: openai.BadRequestError) -> dict:
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_grammars_are_a_400_naming_the_parameter_before_admission(served, body, param):
    client, broker, router = served
    calls_before = dict(broker.calls)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=body)
    assert (error_of(info.value).get("param") or "").startswith(param), error_of(info.value)
    assert broker.calls == calls_before and router.scheduler.num_live == 0, "never admitted to the scheduler"


def test_drafts_made_ahead_under_a_grammar_change_nothing(byte_model_dirs, served):
    """With speculation.overlap the draft worker drafts round r+1 on a guess of round r (its matcher follows the
    guessed tokens and rolls back when the guess was wrong); the output is still greedy plain decoding's."""
    client, _, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                           response_format=fmt, extra_body={"speculative": {"enabled": False}})
    config = tiny_config(byte_model_dirs, speculation={"num_speculative_tokens": 3, "overlap": True})
    router = Router(config, LocalBroker(config))
    with http_server(router) as base:
        ahead = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, response_format=fmt)
    assert router.scheduler.stats.ahead_drafts > 0, "drafts were made ahead"
    assert ahead.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_with_a_choice_that_ends_early_ends_with_the_choice(served, stream):
    """min_tokens cannot outlast a grammar that can only end (vLLM's rule): the choice, finish_reason "stop", no
    500 and no text outside the grammar, streamed or not."""
    client, _, _ = served
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, extra_body={
        "min_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}})
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        text, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert text in ("yes", "no") and finish == "stop"


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logprobs_come_from_the_constrained_distribution(served, temperature):
    """At the first position of a choice between "yes" and "no" only 'y' and 'n' have mass; the tokens the grammar
    refuses report vLLM's floor (JSON has no -inf), never a 500."""
    client, _, _ = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=temperature,
                                       logprobs=True, top_logprobs=4,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    first = r.choices[0].logprobs.content[0]
    mass = {t.token: t.logprob for t in first.top_logprobs if t.logprob > -9999.0}
    assert set(mass) == {"y", "n"} and abs(sum(math.exp(v) for v in mass.values()) - 1) < 1e-4
    assert [t.logprob for t in first.top_logprobs if t.token not in mass] == [-9999.0, -9999.0]


def test_ngram_drafts_from_the_router_are_unmasked_and_the_target_keeps_the_output_right(byte_model_dirs):
    """With n-gram drafting the router proposes (it never computes masks); drafts outside the grammar are
    rejected by the target's masks, and the output is greedy plain decoding's under the schema."""
    config = tiny_config(byte_model_dirs, model={"draft": "ngram"}, speculation={"num_speculative_tokens": 3})
    router = Router(config, LocalBroker(config))
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    with http_server(router) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        texts = [client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                                response_format=fmt, extra_body={"speculative": speculative})
                 for speculative in ({"k": 3, "adaptive": False}, {"enabled": False})]
    assert texts[0].usage.speculative["num_draft_tokens"] > 0, "n-gram drafts were verified"
    assert texts[0].choices[0].message.content == texts[1].choices[0].message.content
    jsonschema.validate(json.loads(texts[0].choices[0].message.content), SCHEMA)


def test_a_worker_keeps_the_grammar_its_sequences_first_delta_brought(served):
    """The grammar travels once per sequence and worker (in the delta that starts at 0); later rounds send only
    tokens, and the target still masks them; the draft masks its drafts; release drops both matchers."""
    _, broker, router = served
    spec = GrammarSpec("regex", "[0-9]{6}")
    prompt = router.tokenizer("Number:")["input_ids"]
    target, draft = broker.cores["target"], broker.cores["draft"]

    def delta(start, tokens, grammar=None):  # the first delta carries the settings, the grammar in them
        return SeqDelta("g1", start, tokens) if start else first_delta("g1", tokens, SamplingParams(grammar=grammar), 7)

    drafted = DraftResult.from_wire(draft.propose([DraftCall(delta(0, prompt, spec), 3).wire()])).drafts[0]
    assert re.fullmatch("[0-9]+", router.tokenizer.decode(drafted)), "the draft masks its own drafts"
    first = VerifyResult.from_wire(target.verify([VerifyCall(delta(0, prompt, spec), []).wire()]))
    out = first.verdicts[0].tokens
    off = router.tokenizer("xy")["input_ids"]  # drafts outside the grammar, in a delta without it
    second = VerifyResult.from_wire(target.verify([VerifyCall(delta(len(prompt), out), off).wire()]))
    assert second.verdicts[0].num_accepted == 0
    assert re.fullmatch("[0-9]{2,4}", router.tokenizer.decode(out + second.verdicts[0].tokens))
    target.release(["g1"])
    draft.release(["g1"])
    assert not target.grammars.has("g1") and not draft.proposer.grammars.has("g1")


def _fail_compiling(monkeypatch, compiler, bad: GrammarSpec, why: str) -> None:
    """Make one worker's compiler refuse `bad` (as a tokenizer that differs from the router's would), and only it."""
    real = compiler.compile

    def compile_(spec):
        if spec == bad:
            raise GrammarError(why)
        return real(spec)

    monkeypatch.setattr(compiler, "compile", compile_)


def _wait_released(broker, router) -> None:
    deadline = time.monotonic() + 60  # only turns a lease never released into a failure
    while (router.scheduler.num_live or any(broker.open_leases.values())) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.scheduler.num_live == 0 and not any(broker.open_leases.values()), "the leases were released"


def test_a_grammar_the_target_cannot_compile_fails_its_request_only(served, monkeypatch):
    """No silent unconstrained fallback: the row whose grammar fails on the target worker ends its request with a
    500 naming structured outputs, while the request beside it in the same verify batch completes with the output
    it has alone."""
    client, broker, router = served
    target = broker.cores["target"]
    bad = GrammarSpec("regex", "[0-9]{6}")
    _fail_compiling(monkeypatch, target.grammars.compiler, bad, "simulated tokenizer mismatch")
    batches = []  # (rows, failed rows) of each verify
    verify = target._timed_verify

    def spy(calls):
        wire = verify(calls)
        batches.append((len(calls), sorted(VerifyResult.from_wire(wire).failed)))
        return wire

    monkeypatch.setattr(target, "_timed_verify", spy)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    alone = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                           response_format=fmt).choices[0].message.content
    # the streaming request's rounds after its first wait until the failing request has joined it
    with concurrent.futures.ThreadPoolExecutor(1) as pool, HeldRounds(broker, monkeypatch, free=1) as rounds:
        chunks = iter(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
                                                     response_format=fmt, stream=True))
        text = next(chunks).choices[0].delta.content or ""  # the request is live: its first round is done
        failing = pool.submit(client.completions.create, model="tiny", prompt="Number:", max_tokens=10,
                              temperature=0, extra_body={"structured_outputs": {"regex": bad.source}})
        until(lambda: router.scheduler.num_live == 2, "the failing request to join mid-generation")
        rounds.release()
        text += "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        with pytest.raises(openai.InternalServerError) as info:
            failing.result()
    assert text == alone, "the other request's output is unchanged"
    jsonschema.validate(json.loads(text), SCHEMA)
    error = error_of(info.value)
    assert info.value.status_code == 500 and error["code"] == "structured_outputs_failed"
    assert "structured outputs failed on the target worker" in error["message"]
    assert "simulated tokenizer mismatch" in error["message"]
    assert any(rows == 2 and len(failed) == 1 for rows, failed in batches), f"one batch held both rows: {batches}"
    _wait_released(broker, router)


def test_a_grammar_the_draft_cannot_compile_fails_its_request_only(served, monkeypatch):
    client, broker, router = served
    bad = GrammarSpec("regex", "[0-9]{5}")
    _fail_compiling(monkeypatch, broker.cores["draft"].proposer.grammars.compiler, bad, "draft-side failure")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="tiny", prompt="Number:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"regex": bad.source}})
    error = error_of(info.value)
    assert error["code"] == "structured_outputs_failed" and "on the draft worker: draft-side failure" in error["message"]
    ok = client.completions.create(model="tiny", prompt="Number:", max_tokens=10, temperature=0,
                                   extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", ok.choices[0].text), "the draft worker serves the next grammar"
    _wait_released(broker, router)


def test_worker_cores_answer_a_failed_grammar_per_row_and_remember_it(served, monkeypatch):
    """The typed per-row failure (messages.RowFailure) of both workers: the failing row has no verdict and no
    drafts, its neighbour's are those it gets alone, and the sequence's later calls (which carry no grammar) fail
    too until it is released."""
    _, broker, router = served
    target, draft = broker.cores["target"], broker.cores["draft"]
    bad, good = GrammarSpec("regex", "[0-9]{7}"), GrammarSpec("regex", "[a-z]{7}")
    _fail_compiling(monkeypatch, target.grammars.compiler, bad, "no")
    _fail_compiling(monkeypatch, draft.proposer.grammars.compiler, bad, "no")
    prompt = router.tokenizer("Word:")["input_ids"]

    def delta(seq_id, spec, start=0, tokens=prompt):
        if start:
            return SeqDelta(seq_id, start, list(tokens))
        return first_delta(seq_id, tokens, SamplingParams(grammar=spec), 7)

    alone = VerifyResult.from_wire(target.verify([VerifyCall(delta("alone", good), []).wire()])).verdicts[0]
    both = VerifyResult.from_wire(target.verify([VerifyCall(delta("x", bad), []).wire(),
                                                 VerifyCall(delta("y", good), []).wire()]))
    assert both.verdicts[0] is None and list(both.failed) == [0] and both.failed[0].code == "structured_outputs_failed"
    assert both.verdicts[1] == alone
    later = VerifyResult.from_wire(target.verify([VerifyCall(delta("x", None, len(prompt), []), []).wire()]))
    assert list(later.failed) == [0], "its next call, without the grammar, fails too: never unconstrained"

    drafted = DraftResult.from_wire(draft.propose([DraftCall(delta("x", bad), 3).wire(),
                                                   DraftCall(delta("y", good), 3).wire()]))
    assert list(drafted.failed) == [0] and drafted.drafts[0] == [] and len(drafted.drafts[1]) == 3
    assert re.fullmatch("[a-z]+", router.tokenizer.decode(drafted.drafts[1]))
    again = DraftResult.from_wire(draft.propose([DraftCall(delta("x", None, len(prompt), []), 3).wire()]))
    assert list(again.failed) == [0]
    for core in (target, draft):
        core.release(["x", "y", "alone"])
    fresh = VerifyResult.from_wire(target.verify([VerifyCall(delta("x", good), []).wire()]))
    assert not fresh.failed, "released: the id starts clean"
    target.release(["x"])


def test_workers_and_router_build_the_grammar_table_at_start_up(byte_model_dirs, tiny_model_dirs):
    """Not in the first constrained round; and a tokenizer llguidance cannot read (the tiny WordPiece one) is an
    explicit error: a 400 at the router, a failed row (never an unconstrained one) at a worker."""
    config = tiny_config(byte_model_dirs, speculation={"num_speculative_tokens": 3})
    broker = LocalBroker(config)
    router = Router(config, broker)
    for compiler in (broker.cores["target"].grammars.compiler, broker.cores["draft"].proposer.grammars.compiler,
                     router.grammars):
        assert compiler.stats.tokenizer_seconds > 0 and compiler.stats.compiles == 0

    tiny = tiny_config(tiny_model_dirs)
    broker = LocalBroker(tiny)
    with http_server(Router(tiny, broker)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="w5 w9", max_tokens=5,
                                      extra_body={"structured_outputs": {"regex": "w[0-9]"}})
    assert error_of(info.value)["code"] == "structured_outputs_unavailable"
    target = broker.cores["target"]
    assert "cannot read this model's tokenizer" in str(target.grammars.compiler.unavailable)
    call = VerifyCall(first_delta("s", [5, 9], SamplingParams(grammar=GrammarSpec("regex", "a")), 7), [])
    failed = VerifyResult.from_wire(target.verify([call.wire()])).failed
    assert "cannot read this model's tokenizer" in failed[0].message


def test_a_long_prompts_chunk_reports_the_failure_too(byte_model_dirs, monkeypatch):
    """A prompt read one chunk a round (prompt_chunks.PromptChunks) meets the target's grammar in its first chunk:
    that call's failure ends the request as well."""
    config = tiny_config(byte_model_dirs, speculation={"num_speculative_tokens": 3}, runner={"prefill_chunk": 16})
    broker = LocalBroker(config)
    router = Router(config, broker)
    bad = GrammarSpec("regex", "[0-9]{3}")
    _fail_compiling(monkeypatch, broker.cores["target"].grammars.compiler, bad, "chunk-time failure")
    with http_server(router) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="chunk-time failure"):
            client.completions.create(model="tiny", prompt="A prompt long enough to be read in several chunks of sixteen bytes each:",
                                      max_tokens=5,
                                      extra_body={"structured_outputs": {"regex": bad.source}})
    assert router.scheduler.stats.prefill_chunks == 1, "it ended at its first chunk, not after reading the prompt"
    _wait_released(broker, router)
