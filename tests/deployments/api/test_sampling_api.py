"""vLLM's sampling parameters through the official `openai` client against the in-process app (router, scheduler
and the real worker cores over real HTTP): each has an observable effect, and a bad value is a 400 naming it."""

from __future__ import annotations

import pytest

from deployments.router.router import Router
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, http_server, tiny_config

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
EOS = 1


@pytest.fixture(scope="module")
def client(tiny_model_dirs):
    from openai import OpenAI

    config = tiny_config(tiny_model_dirs)
    router = Router(config, LocalBroker(config))
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    with http_server(router) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)


def complete(client, max_tokens=16, temperature=0.0, **fields):
    """A greedy completion of PROMPT_IDS; vLLM's own fields go in extra_body, as vLLM's users send them."""
    openai_fields = {k: fields.pop(k) for k in ("logit_bias", "presence_penalty", "frequency_penalty", "seed")
                     if k in fields}
    return client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=max_tokens, temperature=temperature,
                                     extra_body={"ignore_eos": True, "speculative": {"k": 3, "adaptive": False},
                                                 **fields}, **openai_fields)


def token_ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]  # the tiny tokenizer's words are w2 .. w63


def test_logit_bias_forces_a_token_and_bans_another(client):
    forced = complete(client, logit_bias={"17": 100})
    assert token_ids(forced.choices[0].text) == [17] * 16
    plain = complete(client)
    banned = int(plain.choices[0].text.split()[0][1:])
    other = complete(client, logit_bias={str(banned): -100})
    assert banned not in token_ids(other.choices[0].text) and other.choices[0].text != plain.choices[0].text


def test_a_large_frequency_and_presence_penalty_prevent_repeats(client):
    plain = token_ids(complete(client, max_tokens=24).choices[0].text)
    assert len(set(plain)) < len(plain), "the check can fail: unpenalised, this prompt's text repeats a token"
    penalised = token_ids(complete(client, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0)
                          .choices[0].text)  # (a special token among them has no text)
    assert len(set(penalised)) == len(penalised) > 20


def test_repetition_penalty_keeps_prompt_and_output_tokens_from_returning(client):
    out = token_ids(complete(client, max_tokens=24, repetition_penalty=1000.0).choices[0].text)
    assert len(set(out)) == len(out) and not set(out) & set(PROMPT_IDS)


def test_min_p_one_is_greedy_at_any_temperature(client):
    greedy = complete(client).choices[0].text
    assert complete(client, temperature=1.0, min_p=1.0).choices[0].text == greedy
    assert complete(client, temperature=1.0, seed=3).choices[0].text != greedy, "the check can fail"


def test_min_tokens_holds_off_eos_and_stop_token_ids_stop(client):
    eos_forced = {"logit_bias": {str(EOS): 100}, "ignore_eos": False}
    held = complete(client, min_tokens=5, **eos_forced)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6
    assert complete(client, **eos_forced).usage.completion_tokens == 1
    stopped = complete(client, logit_bias={"17": 100}, stop_token_ids=[17])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == "", "the stop token's text is left out (vLLM)"
    shown = complete(client, logit_bias={"17": 100}, stop_token_ids=[17], include_stop_str_in_output=True)
    assert shown.choices[0].text == "w17"


def test_include_stop_str_in_output_and_skip_special_tokens(client):
    words = complete(client).choices[0].text.split()
    stop = words[3]
    assert stop not in words[:3]
    cut = complete(client, stop=[stop]).choices[0].text
    kept = complete(client, stop=[stop], include_stop_str_in_output=True).choices[0].text
    assert cut == " ".join(words[:3]) + " " and kept == cut + stop
    pad_forced = {"logit_bias": {"0": 100}, "max_tokens": 3}  # <pad>, a special token
    assert complete(client, **pad_forced).choices[0].text == ""
    assert complete(client, skip_special_tokens=False, **pad_forced).choices[0].text == "<pad> <pad> <pad>"


@pytest.mark.parametrize("fields,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"64": 1}}, "logit_bias"),
    ({"logit_bias": {"w7": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # over max_tokens
    ({"stop_token_ids": [70]}, "stop_token_ids"),
])
def test_bad_values_are_a_400_naming_the_parameter(client, fields, param):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as caught:
        complete(client, **fields)
    error = caught.value.response.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_chat_completions_take_the_fields_too(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"17": 100},
                                          extra_body={"ignore_eos": True, "min_tokens": 2, "stop_token_ids": [18]})
    assert chat.choices[0].message.content == "w17 w17 w17 w17"
