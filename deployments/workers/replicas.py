"""Draft and Target Serve deployments: thin owners of model worker actors, leased to requests.

A replica starts its worker actors inside the placement group Serve reserved for it (bundle 0 is the replica
itself; bundles 1.. are the workers; for the target, one per tensor-parallel rank, STRICT_PACK). A request leases
a replica with a *streaming* call that stays open while the request lives: Serve counts it as an ongoing request,
so autoscaling follows the number of live sequences, and scale-down waits for it. The lease's first item names the
replica, its workers' actor handles (for cancels) and the endpoint of the workers' direct channel
(deployments/transport/channel.py): every round's calls travel that channel, not Ray (a chained round costs a fraction
of one DeploymentHandle call or actor call beside busy workers: bench/RESULTS.md). Closing the lease frees the
sequence's caches at once.

A replica whose workers' KV caches have a fixed number of sequence slots (`kv_capacity` in their stats) leases no
more sequences than that: past it a lease is answered with `admission.LeaseRefused`, and the request waits for a
slot (deployments/router/admission.py). `ready()` answers once the constructor has run (deployments/api/readiness.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.autoscaling import LIVE_SEQUENCES
from deployments.errors import StartupError
from deployments.router.admission import min_capacity, refusal
from deployments.transport.messages import LeaseInfo
from deployments.workers.actors import ray_actor_classes
from deployments.workers.lease_ledger import STALE_AFTER_S, LeaseLedger
from engine.factory import EngineConfig

logger = logging.getLogger("ray.serve")

HEALTH_PING_TIMEOUT_S = 20.0  # a worker not answering a ping this long fails the health check (Serve's own: 30 s)
# A model call running longer than this is taken as hung. Pings are answered on the workers' "control" thread, so
# a long call (a batched prefill under load) does not fail the check; past this bound the worker is replaced.
# Above the collectives' own timeout (target.join_process_group: 60 s on CPU, 30 s on GPU by default).
STUCK_CALL_S = 180.0


def started(refs):
    """`ray.get(refs)` of a replica's start-up calls to its workers; a worker's StartupError (a configuration it
    cannot start with) raised as itself, one line naming what to change, instead of Ray's report of a dead actor
    with the worker's traceback inside: Serve's status then shows that line (readiness.py puts it in /health)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as exc:
        error = StartupError.found_in(str(exc))
        if error is None:
            raise
        raise error from None


def _in_my_bundle(index: int) -> dict:
    if not ray.is_initialized():  # outside a cluster (unit tests): asking for the group would start a Ray instance
        return {}
    pg = get_current_placement_group()
    if pg is None:  # running outside a placement group (tests with local mode): plain scheduling
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=True)}


# OpenMP threads of torch's CPU kernels spin-wait after each parallel region (libgomp: up to a few ms by default)
# before they sleep. Within a forward the next region comes at once, but a round hands the cores from the draft
# worker to the target worker and back, and the idle side's spinning threads then compete with the busy side's. A
# short spin (about 0.1 ms) keeps the first and ends the second: fixed K=3 at one stream served more tokens/s
# here (four alternating server runs, bench/RESULTS.md). An operator's own setting on the node wins.
DEFAULT_GOMP_SPINCOUNT = "20000"


