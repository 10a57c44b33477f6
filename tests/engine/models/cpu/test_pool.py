"""engine/models/cpu/csrc/pool.h (specserve::parallel_for, under every CPU operator): however many threads share a call,
and whichever of them computes a chunk, the result is the same bits as on one thread and no chunk is left out (outputs
start as uninitialised memory); callers on several Python threads at once each get their own results; a forked child
computes with helpers of its own; SPECSERVE_POOL=openmp (at::parallel_for), and helpers that sleep at once
(SPECSERVE_POOL_SPIN_US=0), give the same bits."""

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from engine.models.cpu import extension as cpu_extension
from tests import REPO
from tests.engine.models.cpu.test_extension import needs_kernel


@pytest.fixture(scope="module")
def ops():
    assert cpu_extension.op("cache_attention") is not None, cpu_extension.why_unavailable()
    return torch.ops.specserve


def calls(ops) -> list:
    """(name, zero-argument function) for each operator the pool splits, on inputs of many chunks."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(16, 576, generator=g), torch.randn(4099, 576, generator=g)
    q = torch.randn(8, 9, 3, 64, generator=g)
    k_cache, v_cache = torch.randn(10, 3, 256, 64, generator=g), torch.randn(10, 3, 256, 64, generator=g)
    positions = torch.tensor([[17 * b + w for w in range(3)] for b in range(8)])
    out = [("small_gemm", lambda: ops.small_gemm(x, weight, None)),
           ("cache_attention", lambda: ops.cache_attention(q, k_cache, v_cache, 1, positions, 200, 0.125)),
           ("silu_mul", lambda: ops.silu_mul(torch.randn(300, 2 * 576, generator=torch.Generator().manual_seed(1))))]
    if cpu_extension.bf16_gemm() is not None:
        from engine.models.cpu.linear import pack_bf16
        packed = pack_bf16(weight.bfloat16())
        out.append(("bf16_gemm", lambda: ops.bf16_gemm(x, packed, weight.shape[0], None)))
    return out


def on_threads(threads: int, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_any_number_of_threads_gives_the_bits_of_one(ops):
    for name, fn in calls(ops):
        alone = on_threads(1, fn)
        for threads in (2, 3, 4):
            for _ in range(3):
                assert torch.equal(on_threads(threads, fn), alone), (name, threads)


@needs_kernel
def test_callers_on_several_threads_each_get_their_own_results(ops):
    x = [torch.randn(5, 576) for _ in range(4)]
    weight = torch.randn(1537, 576)
    want = [on_threads(1, lambda xi=xi: ops.small_gemm(xi, weight, None)) for xi in x]
    wrong: list = []

    def caller(i: int) -> None:
        for _ in range(40):
            if not torch.equal(ops.small_gemm(x[i], weight, None), want[i]):
                wrong.append(i)

    def run_callers() -> list[threading.Thread]:
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return threads

    assert not any(t.is_alive() for t in on_threads(2, run_callers)), "a caller never came back"
    assert not wrong, f"callers {sorted(set(wrong))} got another caller's or an unfinished result"


def _child(queue, x, weight) -> None:
    # no ATen operator here: libgomp's own team is not usable in a child forked after the parent used it
    torch.set_num_threads(2)
    queue.put(torch.ops.specserve.small_gemm(x, weight, None).tolist())


@needs_kernel
def test_a_forked_child_computes_with_helpers_of_its_own(ops):
    x, weight = torch.ones(3, 64), torch.arange(64 * 700, dtype=torch.float32).reshape(700, 64) / 1000
    want = on_threads(2, lambda: ops.small_gemm(x, weight, None))  # the parent's helpers exist now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, x, weight))  # inherited by the fork, not pickled
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert torch.equal(torch.tensor(got), want)


@needs_kernel
@pytest.mark.parametrize("env", [{"SPECSERVE_POOL": "openmp"}, {"SPECSERVE_POOL_SPIN_US": "0"}])
def test_openmp_switch_and_a_helper_that_never_spins_give_the_same_bits(ops, tmp_path, env):
    mine = {name: on_threads(2, fn) for name, fn in calls(ops)}
    out = tmp_path / "openmp.pt"
    script = ("import torch, sys; from engine.models.cpu import extension; extension.op('cache_attention'); "
              "from tests.engine.models.cpu.test_pool import calls, on_threads; "
              f"torch.save({{n: on_threads(2, f) for n, f in calls(torch.ops.specserve)}}, {str(out)!r})")
    env = {**os.environ, **env}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300,
                   cwd=REPO)
    theirs = torch.load(out)
    assert theirs.keys() == mine.keys()
    for name in mine:
        assert torch.equal(theirs[name], mine[name]), name
