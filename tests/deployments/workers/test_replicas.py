"""The Draft/Target replicas' own logic without a cluster: lease accounting against the KV-cache capacity."""

import asyncio
import concurrent.futures
import threading
import time

from deployments.router.admission import LeaseRefused
from deployments.transport.messages import LeaseInfo
from deployments.workers.replicas import _LeasedReplica, detached_call


class _Ref:
    """Stands in for a Ray ObjectRef: `future()` resolves with `answer()` after `delay` s (never, with None), or
    once `gate` is set."""

    def __init__(self, answer=lambda: None, delay: float | None = 0.0, gate: threading.Event | None = None) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        if gate is not None:
            threading.Thread(target=lambda: gate.wait(60) and self._future.set_result(answer()), daemon=True).start()
        elif delay is not None:
            threading.Timer(delay, lambda: self._future.set_result(answer())).start()

    def future(self) -> concurrent.futures.Future:
        return self._future


class _Worker:
    """A model worker whose `release.remote()` is awaited by the replica; records what it released. Its releases
    reach it once `arrive` is set (at once, unless a test clears it to look at a release on its way)."""

    def __init__(self) -> None:
        self.released, self.sent = [], []
        self.release = self
        self.arrive = threading.Event()
        self.arrive.set()

    def remote(self, seq_ids):
        self.sent.append(seq_ids)
        return _Ref(lambda: self.released.extend(seq_ids), gate=self.arrive)


async def until_sent(worker: _Worker) -> None:
    """Until the replica has sent a release to `worker` (the timeout only turns a hang into a failure)."""
    deadline = time.monotonic() + 60
    while not worker.sent:
        assert time.monotonic() < deadline, "no release was sent"
        await asyncio.sleep(0.001)


def test_a_replica_refuses_leases_past_its_capacity_and_frees_the_slot_once_the_worker_released():
    replica, worker = _LeasedReplica(), _Worker()
    replica.capacity = 1
    worker.arrive.clear()  # the release reaches the worker when the test says

    async def go():
        first = replica._hold("a", [worker], "endpoint")
        grant = await first.__anext__()
        refused = [item async for item in replica._hold("b", [worker], "endpoint")]
        held = asyncio.ensure_future(first.__anext__())  # the lease stays open until the router cancels it
        await asyncio.sleep(0)
        held.cancel()
        await until_sent(worker)
        releasing = (list(worker.released), replica.leases)  # the release is on its way to the worker
        worker.arrive.set()
        await asyncio.gather(held, return_exceptions=True)
        released = (list(worker.released), replica.leases)
        third = replica._hold("c", [worker], "endpoint")
        again = await third.__anext__()
        return grant, refused, releasing, released, again, replica.leases

    grant, refused, releasing, released, again, leases = asyncio.run(go())
    assert grant == LeaseInfo(replica.replica_id, [worker], "endpoint", None)
    assert refused == [LeaseRefused(replica.replica_id, 1, 1)], "refused, and the refusal ends the stream"
    assert releasing == ([], 1), "the slot stays taken until the worker has released the sequence"
    assert released == (["a"], 0)
    assert again.replica == replica.replica_id and leases == 1, "the freed slot is leased again"


def test_an_unbounded_replica_never_refuses():
    replica = _LeasedReplica()

    async def go():
        holds = [replica._hold(f"s{i}", [_Worker()], "e") for i in range(5)]
        return [await hold.__anext__() for hold in holds], replica.leases

    grants, leases = asyncio.run(go())
    assert all(isinstance(g, LeaseInfo) for g in grants) and leases == 5


class _ReleasingWorker(_Worker):
    """Also answers `released_ago` from the release times a test sets (time.monotonic() values)."""

    def __init__(self) -> None:
        super().__init__()
        self.released_at: dict[str, float] = {}
        self.released_ago = self._AgoCall(self)
        self.release_stale = self._AgoCall(self, stale=True)

    class _AgoCall:
        def __init__(self, worker, stale=False):
            self.worker, self.stale = worker, stale

        def remote(self, seq_ids, *args):
            if self.stale:
                return _Ref(lambda: [])
            now = time.monotonic()
            return _Ref(lambda: {s: now - self.worker.released_at[s] for s in seq_ids if s in self.worker.released_at})


def test_the_sweep_closes_a_lease_whose_sequence_was_released_after_it_began(monkeypatch):
    """A lease whose generator never reaches its `finally` (it is left suspended, as seen under load) is closed once
    its worker says the sequence was released after the lease was granted; an older release (before a re-lease) and
    young leases are left alone, and the abandoned generator's `finally`, should it run later, changes nothing."""
    import deployments.workers.replicas as replicas

    monkeypatch.setattr(replicas, "RECLAIM_AFTER_S", 0.0)
    replica, worker = _LeasedReplica(), _ReleasingWorker()
    replica.capacity = 2

    async def go():
        worker.released_at["b"] = time.monotonic() - 60  # a sequence released a minute before its re-lease
        abandoned, relet = replica._hold("a", [worker], "e"), replica._hold("b", [worker], "e")
        await abandoned.__anext__()
        await relet.__anext__()
        refused = [item async for item in replica._hold("c", [worker], "e")]
        # both leases granted 30 s ago (a margin no pause of a busy machine reaches: the sweep's bound on when a
        # release happened is the worker's `ago` from the call's start); b's sequence was released 60 s before its
        # grant, a's now
        for lease in replica._open:
            lease.started -= 30.0
        worker.released_at["a"] = time.monotonic()  # the router's direct release, at the request's end
        replica._sweep(worker)
        await replica._sweeping
        after_sweep = (replica.leases, replica.reclaimed, sorted(replica.ledger.held))
        third = replica._hold("c", [worker], "e")
        granted = await third.__anext__()
        await abandoned.aclose()  # the late `finally`: the lease is closed already
        return refused, after_sweep, granted, replica.leases

    refused, after_sweep, granted, leases = asyncio.run(go())
    assert isinstance(refused[0], LeaseRefused)
    assert after_sweep == (1, 1, ["b"]), "a's lease closed; b's (released before it was granted) kept"
    assert isinstance(granted, LeaseInfo)
    assert leases == 2, "b and c: a's late finally did not count its lease off a second time"
    assert "a" not in worker.released, "a closed lease's late finally sends no second release"


