"""deployments/transport/messages.py: a chained round's re-packing lives with the wire forms it re-packs."""

import numpy as np

from deployments.transport.messages import (DraftResult, VerifyCall, VerifyResult, calls_with_drafts,
                                             chained_reply)
from engine.request.delta import SeqDelta, first_delta
from engine.spec.accept import Verdict


def _seq(seq_id: str) -> SeqDelta:
    return first_delta(seq_id, [1, 2, 3])


def test_a_chained_round_s_drafts_go_into_the_member_rows_only():
    calls = [VerifyCall(_seq(s), [], None, ahead=True).wire() for s in ("a", "b", "c")]
    proposal = (np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32))
    draft = DraftResult([[7, 8], [9]], {0: proposal}, 0.01)
    filled = [VerifyCall.from_wire(call) for call in calls_with_drafts(calls, [2, 0], draft)]
    assert [call.draft for call in filled] == [[9], [], [7, 8]]
    assert filled[2].proposal is proposal and filled[0].proposal is None and filled[1].proposal is None
    assert [call.seq.seq_id for call in filled] == ["a", "b", "c"] and all(call.ahead for call in filled)


def test_a_chained_reply_carries_the_draft_without_its_proposals():
    proposal = (np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32))
    draft = DraftResult([[5]], {0: proposal}, 0.02)
    verified = VerifyResult([Verdict([5, 6], 1, None)], 0.03, cached_tokens={0: 2}, ahead_rows=1).wire()
    reply = VerifyResult.from_wire(chained_reply(verified, draft))
    assert reply.draft == draft.without_proposals() and reply.draft.drafts == [[5]] and reply.draft.proposals == {}
    assert reply.verdicts[0].tokens == [5, 6] and reply.cached_tokens == {0: 2} and reply.ahead_rows == 1
