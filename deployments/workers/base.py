"""What the draft and the target model workers share: the channel server on their one model thread, the busy
clock the health check reads, the committed tokens each sequence has sent, call counters, ping, stats and release.

Everything that touches a model or its caches runs on the worker's one model thread, the one that serves its
channel (`ChannelServer.call`), so calls take turns; Ray methods (set-up, statistics, health pings, cancels) reach
it through `ModelWorker.on_model_thread`. The workers call their model through engine/models/runner.py's Runner
protocol.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import socket
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from deployments.errors import StartupError
from deployments.transport.channel import ChannelServer
from deployments.transport.messages import Method
from deployments.transport.wire import Endpoint
from engine.factory import EngineConfig
from engine.models.cpu import bf16_products
from engine.models.loading import ModelLoadError
from engine.models.runner import KVBudgetError, KVCacheFull, Runner
from engine.request.delta import KnownSequences

RELEASES_REMEMBERED = 4096  # sequences whose release times a worker keeps (`released_ago`)

log = logging.getLogger(__name__)


def node_address() -> str:
    """The address other nodes reach this worker at: Ray's node IP inside a Ray worker, else the host name's."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class BusyClock:
    """How long the worker's current model call has been running, readable from another thread (the health check's
    ping runs on the "control" thread, so it answers while a long call computes instead of queueing behind it)."""

    def __init__(self) -> None:
        self._since: float | None = None

    def __enter__(self) -> None:  # `with clock:` around a model call (a class, not a generator: it runs every call)
        self._since = time.monotonic()

    def __exit__(self, *exc) -> None:
        self._since = None

    def seconds(self) -> float:
        since = self._since
        return 0.0 if since is None else time.monotonic() - since


def set_torch_threads(threads: int | None, concurrent_workers: int = 1) -> int:
    """Set torch's intra-op threads for this worker process and return the number.

    Ray starts workers with OMP_NUM_THREADS=1 unless told otherwise, which makes a CPU model run on one core. None
    means: this node's cores, shared among the workers that compute at the same time (the ranks of one
    tensor-parallel target, plus the draft when it drafts ahead during the verify; without that overlap draft
    and target take turns within a round, so each gets all cores).
    """
    if threads is None:
        threads = max(1, len(os.sched_getaffinity(0)) // concurrent_workers)
    torch.set_num_threads(threads)
    return threads


def set_thread_niceness(niceness: int | None) -> int:
    """Set the calling thread's scheduling niceness (Linux: per thread; threads it creates later, such as its OpenMP
    team, inherit it) and return the niceness it runs at. None leaves it.

    Ray starts worker processes at niceness 15, the router replicas and Serve's proxy included. On a CPU node those
    then share the cores with the model's compute threads as equals: a proxy streaming a chunk preempts one thread of
    a two-thread team, and the other spins at the next barrier. At 0 the compute threads run first and the others fill
    the gaps between steps (SmolLM2 bf16 on this project's 2-core machine, Target worker at 15 vs 0, alternating:
    more tokens/s at 0, at one stream and at eight; bench/RESULTS.md).
    Lowering it needs CAP_SYS_NICE (root has it); without, a warning says so and the thread keeps Ray's."""
    tid = threading.get_native_id()
    if niceness is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError as error:
            log.warning("model thread: cannot set niceness %d (%s; lowering it needs CAP_SYS_NICE), it stays %d",
                        niceness, error, os.getpriority(os.PRIO_PROCESS, tid))
    return os.getpriority(os.PRIO_PROCESS, tid)


def warm_up(runner: Runner, max_k: int, what: str, drafter=None) -> None:
    """Capture the static runner's CUDA graphs now (an early-exit drafter's steps too), or compile its step shapes
    (inductor, or its on-disk cache), logging progress, so the first requests do not wait for either."""
    if not getattr(runner, "compiled", False):
        return
    start = time.monotonic()
    shapes = runner.warm_up(max_k, progress=lambda message: log.info("%s runner: %s", what, message),
                            exit_layers=getattr(drafter, "exit_layers", None))
    log.info("%s runner: %d step shapes ready in %.1f s", what, shapes, time.monotonic() - start)


@contextlib.contextmanager
def cpu_startup_turn(config: EngineConfig):
    """One model worker at a time per node loads and measures its costs, when they compute on CPU.

    Cost measurements taken while another worker on the same cores loads a model or measures its own would
    be inflated, and the draft/verify ratio the K policy decides by would be wrong. A node-local file lock
    serializes these start-up phases (GPU workers do not share their compute, so they skip it).
    """
    if config.device != "cpu":
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "specserve-cpu-startup.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



def startup_error(role: str, exc: BaseException) -> StartupError | None:
    """`exc`, raised while a worker loads, warms up or measures its costs, as the configuration error it is (a
    StartupError naming what to change), or None when it is not one (a bug, a lost node: Serve's retries may help)."""
    what = f"{role.capitalize()} worker cannot start:"
    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, KVCacheFull):
        hint = "" if "max_num_seqs" in str(exc) else \
            " (raise runner.max_num_seqs or the KV-cache budget, kv_cache_gib / kv_cache_fraction)"
        return StartupError(f"{what} {exc}{hint}")
    if isinstance(exc, KVBudgetError):  # engine/models/kv_budget.plan_num_slots: says what to change
        return StartupError(f"{what} {exc}")
    if isinstance(exc, torch.OutOfMemoryError):
        return StartupError(f"{what} out of memory while loading or warming up ({str(exc).splitlines()[0]}): lower "
                            f"runner.kv_cache_fraction / kv_cache_gib or max_model_len, raise tp_size, or give the "
                            f"worker a device with more memory")
    if isinstance(exc, ModelLoadError):
        return StartupError(f"{what} {exc} (check model.target and model.draft: a local model directory, a .gguf "
                            f"file, or a model id in the local Hugging Face cache)")
    return None