def worker_env() -> dict[str, str]:
    """Environment variables of the model worker processes."""
    return {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", DEFAULT_GOMP_SPINCOUNT)}


def _actor_options(worker: dict, index: int, name: str) -> dict:
    # named (unique) so operators and tests can find a replica's workers with `ray list actors`
    return {"num_cpus": worker["num_cpus"], "num_gpus": worker["num_gpus"], "resources": worker["resources"],
            "max_concurrency": 1, "name": f"{name}-{uuid.uuid4().hex[:12]}", **_in_my_bundle(index),
            "runtime_env": {"env_vars": worker_env()}}


# A lease open this long is checked against its worker's releases (`_LeasedReplica._reclaim_released`).
RECLAIM_AFTER_S = 5.0
# A lease's end waits this long for its worker to confirm the release, then counts the lease off anyway (a guard:
# the calls that never returned were cancelled with their leases, which `detached_call` prevents).
RELEASE_WAIT_S = 10.0


GUARD_METRIC = "specserve_guard_firings"  # Prometheus: {guard="..."}, each firing of a guard that should not fire


def _guard_counter():
    """The replica's counter of guard firings (None outside a Ray worker: unit tests)."""
    try:
        from ray.serve.metrics import Counter

        return Counter(GUARD_METRIC, description="Firings of the lease guards, each a bug caught: a sequence that "
                       "outlived its lease (swept), a lease whose sequence was released while it stayed open "
                       "(reclaimed), a release its worker never confirmed (release_timeout)", tag_keys=("guard",))
    except Exception:
        return None


async def detached_call(method, *args, timeout_s: float | None = None):
    """`method.remote(*args)` awaited (for at most `timeout_s`), submitted outside the calling task.

    `ray.cancel` is recursive: a cancelled actor task's calls are cancelled with it. Serve cancels a lease's call
    when its router ends the lease, so the worker release that the lease's `finally` submits was cancelled too, and
    a cancelled call to a threaded actor left the actor's queue for this caller waiting for it: every later call
    from the replica to its worker (releases, the sweep's, stats) hung while the worker sat idle, each lease ended
    only at RELEASE_WAIT_S, and Serve counted those leases as ongoing until the replica was full (what the sequence
    leak and the autoscaling overshoot came from). A call submitted from an executor thread has no parent task;
    the shield keeps a second cancel of the caller from reaching it."""
    loop = asyncio.get_running_loop()
    ref = await loop.run_in_executor(None, lambda: method.remote(*args))
    return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ref.future())), timeout_s)


@dataclass(eq=False)  # one per grant, compared by identity
class _OpenLease:
    seq_id: str
    started: float  # time.monotonic() when granted
    ending: bool = False  # its router has ended it (the cancel arrived); the worker's release may still be running


