"""One group's round (deployments/router/round.py) on the in-process replicas: its typed result, a dead target, and
the same tokens as the in-process engine (one planner, one accept step: engine/spec/plan.py, engine/spec/accept.py)."""

import asyncio

import pytest

from deployments.router.live import LiveRequest
from deployments.router.round import RoundResult
from deployments.router.router import Router
from engine.factory import build_engine
from engine.request.sampling import SamplingParams
from engine.request.sequence import SequenceState
from engine.spec.policy import AcceptanceTracker
from tests.deployments.conftest import LocalBroker, tiny_config
from tests.deployments.router.test_router import PROMPT_IDS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _rows(router, broker, n, params=GREEDY):
    async def lease(i):
        seq = SequenceState.create(f"r{i}", PROMPT_IDS, params, 3, 256, frozenset(), router.tokenizer)
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


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_k=20, max_tokens=24, seed=11, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_the_served_round_and_the_in_process_engine_emit_the_same_tokens(tiny_model_dirs, params):
    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    [row] = _rows(router, broker, 1, params)
    round_ = router.scheduler.round
    served = []
    while not row.seq.finish_reason:
        served += asyncio.run(round_.run([row], round_.plan([row], 0, 1))).outputs[0].new_token_ids

    engine = build_engine(config.engine_config())
    [done] = engine.generate([PROMPT_IDS], params)
    assert done.token_ids == served and len(served) == params.max_tokens
    assert done.stats.as_dict() == row.seq.stats.as_dict(), "the same rounds: drafts and acceptances by position"
    assert row.seq.stats.num_drafts > 0 and row.seq.stats.num_accepted_tokens > 0


def test_a_row_the_plan_left_plain_decodes_ahead_unless_its_next_round_may_probe(tiny_model_dirs):
    """decode-ahead's guess (deployments/router/round.py): a row without drafts this round is plain next round too,
    except in the round before its first chance to probe (PROBE_EVERY rounds without drafts), where it is not marked;
    past that chance (a probe the load did not allow) it is marked again."""
    from engine.spec.policy import PROBE_EVERY

    config = tiny_config(tiny_model_dirs)
    broker = LocalBroker(config)
    router = Router(config, broker)
    [live] = _rows(router, broker, 1)
    round_ = router.scheduler.round
    marked = {}
    for count in range(PROBE_EVERY + 3):
        live.tracker.rounds_without_drafts = count
        marked[count] = round_._decodes_ahead(live, 0)
    assert [c for c, m in marked.items() if not m] == [PROBE_EVERY - 1], marked
    assert not round_._decodes_ahead(live, 2), "a row that drafts this round is not decoded ahead"