@contextlib.contextmanager
def startup_errors(role: str):
    """Raise a configuration error met inside the block as one StartupError (`startup_error`); others pass as they
    are."""
    try:
        yield
    except Exception as exc:
        error = startup_error(role, exc)
        if error is None or error is exc:
            raise
        raise error from exc


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (as logging's last-resort handler does)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def show_startup_logs() -> None:
    """The project's INFO lines (the runner's step shapes, which operator computes bf16 products, grammar tables, the
    layers `self` drafts from) on this worker process's stderr, which Ray forwards to `serve run`'s output: Ray leaves
    Python's root logger at WARNING, where they would vanish."""
    for name in ("engine", "deployments.workers"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if not any(getattr(h, "specserve", False) for h in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler.specserve = True
            logger.addHandler(handler)


class ModelWorker:
    """The base of DraftWorkerCore and TargetWorkerCore (deployments/workers/draft.py): a channel served on the model
    thread with the worker's `handlers` plus "release", torch's threads, the busy clock, the known tokens and the
    counters. A subclass says which runner holds its sequences (`model_runner`) and what else a released sequence
    frees (`_forget`)."""

    def __init__(self, handlers: dict[str, Callable], torch_threads: int | None, concurrent_workers: int,
                 niceness: int | None = None) -> None:
        show_startup_logs()
        self._model = ChannelServer({**handlers, Method.RELEASE: self.release}, node_address())
        # before torch's threads exist: the model thread's OpenMP team is created by it, with its niceness
        self.niceness = self._model.call(set_thread_niceness, niceness)
        self.torch_threads = self._model.call(set_torch_threads, torch_threads, concurrent_workers)
        self.busy = BusyClock()
        self._known = KnownSequences()  # each sequence's committed tokens and settings (engine/request/delta.py)
        self._released_at: OrderedDict[str, float] = OrderedDict()  # seq -> time.monotonic() of its last release
        self.calls = 0  # model calls served
        self.rows = 0  # sequences in them, summed
        self.swept = 0  # sequences released by the sweep: each one outlived its lease (a leak caught)

    def model_runner(self) -> Runner | None:
        """The runner holding this worker's sequences (None before it is loaded)."""
        raise NotImplementedError

    def start_channel(self) -> Endpoint:
        """The endpoint of this worker's channel (deployments/transport/channel.py)."""
        return self._model.endpoint

    def on_model_thread(self, fn: Callable, *args):
        """Run `fn(*args)` on the model thread, in turn with the channel's calls."""
        return self._model.call(fn, *args)

    def later(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the model thread after the current call (its reply sent first)."""
        self._model.later(fn, *args)

    def _counted(self, rows: int) -> None:
        self.calls += 1
        self.rows += rows

    def release(self, seq_ids: list[str]) -> None:
        """Forget the sequences: their known tokens and caches (a lease ended)."""
        self._model.call(self._release, seq_ids)

    def _release(self, seq_ids: list[str]) -> None:
        now = time.monotonic()
        for seq_id in seq_ids:
            self._known.pop(seq_id)
            self._forget(seq_id)
            self._released_at[seq_id] = now
            self._released_at.move_to_end(seq_id)
        while len(self._released_at) > RELEASES_REMEMBERED:
            self._released_at.popitem(last=False)

    def released_ago(self, seq_ids: list[str]) -> dict[str, float]:
        """Seconds since each of `seq_ids` was last released here, for those released among the last
        RELEASES_REMEMBERED (the replicas' lease sweep (workers/replicas.py) closes leases whose sequences a router released)."""
        return self._model.call(self._released_ago, seq_ids)

    def _released_ago(self, seq_ids: list[str]) -> dict[str, float]:
        now = time.monotonic()
        return {seq_id: now - self._released_at[seq_id] for seq_id in seq_ids if seq_id in self._released_at}

    def _forget(self, seq_id: str) -> None:
        runner = self.model_runner()
        if runner is not None:
            runner.release(seq_id)

    def release_stale(self, seq_ids: list[str], idle_s: float) -> list[str]:
        """Release those of `seq_ids` (sequences whose leases have ended: the replicas' lease sweep (workers/replicas.py)) that this worker
        still holds and that no call has touched for `idle_s`; returns them."""
        return self._model.call(self._release_stale, seq_ids, idle_s)

    def _release_stale(self, seq_ids: list[str], idle_s: float) -> list[str]:
        runner, now = self.model_runner(), time.monotonic()
        stale = [seq_id for seq_id in seq_ids
                 if (seq_id in self._known.tokens or (runner is not None and runner.has(seq_id)))
                 and now - self._known.touched.get(seq_id, -math.inf) >= idle_s]
        if stale:  # on the model thread already, so it runs in this turn (a target's rank 0 passes it on)
            self.swept += len(stale)
            log.error("released %d sequence(s) that outlived their leases (a leak the sweep caught): %s", len(stale),
                      stale[:8])
            self.release(stale)
        return stale

    def stats(self) -> dict:
        runner = self.model_runner()
        live_ids = getattr(runner, "live_ids", None)
        return {"live_sequences": runner.num_live if runner else 0, "calls": self.calls, "rows": self.rows,
                "swept": self.swept,  # sequences the replica's sweep released here (each one a leak caught)
                "live_sequence_ids": sorted(live_ids())[:16] if live_ids else [],  # the first 16, for leak checks
                "kv_capacity": getattr(runner, "capacity", None) if runner else None, "pid": os.getpid(),
                "runner": type(runner).__name__ if runner else None,
                "torch_threads": self.torch_threads, "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
                "niceness": self.niceness,
                # hits of the runner's prefix cache (engine/models/static/prefix_cache.py); None where it is off or not
                # built in
                "prefix_cache": runner.prefix_cache_stats() if hasattr(runner, "prefix_cache_stats") else None,
                # CUDA graphs: captured shapes, replays, pool memory, host vs device ms per step
                # (engine/models/static/cuda_graphs.py)
                "cuda_graphs": runner.graph_stats() if hasattr(runner, "graph_stats") else None,
                # which operator computes bf16 products per shape class, and why (engine/models/cpu/bf16_products.py)
                "bf16_products": bf16_products.stats()}

    def ping(self) -> float:
        """Seconds the current model call has been running (0: idle); served on the "control" thread."""
        return self.busy.seconds()
