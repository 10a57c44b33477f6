"""The router's round loop (deployments/router/scheduler.py) without a cluster: chunked prefill of long prompts, by the
target and the draft alike."""

import asyncio

from deployments.router.router import Router
from tests.deployments.conftest import LocalBroker, tiny_config
from tests.deployments.router.test_router import client, plain_reference

LONG_PROMPT = [(7 * t) % 60 + 2 for t in range(90)]


def test_a_long_prompt_is_prefilled_in_chunks_between_rounds_with_the_same_output(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs, runner={"prefill_chunk": 16})
    broker = LocalBroker(config)
    router = Router(config, broker)
    fed = {"target": [], "draft": []}  # tokens each call feeds, per row

    def spy_on(kind, runner):
        forward = runner.forward

        def spy(seq_ids, new_tokens, num_logits):
            fed[kind].extend(len(t) for t in new_tokens)
            return forward(seq_ids, new_tokens, num_logits)

        runner.forward = spy

    spy_on("target", broker.cores["target"].runner)
    spy_on("draft", broker.cores["draft"].proposer.runner)

    async def go():
        async with client(router) as c:
            short = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 30, "temperature": 0, "ignore_eos": True}))
            await asyncio.sleep(0)
            long = await c.post("/v1/completions", json={
                "model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            return long.json(), (await short).json()

    long, short = asyncio.run(go())
    assert long["choices"][0]["text"] == plain_reference(tiny_model_dirs, LONG_PROMPT, 12)
    assert short["choices"][0]["text"] == plain_reference(tiny_model_dirs, [5, 6, 7], 30)
    # 90 tokens: chunks of 16 until at most 16 are left, which go with the first round's verify
    assert router.scheduler.stats.prefill_chunks == 5
    k = config.speculation.num_speculative_tokens
    assert max(fed["target"]) <= 16 + k + 1, "no call fed more than one chunk (plus a round's drafts) for one row"
    # the draft reads the long prompt in the same chunks (with the target's), not all at once when it first drafts
    assert router.scheduler.stats.draft_prefill_chunks == 5
    assert max(fed["draft"]) <= 16 + k + 1, fed["draft"]


def test_long_prompts_on_one_target_send_their_chunks_in_one_call_with_their_own_outputs(tiny_model_dirs):
    """Two long prompts admitted together: each round's chunks of both travel in one verify call (the worker's
    runner can then prefill them in shared forwards), and each output equals the prompt's plain decoding."""
    config = tiny_config(tiny_model_dirs, model={"draft": "ngram"}, runner={"prefill_chunk": 16})
    broker = LocalBroker(config)
    router = Router(config, broker)
    rows_per_call = []
    core = broker.cores["target"]
    verify = core.verify

    def spy(calls):
        rows_per_call.append(len(calls))
        return verify(calls)

    core.verify = spy
    other = [(11 * t) % 50 + 3 for t in range(70)]

    async def go():
        async with client(router) as c:
            answers = await asyncio.gather(*(c.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                for p in (LONG_PROMPT, other)))
            return [a.json()["choices"][0]["text"] for a in answers]

    texts = asyncio.run(go())
    assert texts == [plain_reference(tiny_model_dirs, LONG_PROMPT, 8), plain_reference(tiny_model_dirs, other, 8)]
    assert router.scheduler.stats.prefill_chunks == 5 + 4  # 90 and 70 tokens in chunks of 16
    assert 2 in rows_per_call[:4], f"the two prompts' chunks shared a call: {rows_per_call}"


def test_the_n_choices_of_one_request_prefill_their_prompt_once(tiny_model_dirs):
    """n = 3 over a 40-token prompt: the three sequences reach the target worker in one call, whose runner computes
    the prompt for one row and copies it to the others (engine/models/static/prefill_plan.shared_heads); the greedy
    choices all equal plain decoding."""
    config = tiny_config(tiny_model_dirs, model={"draft": "ngram"})
    broker = LocalBroker(config)
    router = Router(config, broker)
    runner = broker.cores["target"].runner
    rows_fed = []
    run = runner._run
    runner._run = lambda ids, *args, **kw: rows_fed.append(tuple(ids.shape)) or run(ids, *args, **kw)
    prompt = [(5 * t) % 60 + 2 for t in range(40)]

    async def go():
        async with client(router) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "n": 3,
                                                      "temperature": 0, "ignore_eos": True})
            return [choice["text"] for choice in r.json()["choices"]]

    texts = asyncio.run(go())
    assert texts == [plain_reference(tiny_model_dirs, prompt, 6)] * 3
    prefill_rows = sum(rows for rows, width in rows_fed if width > 16)  # the prompts' heads (39 tokens each)
    assert prefill_rows == 1, f"forwards (rows, width): {rows_fed}"
