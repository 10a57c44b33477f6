"""deployments/api/ (routes.py, generation.py, request_models.py) through the official `openai` client against the
served app (uvicorn, in-process replicas): parameters it does not implement are refused by name, content parts,
logprobs, n > 1, prompt lists, echo, /tokenize (refusing tools as chat does) and /detokenize, /v1/models."""

from __future__ import annotations

import httpx
import openai
import pytest

from deployments.api.params import NEUTRAL
from deployments.router.router import Router
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, http_server, tiny_config

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_model_dirs):
    router = Router(tiny_config(tiny_model_dirs), LocalBroker(tiny_config(tiny_model_dirs)))
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    with http_server(router) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), router


def _refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


@pytest.mark.parametrize("extra,param", [
    ({"best_of": 3}, "best_of"),
    ({"suffix": "w7"}, "suffix"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"no_such_parameter": 1}, "no_such_parameter"),
])
def test_completion_parameters_not_implemented_are_refused_by_name(served, extra, param):
    _, client, _ = served
    body = _refusal(lambda: client.completions.create(model="tiny", prompt=PROMPT_IDS, extra_body=extra,
                                                      max_tokens=4))
    assert body["param"] == param and param in body["message"] and body["code"] == "unsupported_parameter"


def test_chat_parameters_not_implemented_are_refused_by_name(served):
    _, client, _ = served
    msgs = [{"role": "user", "content": "w5 w6"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    refused = _refusal(lambda: client.chat.completions.create(model="tiny", messages=msgs, tools=tools))
    assert (refused["param"], refused["code"]) == ("tools", "tools_unsupported")  # its template reads no tools
    assert _refusal(lambda: client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=4,
                                                      extra_body={"tools": tools}))["param"] == "tools"
    assert _refusal(lambda: client.chat.completions.create(model="tiny", messages=msgs, store=True))[
        "param"] == "store"
    legacy = msgs + [{"role": "assistant", "content": "w7", "function_call": {"name": "f", "arguments": "{}"}}]
    assert _refusal(lambda: client.chat.completions.create(model="tiny", messages=legacy))[
        "param"] == "messages[1].function_call"


def test_neutral_values_of_unimplemented_parameters_are_accepted(served):
    """Clients send defaults; the unused value of every listed parameter changes nothing."""
    _, client, _ = served
    plain = client.completions.create(model="tiny", prompt=PROMPT_IDS, **GREEDY)
    neutral = {name: values[-1] for name, values in NEUTRAL.items()}
    same = client.completions.create(model="tiny", prompt=PROMPT_IDS, temperature=0, max_tokens=12,
                                     extra_body={"ignore_eos": True, "user": "u1", **neutral})
    assert same.choices[0].text == plain.choices[0].text


def test_content_as_text_parts_equals_content_as_a_string(served):
    _, client, _ = served
    as_string = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5 w6\nw7", "name": "ann"}], **GREEDY)
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]}], **GREEDY)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    image = [{"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    body = _refusal(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": image}], max_tokens=4))
    assert body["param"] == "messages[0].content[1].type" and "image_url" in body["message"]


def _check_greedy_logprobs(chosen: float, top: list[tuple[str, float]], token: str, n: int) -> None:
    assert len(top) == n
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    # greedy decoding emits the most likely token: it heads the top list, with its own log-probability
    assert top[0][0] == token and top[0][1] == pytest.approx(chosen, abs=1e-5) and chosen <= 0.0


def test_chat_logprobs_streamed_and_not(served):
    _, client, router = served
    msgs = [{"role": "user", "content": "w5 w6"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=3, **GREEDY)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 12
    for e in entries:
        _check_greedy_logprobs(e.logprob, [(t.token, t.logprob) for t in e.top_logprobs], e.token, 3)
        assert bytes(e.bytes).decode() == e.token
    assert " ".join(e.token for e in entries) == full.choices[0].message.content  # the tiny tokenizer's words
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=3,
                                                stream=True, **GREEDY):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries]
    without = client.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
    assert without.choices[0].logprobs is None
    assert _refusal(lambda: client.chat.completions.create(model="tiny", messages=msgs, top_logprobs=2))[
        "param"] == "top_logprobs"


