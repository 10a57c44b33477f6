"""One group's round (deployments/group_round.py) on the in-process replicas: its typed result, and a dead target."""

import asyncio

from deployments.group_round import RoundResult
from deployments.live import LiveRequest
from deployments.router import Router
from engine.policy import AcceptanceTracker
from engine.sampling import SamplingParams
from engine.sequence import SequenceState
from tests.deployments.conftest import LocalBroker, tiny_config
from tests.deployments.test_router import PROMPT_IDS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _rows(router, broker, n):
    async def lease(i):
        seq = SequenceState.create(f"r{i}", PROMPT_IDS, GREEDY, 3, 256, frozenset(), router.tokenizer)
        live = LiveRequest(seq=seq, queue=asyncio.Queue(), target=await broker.target(f"r{i}"),
                           tracker=AcceptanceTracker())
        router.scheduler._live[seq.request_id] = live  # live, so the round delivers its outputs
        return live

    return [asyncio.run(lease(i)) for i in range(n)]


def test_a_chained_round_returns_what_it_drafted_accepted_and_emitted(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    rows = _rows(router, broker, 2)
    other_broker = LocalBroker(config)
    other = Router(config, other_broker)
    plain = _rows(other, other_broker, 1)[0]  # the reference: the same prompt in rounds without drafts
    round_ = router.scheduler.round

    result = asyncio.run(round_.run(rows, [3, 3]))
    assert isinstance(result, RoundResult) and result.chained and broker.chained == 1
    assert [len(d) for d in result.drafts] == [3, 3] and result.draft_compute > 0 and result.verify_compute > 0
    for live, out, accepted in zip(rows, result.outputs, result.accepted):
        assert 0 <= accepted <= 3 and len(out.new_token_ids) == accepted + 1
        assert live.queue.get_nowait() is out, "delivered to the request"
    reference = []
    while len(reference) < len(result.outputs[0].new_token_ids):  # plain decoding, one token a round
        reference += asyncio.run(other.scheduler.round.run([plain], [0])).outputs[0].new_token_ids
    assert result.outputs[0].new_token_ids == reference, "greedy: the drafts change nothing"
    assert router.scheduler.stats.spec.num_drafts == 2


def test_a_round_whose_target_dies_returns_none_and_its_rows_re_lease(tiny_model_dirs):
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    [row] = _rows(router, broker, 1)
    broker.fail_at_call["target"] = 1

    async def go():
        result = await router.scheduler.round.run([row], [0])
        reletting = row.reletting
        await asyncio.gather(*router.scheduler.recovery._relets)
        return result, reletting

    result, reletting = asyncio.run(go())
    assert result is None and reletting and router.scheduler.stats.replica_failures == 1
    assert not row.reletting and row.target.key == broker.keys["target"] != "target-0" and row.target_sent == 0, \
        "a new Target lease, and the sequence is sent again from token 0"
