"""A tensor-parallel target (2 ranks, gloo, their own processes) called by several routers at once.

Rank 0 is the replica's one entry point and passes every verify and release on to rank 1 in its own order, so the
ranks pair the same rows in their collectives however the routers' calls interleave. Checked against a single-rank
target given the same calls: the same tokens for every sequence, greedy and sampled (rank 0 samples). The ranks run
the static runner over their shards (engine/models/static/tp.py), or transformers' where the config says so.
"""

import asyncio
import contextlib
import multiprocessing
import random
import socket

import pytest

from deployments.transport.client import AsyncChannels
from deployments.transport.messages import Method, VerifyCall, VerifyResult
from deployments.workers.target import TargetWorkerCore
from engine.request.delta import SeqDelta, first_delta
from engine.request.sampling import SamplingParams
from engine.request.settings import SequenceSettings
from tests.deployments.conftest import tiny_config
from tests.engine.spawn_ranks import HANG_GUARD_S, TEST_TIMEOUT_S

# spawned ranks: pytest's limit as their hang guard (tests/engine/spawn_ranks.py)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ROUTERS = 2
SEQUENCES_PER_ROUTER = 3  # one after another per lane: each finished sequence is released and a new one starts
LANES = 2  # sequences a router has live at once
ROUNDS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_ranks(procs, stop) -> None:
    stop.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()


@contextlib.contextmanager
def _two_ranks(config):
    """Two target ranks in processes of their own, rank 0 connected to rank 1: yields (rank 0's endpoint, rank 0's
    stats, rank 1's stats), and stops both after."""
    ctx = multiprocessing.get_context("spawn")
    endpoints, peers, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, config, endpoints, peers, stop), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, endpoint, stats1 = endpoints.get(timeout=HANG_GUARD_S)
        assert rank == 1
        peers.put(endpoint)
        _, rank0, stats0 = endpoints.get(timeout=HANG_GUARD_S)
        yield rank0, stats0, stats1
    finally:
        _stop_ranks(procs, stop)


def _rank_main(rank, port, engine_config, endpoints, peers, stop):
    core = TargetWorkerCore(engine_config, rank, 2, torch_threads=1)
    core.init_distributed("127.0.0.1", port, timeout_s=HANG_GUARD_S)  # a rendezvous with a rank still importing
    endpoint = core.start_channel()
    if rank == 0:  # like TargetServer: rank 0 is called only once it is connected to the other rank
        core.connect_peers([peers.get(timeout=HANG_GUARD_S)])
    endpoints.put((rank, endpoint, core.stats()))
    stop.wait(HANG_GUARD_S)


def _delta(seq_id: str, sent: int, tokens: list[int], kind: int, seed: int) -> SeqDelta:
    """Row `seq_id`'s tokens from `sent`; kind 0 greedy, 1 seeded, 2 unseeded (its seed drawn: `seed` here)."""
    if sent:
        return SeqDelta(seq_id, sent, tokens[sent:])
    params = SamplingParams(temperature=0.0 if kind == 0 else 1.0, seed=seed if kind == 1 else None)
    return SeqDelta(seq_id, 0, list(tokens), SequenceSettings.of(params, seed, len(tokens)))


