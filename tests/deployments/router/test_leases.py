"""The Ray lease broker's fault handling, with worker channels served in-process and stand-in Serve handles."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from deployments.errors import ChainBroken, DraftGone, Overloaded, ReplicaGone, TensorParallelBroken
from deployments.router import leases
from deployments.router.leases import RayDraftLease, RayLeaseBroker, RayTargetLease
from deployments.transport.channel import ChannelRelay, ChannelServer
from deployments.transport.client import AsyncChannels
from deployments.transport.messages import DraftCall, DraftResult, LeaseInfo, Method, VerifyCall, VerifyResult
from deployments.transport.wire import Endpoint
from engine.request.delta import SeqDelta, first_delta
from engine.request.grammar import GrammarSpec
from engine.request.sampling import SamplingParams
from engine.spec.accept import TokenLogprob, Verdict


def _verify_call(seq_id: str = "s") -> VerifyCall:
    return VerifyCall(first_delta(seq_id, [5, 6]), [])


def _rank0(behaviour: str = "ok") -> ChannelServer:
    """Rank 0's channel: `verify` answers, fails like a broken tensor-parallel group, or fails plainly."""
    def release(seq_ids):
        released.extend(seq_ids)

    def verify(calls):
        if behaviour == "broken":
            raise TensorParallelBroken("tensor-parallel rank 0 of 2: all_reduce failed: connection closed by peer")
        if behaviour == "error":
            raise ValueError("a bad call")
        return VerifyResult([Verdict([0, len(calls)], 1) for _ in calls], 0.5).wire()

    released: list[str] = []
    server = ChannelServer({Method.VERIFY: verify, Method.RELEASE: release}, "127.0.0.1", bind_host="127.0.0.1")
    server.released = released
    return server


