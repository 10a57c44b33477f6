"""Prompt logprobs through the official `openai` client against the in-process app (router, scheduler and the real
worker cores over real HTTP): `echo` with `logprobs` puts the prompt's tokens first in the completion's logprobs,
vLLM's `prompt_logprobs` comes back in its shape (per choice for completions, per response for chat), and both equal
a direct computation from the same tiny target's forward (log_softmax of the logits at position t-1 for token t),
streamed or not, prefilled whole or in chunks."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from deployments.router.router import Router
from engine.models.loading import load_causal_lm, resolve
from tests.deployments.conftest import TINY_CHAT_TEMPLATE, LocalBroker, http_server, tiny_config

PROMPT = [5, 6, 7, 8, 9, 10, 40, 33]
LONG_PROMPT = [(7 * t + 3) % 60 + 2 for t in range(70)]  # 5 chunks of 16
GREEDY = {"temperature": 0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


def serve(dirs, **runner):
    config = tiny_config(dirs, model={"target_dtype": "float32"}, runner=runner)
    router = Router(config, LocalBroker(config))
    router.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return router, http_server(router)


@pytest.fixture(scope="module")
def served(tiny_model_dirs):
    router, server = serve(tiny_model_dirs)
    with server as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), router


@pytest.fixture(scope="module")
def chunked(tiny_model_dirs):
    """A server that prefills prompts 16 tokens a round (chunked prefill)."""
    router, server = serve(tiny_model_dirs, prefill_chunk=16)
    with server as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), router


@pytest.fixture(scope="module")
def direct(tiny_model_dirs):
    """[L-1, V] per prompt: log_softmax of the target's logits at position t-1, for tokens t = 1 .. L-1."""
    model = load_causal_lm(resolve(str(tiny_model_dirs[0])), "float32")

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    return logprobs


def check_vllm_shape(entries, prompt, want, n):
    """vLLM's `prompt_logprobs`: None, then per token {id: {logprob, rank, decoded_token}}: the token itself with its
    rank, and the top n ranked 1..n."""
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        entry = {int(k): v for k, v in entries[t].items()}
        token, row = prompt[t], want[t - 1]
        assert entry[token]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token]["rank"] == 1 + int((row > row[token]).sum())
        assert entry[token]["decoded_token"] == f"w{token}"
        top = sorted((v["rank"], i) for i, v in entry.items() if i != token or v["rank"] <= n)[:n]
        assert [i for _, i in top] == row.topk(n).indices.tolist() and [r for r, _ in top] == list(range(1, n + 1))
        assert len(entry) == n + (token not in row.topk(n).indices.tolist())


def test_echo_with_logprobs_puts_the_prompts_logprobs_before_the_completions(served, direct):
    _, client, router = served
    piece = lambda i: router.tokenizer.decode([i])  # noqa: E731 (a token's own text: w5, </s>)
    plain = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, **GREEDY).choices[0]
    echoed = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, echo=True, **GREEDY).choices[0]
    lp, want, n = echoed.logprobs, direct(PROMPT), len(PROMPT)
    assert lp.tokens[:n] == [piece(t) for t in PROMPT] and lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "the first prompt token has no logprob"
    for t in range(1, n):
        row = want[t - 1]
        assert lp.token_logprobs[t] == pytest.approx(float(row[PROMPT[t]]), abs=1e-4)
        top3 = [piece(i) for i in row.topk(3).indices.tolist()]
        assert set(lp.top_logprobs[t]) == set(top3) | {piece(PROMPT[t])}, "the top 3 and the prompt token"
        ranked = sorted(lp.top_logprobs[t].items(), key=lambda kv: -kv[1])
        assert [piece for piece, _ in ranked[:3]] == top3
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == [sum(len(tok) for tok in lp.tokens[:i]) for i in range(len(lp.tokens))], \
        "cumulative from 0 over the prompt's tokens, then the completion's"
    assert echoed.text == "w5 w6 w7 w8 w9 w10 w40 w33" + plain.text
    # vLLM answers the prompt's logprobs in its own field too, with the echo's top n
    check_vllm_shape(echoed.to_dict()["prompt_logprobs"], PROMPT, want, 3)
    assert plain.to_dict()["prompt_logprobs"] is None