async def _router(call, router: int) -> dict[str, list[int]]:
    """Rounds for this router's sequences, greedy, seeded-sampled and unseeded-sampled in turn (the target samples
    at rank 0: the same tokens as one rank); drafts are pseudo-random tokens (mostly rejected: rollbacks). Router 1
    decodes plainly with its rows marked for decoding ahead (deployments/workers/decode_ahead.py): rank 0 runs each next
    step right after replying, on both ranks, and answers the next call from it."""
    rng = random.Random(router)
    out: dict[str, list[int]] = {}
    queue = [f"r{router}-s{i}" for i in range(SEQUENCES_PER_ROUTER * LANES)]
    live = {queue.pop(0): [] for _ in range(LANES)}
    sent = {s: 0 for s in live}
    for seq in live:
        live[seq] = [rng.randrange(2, 60) for _ in range(rng.randrange(3, 12))]
    for round_no in range(ROUNDS):
        seqs = list(live)
        drafts = {s: [rng.randrange(2, 60) for _ in range(rng.randrange(0, 4))] if router != 1 else []
                  for s in seqs}
        kinds = {s: int(s.rsplit("s", 1)[1]) % 3 for s in seqs}  # 0 greedy, 1 seeded, 2 unseeded (a drawn seed)
        calls = [VerifyCall(_delta(s, sent[s], live[s], kinds[s], 1000 + 7 * int(s.rsplit("s", 1)[1]) + router),
                            drafts[s], None, router == 1)
                 for s in seqs]
        result = await call(Method.VERIFY, [c.wire() for c in calls])
        for b, s in enumerate(seqs):
            sent[s] = len(live[s])
            live[s].extend(VerifyResult.from_wire(result).verdicts[b].tokens)
        if round_no % 4 == 3 and queue:  # a sequence ends, its caches are freed, a new one joins
            done = seqs[round_no % len(seqs)]
            out[done] = live.pop(done)
            await call(Method.RELEASE, [done])
            new = queue.pop(0)
            live[new] = [rng.randrange(2, 60) for _ in range(rng.randrange(3, 12))]
            sent[new] = 0
        await asyncio.sleep(rng.random() * 0.01)  # let the other router's calls land in between
    out.update(live)
    return out


def test_routers_calling_one_tensor_parallel_replica_at_once_get_single_rank_results(tiny_model_dirs):
    # a KV budget of 5 single-rank sequences (the routers keep 4 live at once), so the ranks' 10 show
    config = tiny_config(tiny_model_dirs, runner={"kv_cache_gib": 0.0013}).engine_config()
    with _two_ranks(config) as (rank0, stats0, stats1):
        for stats in (stats0, stats1):  # the static runner over each rank's shard, half the weights each
            assert stats["runner"] == "StaticRunner", stats
            assert stats["parameters"] < 0.55 * stats["full_parameters"], stats
        assert stats0["kv_capacity"] == stats1["kv_capacity"] > 0  # the ranks agreed on their slots
        channels = [AsyncChannels() for _ in range(ROUTERS)]  # each router process has its own connections

        async def run_all():
            return await asyncio.gather(*(
                _router(lambda method, *args, c=channels[i]: c.call(rank0, method, *args), i)
                for i in range(ROUTERS)))

        tensor_parallel = asyncio.run(asyncio.wait_for(run_all(), 240))

    reference = TargetWorkerCore(config)
    assert reference.stats()["runner"] == "StaticRunner"
    # the same budget holds twice the sequences per rank (half the KV heads each), up to max_num_seqs
    assert reference.stats()["kv_capacity"] == 5 and stats0["kv_capacity"] == 10

    async def local(method, *args):
        return getattr(reference, method)(*args)

    for i in range(ROUTERS):
        expected = asyncio.run(_router(local, i))
        assert tensor_parallel[i] == expected, f"router {i}"
    assert reference.ahead.stats.used > 0  # router 1's rounds were answered from steps decoded ahead


def test_a_tensor_parallel_target_scores_a_chunked_prompts_logprobs_like_one_rank(tiny_model_dirs):
    """Prompt logprobs under tensor parallelism: every rank runs the LM head over the prompt positions (its
    collectives), rank 0 scores them; the same as one rank, chunk by chunk, beside a row that did not ask."""
    config = tiny_config(tiny_model_dirs).engine_config()
    prompt = [(5 * t + 2) % 60 + 2 for t in range(40)]

    def calls(start: int, end: int) -> list[tuple]:
        settings = SequenceSettings.of(SamplingParams(), 0, len(prompt)) if start == 0 else None
        asked = SeqDelta("p", start, prompt[start:end], settings, 2, prompt[end] if end < len(prompt) else None)
        return [VerifyCall(asked, []).wire(), VerifyCall(first_delta(f"q{start}", [3, 4, 5]), [6]).wire()]

    async def score(call) -> list:
        out = []
        for start in range(0, len(prompt), 16):
            result = VerifyResult.from_wire(await call(Method.VERIFY, calls(start, min(len(prompt), start + 16))))
            out.append((result.prompt_logprobs, [v.tokens for v in result.verdicts]))
        return out

    with _two_ranks(config) as (rank0, _, _):
        channels = AsyncChannels()
        tensor_parallel = asyncio.run(asyncio.wait_for(score(lambda method, *args: channels.call(rank0, method, *args)),
                                                       120))
    reference = TargetWorkerCore(config)

    async def local(method, *args):
        return getattr(reference, method)(*args)

    expected = asyncio.run(score(local))
    # a chunk scores its tokens after its first, and the next chunk's first (its last position's logits)
    assert [(runs[0].first, len(runs[0].entries)) for runs, _ in expected] == [(1, 16), (17, 16), (33, 7)]
    for (got, got_tokens), (want, want_tokens) in zip(tensor_parallel, expected):
        assert got_tokens == want_tokens and set(got) == set(want) == {0}
        assert [(e.rank, [i for i, _ in e.top]) for e in got[0].entries] == \
               [(e.rank, [i for i, _ in e.top]) for e in want[0].entries]
        for g, w in zip(got[0].entries, want[0].entries):
            assert abs(g.logprob - w.logprob) < 1e-3