class FakeStream:
    def __init__(self, first) -> None:
        self.first, self.cancelled = first, False

    async def __anext__(self):
        if isinstance(self.first, BaseException):
            raise self.first
        return self.first

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A Serve handle whose lease streams answer with the given replicas in turn (the last one repeats)."""

    def __init__(self, replicas: list) -> None:
        self.replicas, self.streams = replicas, []
        self.lease = _Lease(self)

    def options(self, stream: bool):
        assert stream
        return self


class _Lease:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def remote(self, seq_id):
        h = self.handle
        first = h.replicas[min(len(h.streams), len(h.replicas) - 1)]
        h.streams.append(FakeStream(first))
        return h.streams[-1]


def _lease(endpoint, dead=None) -> RayTargetLease:
    return RayTargetLease(FakeStream(None), LeaseInfo("r", [], endpoint), AsyncChannels(),
                          set() if dead is None else dead, "seq-1")


def test_release_frees_the_sequence_through_the_channel_and_a_gone_worker_is_no_error():
    server = _rank0()
    lease = _lease(server.endpoint)
    asyncio.run(lease.release())
    assert server.released == ["seq-1"]
    server.close()
    gone = _lease(Endpoint("127.0.0.1", server.endpoint.port, server.endpoint.secret))
    asyncio.run(asyncio.wait_for(gone.release(), 30))  # nothing to free: the worker's caches went with it


def test_rank_zero_answers_through_its_channel_and_a_plain_error_stays_an_error():
    server, failing = _rank0(), _rank0("error")
    dead = set()
    answer = asyncio.run(_lease(server.endpoint, dead).verify([_verify_call(), _verify_call()]))
    assert answer == VerifyResult([Verdict([0, 2], 1)] * 2, 0.5), "read back from the wire as a VerifyResult"
    with pytest.raises(ValueError, match="a bad call"):  # the replica is fine: the caller's problem, not a failure
        asyncio.run(_lease(failing.endpoint, dead).verify([]))
    assert dead == set()


@pytest.mark.parametrize("how", ["broken group", "rank 0 gone"])
def test_a_failed_replica_ends_the_verify_with_replica_gone_and_is_remembered(how):
    server = _rank0("broken")
    endpoint = server.endpoint
    if how == "rank 0 gone":
        server.close()  # nothing listens there any more
        endpoint = Endpoint("127.0.0.1", endpoint.port, endpoint.secret)
    dead = set()
    with pytest.raises(ReplicaGone, match="replica r failed"):
        asyncio.run(asyncio.wait_for(_lease(endpoint, dead).verify([]), 30))
    assert dead == {"r"}, "the broker remembers the failed replica"


def test_a_target_lease_skips_a_failed_replica_until_a_healthy_one_answers(monkeypatch):
    monkeypatch.setattr(leases, "LEASE_RETRY_PAUSE_S", 0.001)
    broken = LeaseInfo("old", [], None)
    healthy = LeaseInfo("new", [], _rank0().endpoint)
    handle = FakeHandle([broken, broken, ActorDiedError(), healthy])
    broker = RayLeaseBroker(None, handle)
    broker.dead_replicas.add("old")
    lease = asyncio.run(broker.target("seq"))
    assert lease.key == "new" and lease.endpoint == healthy.endpoint
    assert [s.cancelled for s in handle.streams] == [True, True, False, False], "broken leases were given back"


def test_a_target_lease_gives_up_with_replica_gone_after_the_deadline(monkeypatch):
    monkeypatch.setattr(leases, "LEASE_RETRY_PAUSE_S", 0.001)
    monkeypatch.setattr(leases, "LEASE_RETRY_TIMEOUT_S", 0.05)
    broker = RayLeaseBroker(None, FakeHandle([LeaseInfo("old", [], None)]))
    broker.dead_replicas.add("old")
    with pytest.raises(ReplicaGone, match="no healthy replica"):
        asyncio.run(broker.target("seq"))


def test_draft_leases_are_not_retried_and_back_pressure_is_overload():
    broker = RayLeaseBroker(FakeHandle([LeaseInfo("d", [], None)]),
                            FakeHandle([BackPressureError(num_queued_requests=3, max_queued_requests=2)]))
    broker.dead_replicas.add("d")
    assert asyncio.run(broker.draft("seq")).key == "d"  # the round finds it dead and decodes plainly
    with pytest.raises(Overloaded):
        asyncio.run(broker.target("seq"))


def _chain_workers(how: str):
    """A draft worker whose `propose_chained` hands its draft to a target rank 0, or fails as `how` says; returns
    the two endpoints the router leases."""
    gone = ChannelServer({}, "127.0.0.1", bind_host="127.0.0.1")
    gone.close()  # nothing listens there any more

    def verify_chained(calls, members, draft):
        if how == "target broken":
            raise TensorParallelBroken("tensor-parallel rank 0 of 2: all_reduce failed")
        draft = DraftResult.from_wire(draft)
        assert draft.proposals == ({0: "proposal"} if calls[1][0][3] else {}), "the proposal reached the target"
        return VerifyResult([Verdict([len(calls)], 0) for _ in members], 0.0, draft.without_proposals()).wire()

    target = ChannelServer({Method.VERIFY_CHAINED: verify_chained}, "127.0.0.1", bind_host="127.0.0.1")
    relay = ChannelRelay()

    def propose_chained(calls, verify_calls, members, route):
        if how == "relay fails":  # the target is unreachable from the draft worker (not from the router)
            route = (gone.endpoint.wire(), route[1])
        drafts = [list(call[0][2]) for call in calls]  # "drafts": each call's tokens
        proposals = {0: "proposal"} if calls[0][0][3] else {}  # a sampled row's compact proposal goes along
        relay.send(route, Method.VERIFY_CHAINED, verify_calls, members, DraftResult(drafts, proposals, 0.0).wire())

    draft = ChannelServer({Method.PROPOSE_CHAINED: propose_chained}, "127.0.0.1", bind_host="127.0.0.1")
    return (gone.endpoint if how == "draft gone" else draft.endpoint,
            gone.endpoint if how == "target gone" else target.endpoint)


@pytest.mark.parametrize("how, error, blamed", [
    ("ok", None, set()),
    ("draft gone", DraftGone, {"d"}),
    ("target gone", ReplicaGone, {"t"}),
    ("target broken", ReplicaGone, {"t"}),
    ("relay fails", ChainBroken, set()),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chained_round_names_the_replica_that_failed(how, error, blamed, temperature):
    draft_endpoint, target_endpoint = _chain_workers(how)
    channels, dead = AsyncChannels(), set()
    draft = RayDraftLease(FakeStream(None), LeaseInfo("d", [], draft_endpoint), channels, dead, "s")
    target = RayTargetLease(FakeStream(None), LeaseInfo("t", [], target_endpoint), channels, dead, "s")
    seq = first_delta("b", [7, 8], SamplingParams(temperature=temperature))
    draft_calls = [DraftCall(seq, 3)]
    run = draft.chain(draft_calls, target, [_verify_call("a"), VerifyCall(seq, [])], [1])
    if error is None:  # the calls travel in their wire form; the draft's tokens come back through the target
        assert asyncio.run(run) == VerifyResult([Verdict([2], 0)], 0.0, DraftResult([[7, 8]], {}, 0.0))
    else:
        with pytest.raises(error) as info:
            asyncio.run(asyncio.wait_for(run, 30))
        assert error is not ReplicaGone or not isinstance(info.value, DraftGone), "the target is named, not the draft"
    assert dead == blamed


def test_calls_cross_the_channel_as_plain_tuples_and_come_back_equal():
    import pickle

    import numpy as np

    seq = SeqDelta("r", 4, [9, 10])  # a continuation: tokens only
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=123, logprobs=3, min_p=0.1,
                            presence_penalty=0.5, logit_bias=((7, 2.0),), min_tokens=2,
                            grammar=GrammarSpec("regex", "[ab]+"))
    first = first_delta("s", [9, 10], params, eos_ids=(1,))  # a sequence's first call carries its settings
    proposal = (np.zeros((2, 4), np.int32), np.full((2, 4), 0.25, np.float32))
    for call, cls in ((DraftCall(seq, 3), DraftCall), (VerifyCall(seq, [11, 12]), VerifyCall),
                      (DraftCall(first, 3), DraftCall), (VerifyCall(first, []), VerifyCall)):
        wire = call.wire()
        assert b"deployments" not in pickle.dumps(wire, protocol=5), "no class of the transport travels"
        assert cls.from_wire(pickle.loads(pickle.dumps(wire, protocol=5))) == call
    assert b"engine" not in pickle.dumps(VerifyCall(seq, [11, 12]).wire(), protocol=5), "a continuation: builtins only"
    back = VerifyCall.from_wire(pickle.loads(pickle.dumps(VerifyCall(seq, [11, 12], proposal).wire(), protocol=5)))
    np.testing.assert_array_equal(back.proposal[1], proposal[1])
    back = DraftCall.from_wire(pickle.loads(pickle.dumps(DraftCall(first, 3).wire(), protocol=5)))
    assert back.seq.settings == first.settings and back.seq.settings.params.min_p == 0.1
    assert back.seq.settings.min_tokens_ids == (1,) and back.seq.settings.params.grammar.source == "[ab]+"


def test_results_cross_the_channel_as_plain_tuples_and_come_back_equal():
    import pickle

    import numpy as np

    proposal = (np.zeros((2, 5), np.int32), np.full((2, 5), 0.2, dtype=np.float32))
    draft = DraftResult([[3, 4], []], {0: proposal}, 0.01)
    logprobs = [TokenLogprob(-0.5, ((7, -0.5), (2, -1.5)))]
    verify = VerifyResult([Verdict([7], 0, logprobs), Verdict([3, 4, 9], 2)], 0.02, draft)
    for result, cls in ((draft, DraftResult), (verify, VerifyResult), (DraftResult([], {}, 0.0, True), DraftResult)):
        wire = pickle.dumps(result.wire(), protocol=5)
        assert b"deployments" not in wire, "no class travels, only builtins (and numpy arrays)"
        back = cls.from_wire(pickle.loads(wire))
        assert type(back) is cls and back.seconds == result.seconds
    back = VerifyResult.from_wire(pickle.loads(pickle.dumps(verify.wire(), protocol=5)))
    assert back.verdicts == verify.verdicts and back.draft.drafts == [[3, 4], []] and not back.draft.cancelled
    assert isinstance(back.verdicts[0].logprobs[0], TokenLogprob)
    np.testing.assert_array_equal(back.draft.proposals[0][1], proposal[1])
    assert DraftResult.from_wire(DraftResult([], {}, 0.0, True).wire()).cancelled


def test_a_full_replica_s_refusal_is_replica_full_and_the_stream_is_given_back():
    from deployments.errors import ReplicaFull
    from deployments.router.admission import LeaseRefused

    handle = FakeHandle([LeaseRefused("t", 4, 4)])
    with pytest.raises(ReplicaFull, match="replica t holds 4"):
        asyncio.run(RayLeaseBroker(None, handle).target("seq"))
    assert [s.cancelled for s in handle.streams] == [True], "tried once (the scheduler waits), stream given back"


class _ReadyHandle:
    """A Serve handle whose `ready.remote()` answers True, or never (a deployment with no running replica)."""

    def __init__(self, answers: bool) -> None:
        self.answers, self.responses = answers, []
        self.ready = self

    def remote(self):
        response = _Response(self.answers)
        self.responses.append(response)
        return response


class _Response:
    def __init__(self, answers: bool) -> None:
        self.answers, self.cancelled = answers, False

    def __await__(self):
        if not self.answers:
            yield from asyncio.sleep(3600).__await__()
        return True

    def cancel(self) -> None:
        self.cancelled = True


def test_a_readiness_probe_asks_the_deployment_and_cancels_a_call_nobody_answers():
    up, starting = _ReadyHandle(True), _ReadyHandle(False)
    broker = RayLeaseBroker(starting, up)
    assert asyncio.run(broker.ready("target", 1.0)) is True and not up.responses[0].cancelled
    assert asyncio.run(broker.ready("draft", 0.01)) is False
    assert starting.responses[0].cancelled, "the held call is cancelled, not left queued at Serve"
    assert asyncio.run(RayLeaseBroker(None, up).ready("draft", 1.0)) is False, "no Draft deployment"