def test_completion_logprobs_in_the_legacy_shape(served):
    _, client, _ = served
    r = client.completions.create(model="tiny", prompt=PROMPT_IDS, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        _check_greedy_logprobs(chosen, ranked[:2], token, 2)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]


def test_n_choices_are_independent_samples_that_repeat_with_a_seed(served):
    _, client, _ = served
    sampled = {"temperature": 1.0, "max_tokens": 10, "seed": 7, "extra_body": {"ignore_eos": True}}
    three = client.completions.create(model="tiny", prompt=PROMPT_IDS, n=3, **sampled)
    again = client.completions.create(model="tiny", prompt=PROMPT_IDS, n=3, **sampled)
    one = client.completions.create(model="tiny", prompt=PROMPT_IDS, n=1, **sampled)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(three.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] == one.choices[0].text and len(set(texts)) == 3
    assert three.usage.prompt_tokens == len(PROMPT_IDS) and three.usage.completion_tokens == 30
    finished: dict[int, str] = {}
    text: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=PROMPT_IDS, n=3, stream=True, **sampled):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"} and [text[i] for i in range(3)] == texts


def test_a_list_of_prompts_gives_each_its_own_choices(served):
    _, client, _ = served
    prompts = ["w5 w6 w7", "w9 w10"]
    both = client.completions.create(model="tiny", prompt=prompts, n=2, **GREEDY)
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in both.choices}
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model="tiny", prompt=prompt, **GREEDY).choices[0].text
        assert by_index[2 * p] == by_index[2 * p + 1] == alone  # greedy: the n choices agree
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [9, 10]], **GREEDY)
    assert [c.text for c in sorted(ids.choices, key=lambda c: c.index)] == [by_index[0], by_index[2]]


def test_echo_puts_the_prompt_before_the_completion(served):
    _, client, _ = served
    plain = client.completions.create(model="tiny", prompt="w5 w6 w7", **GREEDY).choices[0].text
    echoed = client.completions.create(model="tiny", prompt="w5 w6 w7", echo=True, **GREEDY).choices[0].text
    assert echoed == "w5 w6 w7" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="w5 w6 w7", echo=True, stream=True, **GREEDY))
    assert streamed == echoed
    # the prompt comes back as sent, not as its tokens decode (two spaces here, one after decoding)
    spaced = client.completions.create(model="tiny", prompt="w5  w6 w7", echo=True, **GREEDY).choices[0].text
    assert spaced == "w5  w6 w7" + plain
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], echo=True, **GREEDY).choices[0].text
    assert ids == "w5 w6 w7" + plain


def test_tokenize_detokenize_and_models(served):
    url, client, router = served
    tok = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "w5 w6 w7"}).json()
    assert tok["tokens"] == [5, 6, 7] and tok["count"] == 3 and tok["max_model_len"] == 256
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "w5"}]}).json()
    assert chat["tokens"] == list(router.tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5"}], add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"])
    assert httpx.post(f"{url}/detokenize", json={"tokens": [5, 6, 7]}).json() == {"prompt": "w5 w6 w7"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "w5"}).status_code == 404
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == 256


def test_tokenize_refuses_tools_its_template_never_reads_as_chat_does(served):
    """One tools rendering for chat and /tokenize: a template that never reads `tools` gets chat's 400 on both,
    never a prompt silently rendered without them."""
    url, client, _ = served
    msgs = [{"role": "user", "content": "w5 w6"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = _refusal(lambda: client.chat.completions.create(model="tiny", messages=msgs, tools=tools))
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": msgs, "tools": tools})
    assert tokenized.status_code == 400 and tokenized.json() == {"error": chat}
    assert chat["code"] == "tools_unsupported"
    without = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": msgs, "tools": []})
    assert without.status_code == 200  # no tools: nothing to render