def test_a_rank_whose_peer_is_gone_fails_its_calls_and_health_pings_from_then_on(tiny_model_dirs):
    import pytest

    from deployments.errors import TensorParallelBroken
    from deployments.transport.wire import ChannelClosed

    class GonePeer:
        def send(self, *args):
            raise ChannelClosed("connection reset by peer")

    core = TargetWorkerCore(tiny_config(tiny_model_dirs).engine_config())
    call = VerifyCall(first_delta("a", [5, 6, 7]), [])
    assert VerifyResult.from_wire(core.verify([call.wire()])).verdicts[0].tokens  # healthy
    assert core.ping() == 0.0
    core._peers = [GonePeer()]
    for attempt in range(2):  # the first call finds out; later ones fail at once
        with pytest.raises(TensorParallelBroken, match="connection reset"):
            core.verify([VerifyCall(SeqDelta("a", 3, [8]), []).wire()])
    with pytest.raises(TensorParallelBroken):
        core.ping()  # Serve's health check fails: the replica is replaced


def _stuck_rank_main(rank, port, engine_config, endpoints, peers, stop, timeout_s, stuck):
    """Like _rank_main; rank 1's verify calls get stuck (never reaching their collectives) once `stuck` is set."""
    import os
    import time

    os.environ["SPECSERVE_COLLECTIVE_TIMEOUT_S"] = str(timeout_s)  # as an operator would set it on the node
    core = TargetWorkerCore(engine_config, rank, 2, torch_threads=1)
    core.init_distributed("127.0.0.1", port)
    timed_verify = core._timed_verify

    def maybe_stuck(calls):
        while stuck.is_set() and not stop.is_set():
            time.sleep(0.05)
        return timed_verify(calls)

    if rank == 1:
        core._timed_verify = maybe_stuck
    endpoint = core.start_channel()
    if rank == 0:
        core.connect_peers([peers.get(timeout=HANG_GUARD_S)])
    endpoints.put((rank, endpoint, None))
    stop.wait(HANG_GUARD_S)


def test_a_stuck_peer_fails_rank_0s_call_after_the_collective_timeout(tiny_model_dirs):
    """Rank 1 alive but stuck (never joining the collective): rank 0's verify fails after the configured collective
    timeout instead of hanging, and the rank stays broken. (A killed peer fails at once: its sockets close.)"""
    import time

    import pytest

    from deployments.errors import TensorParallelBroken

    timeout_s = 3
    config = tiny_config(tiny_model_dirs).engine_config()
    ctx = multiprocessing.get_context("spawn")
    endpoints, peers, stop, stuck = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_stuck_rank_main, args=(r, port, config, endpoints, peers, stop, timeout_s, stuck),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        _, endpoint, _ = endpoints.get(timeout=HANG_GUARD_S)
        peers.put(endpoint)
        _, rank0, _ = endpoints.get(timeout=HANG_GUARD_S)

        async def rounds():
            channels = AsyncChannels()

            async def verify(seq_id):
                call = VerifyCall(first_delta(seq_id, [5, 6, 7]), [])
                return await asyncio.wait_for(channels.call(rank0, "verify", [call.wire()]), 120)

            assert VerifyResult.from_wire(await verify("a")).verdicts[0].tokens  # healthy
            stuck.set()
            start = time.monotonic()
            # the configured bound, not the default (60 s on CPU): gloo names the one it waited for
            with pytest.raises(TensorParallelBroken, match=f"[Tt]imed out waiting {timeout_s * 1000}ms"):
                await verify("b")
            failed_after = time.monotonic() - start
            assert failed_after > timeout_s - 0.5, failed_after  # not before it
            with pytest.raises(TensorParallelBroken):
                await verify("c")  # broken from then on

        asyncio.run(rounds())
    finally:
        _stop_ranks(procs, stop)