def test_echo_with_logprobs_streamed_equals_not_streamed(served):
    _, client, _ = served
    full = client.completions.create(model="tiny", prompt="w5 w6 w7 w30", logprobs=2, echo=True, n=2,
                                     **GREEDY)
    for choice in full.choices:
        text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(model="tiny", prompt="w5 w6 w7 w30", logprobs=2, echo=True, n=2,
                                               stream=True, **GREEDY):
            if chunk.choices and chunk.choices[0].index == choice.index:
                text += chunk.choices[0].text
                for key in merged:
                    merged[key] += getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs else []
        assert text == choice.text
        assert merged["tokens"] == choice.logprobs.tokens and merged["text_offset"] == choice.logprobs.text_offset
        assert merged["token_logprobs"][0] is None and merged["top_logprobs"][0] is None
        assert merged["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
        assert [sorted(t) for t in merged["top_logprobs"][1:]] == [sorted(t) for t in choice.logprobs.top_logprobs[1:]]


def test_vllms_prompt_logprobs_per_choice_of_completions_and_per_response_of_chat(served, direct):
    url, client, _ = served
    prompts = [PROMPT, [9, 12, 15, 2, 60]]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, temperature=0, max_tokens=4,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    for choice in r.choices:
        prompt = prompts[choice.index // 2]
        check_vllm_shape(choice.to_dict()["prompt_logprobs"], prompt, direct(prompt), 2)
        assert choice.logprobs is None, "prompt logprobs alone leave the completion's logprobs out"
    msgs = [{"role": "user", "content": "w5 w6"}, {"role": "user", "content": "w7"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=4,
                                          extra_body={"prompt_logprobs": 0})
    check_vllm_shape(chat.to_dict()["prompt_logprobs"], ids, direct(ids), 0)
    assert client.chat.completions.create(model="tiny", messages=msgs, **GREEDY).to_dict()["prompt_logprobs"] is None


def test_prompt_logprobs_with_stream_are_refused_as_vllm_refuses_them(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, stream=True, max_tokens=2,
                                  extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs" and "stream=True" in info.value.body["message"]
    zero = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0}))
    assert zero, "0 is accepted with a stream (vLLM's rule: only > 0 is refused)"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert info.value.body["param"] == "prompt_logprobs"


def test_prompt_logprobs_over_a_chunked_prefill_equal_the_unchunked(served, chunked, direct):
    _, whole_client, _ = served
    client, router = chunked
    before = router.scheduler.stats.prefill_chunks
    got = client.completions.create(model="tiny", prompt=LONG_PROMPT, logprobs=2, echo=True, **GREEDY).choices[0]
    assert router.scheduler.stats.prefill_chunks - before == 4, "the 70-token prompt went 16 tokens a round"
    want = whole_client.completions.create(model="tiny", prompt=LONG_PROMPT, logprobs=2, echo=True,
                                           **GREEDY).choices[0]
    assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
    assert got.logprobs.token_logprobs[0] is None and None not in got.logprobs.token_logprobs[1:]
    assert got.logprobs.token_logprobs[1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=1e-4)
    check_vllm_shape(got.to_dict()["prompt_logprobs"], LONG_PROMPT, direct(LONG_PROMPT), 2)


def test_a_target_lost_mid_prefill_rescores_the_prompt_on_its_replacement(chunked, direct):
    client, router = chunked
    broker, failures = router.scheduler.broker, router.scheduler.stats.replica_failures
    broker.fail_at_call["target"] = broker.calls["target"] + 3  # dies at the request's third prompt chunk
    got = client.completions.create(model="tiny", prompt=LONG_PROMPT, temperature=0, max_tokens=4,
                                    extra_body={"ignore_eos": True, "prompt_logprobs": 1}).choices[0]
    assert router.scheduler.stats.replica_failures == failures + 1 and broker.keys["target"] != "target-0"
    check_vllm_shape(got.to_dict()["prompt_logprobs"], LONG_PROMPT, direct(LONG_PROMPT), 1)