class _LeasedReplica:
    def __init__(self) -> None:
        self._open: set[_OpenLease] = set()  # leases granted and not closed yet
        self.reclaimed = 0  # leases closed by the sweep (`_reclaim_released`)
        self.ledger = LeaseLedger()  # the sequences leased here, and the sweep of those that outlive their leases
        self._sweeping: asyncio.Task | None = None
        self._replica_id = None
        self._guards = _guard_counter()
        self.costs: dict | None = None  # measured at start when the router's K plan needs them (engine/spec/plan.py)
        self.capacity: int | None = None  # sequences its workers' KV caches hold; None: unbounded

    @property
    def leases(self) -> int:
        """Leases granted and not closed yet (what the replica refuses new ones by, against its capacity)."""
        return len(self._open)

    @property
    def live_sequences(self) -> int:
        """Leases whose routers have not ended them: the load the autoscaler follows (deployments/autoscaling.py)."""
        return sum(1 for lease in self._open if not lease.ending)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics, read by deployments/autoscaling.live_sequences_policy."""
        return {LIVE_SEQUENCES: float(self.live_sequences)}

    @property
    def replica_id(self) -> str:
        if self._replica_id is None:
            from ray import serve

            try:
                self._replica_id = serve.get_replica_context().replica_id.unique_id
            except Exception:  # outside Serve (unit tests)
                self._replica_id = f"local-{id(self)}"
        return self._replica_id

    async def ready(self) -> bool:
        """The readiness probe: Serve routes a call here only once the constructor has run, that is once the workers
        have loaded their models and opened their channels (deployments/api/readiness.py)."""
        return True

    async def _hold(self, seq_id: str, workers: list, endpoint):
        refused = refusal(self.replica_id, self.leases, self.capacity)
        if refused is not None:  # no free KV-cache slot: the router waits and tries again (admission.py)
            yield refused
            return
        lease = self._open_lease(seq_id)
        try:
            yield LeaseInfo(self.replica_id, workers, endpoint, self.costs)
            await asyncio.Event().wait()  # until the router cancels the lease
        finally:
            lease.ending = True  # no longer load, though its slot stays taken until the worker has released it
            if lease in self._open:  # (closed already: reclaimed, see `_reclaim_released`)
                try:  # a target's rank 0 passes it on to the other ranks, in order
                    await detached_call(workers[0].release, [seq_id], timeout_s=RELEASE_WAIT_S)
                except asyncio.TimeoutError:
                    self._guard_fired("release_timeout", 1)
                    logger.error("replica %s: the release of %s on its worker did not answer within %.0f s; the "
                                 "lease is counted off anyway (the router released the sequence itself if its "
                                 "last round came back; else the sweep frees it)", self.replica_id, seq_id,
                                 RELEASE_WAIT_S)
                except Exception:  # the worker is gone (and the replica with it)
                    pass
                finally:  # the slot is free once the worker has released the sequence: a new one cannot find it taken
                    self._close_lease(lease)

    def _guard_fired(self, guard: str, count: int) -> None:
        if self._guards is not None:
            self._guards.inc(count, tags={"guard": guard})

    def _open_lease(self, seq_id: str) -> "_OpenLease":
        lease = _OpenLease(seq_id, time.monotonic())
        self._open.add(lease)
        self.ledger.leased(seq_id)
        return lease

    def _close_lease(self, lease: "_OpenLease") -> None:
        if lease in self._open:
            self._open.remove(lease)
            self.ledger.ended(lease.seq_id)

    def _sweep(self, worker) -> None:
        """Start the sweep (sequences that outlived their leases, then leases that outlived their sequences) in a
        task of its own, so the health check never waits behind a long model call."""
        if self._sweeping is not None and not self._sweeping.done():
            return
        candidates = self.ledger.candidates()
        now = time.monotonic()
        open_leases = [lease for lease in self._open if now - lease.started >= RECLAIM_AFTER_S]
        if candidates or open_leases:
            self._sweeping = asyncio.get_running_loop().create_task(
                self._sweep_once(worker, candidates, open_leases))

    async def _sweep_once(self, worker, candidates: list[str], open_leases: list["_OpenLease"]) -> None:
        try:
            if candidates:
                await self._release_stale(worker, candidates)
            if open_leases:
                await self._reclaim_released(worker, open_leases)
        except Exception:  # the worker is gone: the health check says so
            return

    async def _release_stale(self, worker, candidates: list[str]) -> None:
        """Release, on the workers, sequences that outlived their leases (lease_ledger.py)."""
        stale = await detached_call(worker.release_stale, candidates, STALE_AFTER_S)
        if stale:
            self.ledger.swept += len(stale)
            self._guard_fired("swept", len(stale))
            logger.error("replica %s: released %d sequence(s) its workers held after their leases ended: %s",
                         self.replica_id, len(stale), stale[:8])

    async def _reclaim_released(self, worker, open_leases: list["_OpenLease"]) -> None:
        """Close leases whose sequences a router has released on the worker since they were granted.

        The router releases a finished request's Target sequence itself (leases.RayTargetLease.release) and then
        cancels the lease, whose `finally` here closes it. Served under load (bench/RESULTS.md), a
        replica went on refusing leases as full for a minute while it held none: its lease count had kept leases
        that Serve logged as CANCELLED, whose `finally` had not run (the README's "Limits"). A lease whose sequence
        was released on the worker after the lease began is over, whatever its generator does, so it is closed
        here, its slot counted free again; if its `finally` runs later, it finds the lease closed.
        """
        sent = time.monotonic()
        ago = await detached_call(worker.released_ago, sorted({lease.seq_id for lease in open_leases}))
        # the worker measured `ago` after `sent`: each release happened after `sent - ago` (no shared clock needed)
        over = [lease for lease in open_leases if lease in self._open and lease.seq_id in ago
                and sent - ago[lease.seq_id] > lease.started]
        for lease in over:
            self._close_lease(lease)
        if over:
            self.reclaimed += len(over)
            self._guard_fired("reclaimed", len(over))
            logger.error("replica %s: closed %d lease(s) whose sequences were released while the leases stayed "
                         "open: %s", self.replica_id, len(over), [lease.seq_id for lease in over][:8])

    async def _check(self, workers: list) -> None:
        """Serve's health check: raises at once if a worker died, if one does not answer a ping within
        HEALTH_PING_TIMEOUT_S, or if one has been in a single model call for over STUCK_CALL_S.

        Async, so a worker busy in a long call never blocks the replica's event loop (its leases); a dead worker's
        error arrives immediately, even while a surviving rank is still blocked in a collective with it.
        """
        pings = [asyncio.ensure_future(w.ping.options(concurrency_group="control").remote()) for w in workers]
        done, pending = await asyncio.wait(pings, timeout=HEALTH_PING_TIMEOUT_S,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                raise RuntimeError(f"a model worker of replica {self.replica_id} died: {task.exception()}")
            if task.result() > STUCK_CALL_S:
                raise TimeoutError(f"a model worker of replica {self.replica_id} has been in one call for "
                                   f"{task.result():.0f} s (over {STUCK_CALL_S:.0f} s): taken as hung")
        if pending:
            raise TimeoutError(f"{len(pending)} model worker(s) of replica {self.replica_id} did not answer a "
                               f"ping within {HEALTH_PING_TIMEOUT_S:.0f} s")
        self._sweep(workers[0])  # a target's rank 0 passes the releases on to the other ranks

    def _stop(self, workers: list) -> None:
        # The workers are owned by this replica's actor and die with it; killing them here as well frees a broken
        # tensor-parallel group's survivors at once when Serve stops the replica gracefully.
        for w in workers:
            if w is None:
                continue
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone
                pass


class DraftServer(_LeasedReplica):
    """Draft deployment: one draft worker actor per replica."""

    def __init__(self, engine_config: EngineConfig, worker: dict) -> None:
        super().__init__()
        draft_cls, _ = ray_actor_classes()
        options = _actor_options(worker, 1, "specserve-draft")
        self.worker_name = options["name"]
        self.worker = draft_cls.options(**options).remote(engine_config, worker["torch_threads"], worker["calibrate"],
                                                          worker["concurrent_workers"], worker["niceness"])
        # fail fast (missing model file, bad tokenizer, a KV budget too small) at start-up
        stats = started(self.worker.stats.remote())
        self.costs, self.capacity = stats["costs"], stats.get("kv_capacity")
        self.endpoint = started(self.worker.start_channel.remote())

    async def lease(self, seq_id: str):
        async for item in self._hold(seq_id, [self.worker], self.endpoint):
            yield item

    async def stats(self) -> dict:
        return {"replica": self.replica_id, "leases": self.leases, "swept": self.ledger.swept,
                "reclaimed": self.reclaimed, "worker": self.worker_name,
                "namespace": ray.get_runtime_context().namespace, **(await self.worker.stats.remote())}

    async def check_health(self) -> None:
        await self._check([self.worker])

    def __del__(self) -> None:
        self._stop([getattr(self, "worker", None)])


class TargetServer(_LeasedReplica):
    """Target deployment: `tp_size` worker actors, one per bundle, joined in a torch.distributed group."""

    def __init__(self, engine_config: EngineConfig, worker: dict, tp_size: int) -> None:
        super().__init__()
        _, target_cls = ray_actor_classes()
        self.workers = [
            target_cls.options(**_actor_options(worker, 1 + rank, f"specserve-target-r{rank}")).remote(
                engine_config, rank, tp_size, worker["torch_threads"], worker["concurrent_workers"],
                worker["niceness"])
            for rank in range(tp_size)
        ]
        if tp_size > 1:
            address, port = started(self.workers[0].rendezvous_address.remote())
            started([w.init_distributed.remote(address, port) for w in self.workers])
        started([w.ping.remote() for w in self.workers])
        if worker["calibrate"]:
            self.costs = started([w.calibrate.remote(max(engine_config.num_speculative_tokens, 1),
                                                     engine_config.widest_verify) for w in self.workers])[0]
        endpoints = ray.get([w.start_channel.remote() for w in self.workers])
        if tp_size > 1:  # from now on ranks 1.. take their calls from rank 0 alone
            ray.get(self.workers[0].connect_peers.remote(endpoints[1:]))
        self.endpoint = endpoints[0]
        ranks = ray.get([w.stats.remote() for w in self.workers])
        self.capacity = min_capacity([rank.get("kv_capacity") for rank in ranks])

    async def lease(self, seq_id: str):
        async for item in self._hold(seq_id, self.workers, self.endpoint):
            yield item

    async def stats(self) -> dict:
        ranks = await asyncio.gather(*[w.stats.remote() for w in self.workers])
        return {"replica": self.replica_id, "leases": self.leases, "swept": self.ledger.swept,
                "reclaimed": self.reclaimed, "kv_capacity": self.capacity, "ranks": list(ranks)}

    async def check_health(self) -> None:
        await self._check(self.workers)

    def __del__(self) -> None:
        self._stop(getattr(self, "workers", []))