def test_young_leases_are_not_checked(monkeypatch):
    import deployments.workers.replicas as replicas

    assert replicas.RECLAIM_AFTER_S >= 1.0
    monkeypatch.setattr(replicas, "RECLAIM_AFTER_S", 3600.0)  # young whatever pause a busy machine makes here
    replica, worker = _LeasedReplica(), _ReleasingWorker()

    async def go():
        await replica._hold("a", [worker], "e").__anext__()
        worker.released_at["a"] = time.monotonic() + 10  # released "after" the lease; but the lease is young
        replica._sweep(worker)
        return replica._sweeping, replica.leases

    sweeping, leases = asyncio.run(go())
    assert sweeping is None and leases == 1


def test_a_release_that_never_answers_still_ends_the_lease(monkeypatch):
    """Seen under load: the worker's answer to a lease's release never came back, and each such lease stayed counted
    until the replica refused every new lease as full. The lease is counted off after RELEASE_WAIT_S."""
    import deployments.workers.replicas as replicas

    monkeypatch.setattr(replicas, "RELEASE_WAIT_S", 0.05)

    class _Silent:
        def __init__(self):
            self.release = self

        def remote(self, seq_ids):
            return _Ref(delay=None)  # never answers

    replica = _LeasedReplica()
    replica.capacity = 1

    async def go():
        hold = replica._hold("a", [_Silent()], "e")
        await hold.__anext__()
        held = asyncio.ensure_future(hold.__anext__())
        await asyncio.sleep(0)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        return replica.leases, await replica._hold("b", [_Silent()], "e").__anext__()

    leases, again = asyncio.run(go())
    assert leases == 0 and isinstance(again, LeaseInfo)


RAY_REPORT = """The actor died because of an error raised in its creation task, ray::DraftWorkerCore.__init__() (pid=7)
  File "deployments/workers/base.py", line 190, in startup_errors
    raise error from exc
deployments.errors.StartupError: Draft worker cannot start: the KV-cache budget (0.000 GiB) does not hold one \
sequence: raise kv_cache_gib / kv_cache_fraction or lower max_model_len"""


def test_a_workers_startup_error_is_raised_as_itself_and_other_failures_as_ray_raised_them(monkeypatch):
    import pytest
    import ray

    from deployments.errors import StartupError
    from deployments.workers import replicas

    def fail_with(text):
        def get(refs):
            raise ray.exceptions.RayError(text)
        return get

    monkeypatch.setattr(replicas.ray, "get", fail_with(RAY_REPORT))
    with pytest.raises(StartupError) as raised:
        replicas.started(["ref"])
    assert str(raised.value) == ("Draft worker cannot start: the KV-cache budget (0.000 GiB) does not hold one "
                                 "sequence: raise kv_cache_gib / kv_cache_fraction or lower max_model_len")
    assert raised.value.__cause__ is None and raised.value.__suppress_context__, "no dead-actor report chained on"
    monkeypatch.setattr(replicas.ray, "get", fail_with("The actor died unexpectedly: node lost"))
    with pytest.raises(ray.exceptions.RayError, match="node lost"):
        replicas.started(["ref"])
    monkeypatch.setattr(replicas.ray, "get", lambda refs: ["stats"])
    assert replicas.started(["ref"]) == ["stats"]


def test_a_worker_call_is_submitted_outside_the_calling_task_and_a_cancel_of_that_task_never_reaches_it():
    """Ray cancels a cancelled task's calls with it; a lease's release is submitted from another thread (no parent
    task) and shielded, so cancelling the lease's `finally` leaves the call to the worker alone."""
    submitted, refs = [], []

    class _Method:
        def remote(self, *args):
            submitted.append((threading.get_ident(), args))
            refs.append(_Ref(delay=None))
            return refs[-1]

    async def go():
        waiting = asyncio.ensure_future(detached_call(_Method(), ["a"], timeout_s=60))
        deadline = time.monotonic() + 60  # only turns a hang into a failure
        while not refs:  # the call is submitted: the cancel below comes while it is awaited
            assert time.monotonic() < deadline, "the call was never submitted"
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return waiting.cancelled(), threading.get_ident()

    cancelled, loop_thread = asyncio.run(go())
    assert cancelled and submitted[0][1] == (["a"],)
    assert submitted[0][0] != loop_thread, "submitted from an executor thread"
    assert not refs[0].future().cancelled(), "the worker's call is not cancelled with its caller"