def test_init_distributed_sets_the_backend_timeout_and_nccl_error_handling(tiny_model_dirs, monkeypatch):
    import dataclasses
    import datetime
    import os

    import torch
    import torch.distributed as dist

    import deployments.workers.target as target

    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.append(
        (backend, kw["timeout"], kw.get("device_id"), os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))))
    monkeypatch.setattr(target, "rank_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(TargetWorkerCore, "load", lambda self: None)
    for name in ("SPECSERVE_COLLECTIVE_TIMEOUT_S", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(name, "")  # recorded, so what init_distributed sets is undone after the test
        monkeypatch.delenv(name)
    cpu = tiny_config(tiny_model_dirs).engine_config()
    gpu = dataclasses.replace(cpu, device="cuda")
    TargetWorkerCore(cpu, 0, 2).init_distributed("127.0.0.1", 1)
    TargetWorkerCore(gpu, 0, 2).init_distributed("127.0.0.1", 1)
    monkeypatch.setenv("SPECSERVE_COLLECTIVE_TIMEOUT_S", "7")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the operator's own choice
    TargetWorkerCore(gpu, 1, 2).init_distributed("127.0.0.1", 1)
    assert seen == [("gloo", datetime.timedelta(seconds=60), None, None),
                    ("nccl", datetime.timedelta(seconds=30), torch.device("cuda", 0), "1"),
                    ("nccl", datetime.timedelta(seconds=7), torch.device("cuda", 0), "3")]


def test_a_tp_target_runs_the_runner_its_config_names(tiny_model_dirs):
    """`runner.kind: transformers` keeps a shard on the transformers runner (built without collectives, so one rank
    can load here); inductor (compile: on) is refused for tensor-parallel targets on CPU, by the config and by the
    runner itself (on CUDA their steps run as CUDA graphs)."""
    import dataclasses

    import pytest
    from pydantic import ValidationError

    import deployments.workers.target as target
    from engine.models.transformers_runner import ModelRunner

    config = tiny_config(tiny_model_dirs, runner={"kind": "transformers"}, tp_size=2)
    core = TargetWorkerCore(config.engine_config(), 0, 2)
    warmed = []
    real = target.warm_up
    target.warm_up = lambda runner, k, what, *drafter: (warmed.append((runner, k, what, *drafter))
                                                        or real(runner, k, what))
    try:
        core.load()
    finally:
        target.warm_up = real
    # a rank warms its runner up at load (the static runner captures its CUDA graphs there, every rank alike)
    assert warmed == [(core.runner, config.speculation.num_speculative_tokens, "target", None)]  # no drafter
    assert isinstance(core.runner, ModelRunner) and core.stats()["runner"] == "ModelRunner"
    assert core.stats()["parameters"] < 0.55 * core.stats()["full_parameters"]
    with pytest.raises(ValidationError, match="runner.compile: on is not supported with tp_size 2 on CPU"):
        tiny_config(tiny_model_dirs, runner={"compile": True}, tp_size=2)
    tiny_config(tiny_model_dirs, runner={"compile": True, "kind": "transformers"}, tp_size=2)  # draft only
    compiled = dataclasses.replace(tiny_config(tiny_model_dirs).engine_config(), compile="on")
    with pytest.raises(ValueError, match="not supported for tensor-parallel targets on CPU"):
        TargetWorkerCore(compiled, 0, 2).load()  # refused before any collective or compilation
