"""Megatron-style sharding over torch.distributed (gloo, 2 processes): same logits, 1/world of the weights."""

import os

import pytest
import torch
import torch.distributed as dist

from engine.models.tensor_parallel import TensorParallelError, check_shardable, num_parameters, shard_model
from engine.models.transformers_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.engine.spawn_ranks import TEST_TIMEOUT_S, run_ranks

# spawned ranks: pytest's limit as their hang guard (tests/engine/spawn_ranks.py)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


def _worker(rank, world, port, family, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_tiny_model(family, seed=0)
        full_params = num_parameters(model)
        shard_model(model, rank, world)
        runner = ModelRunner(model, vocab_size=model.config.vocab_size)
        runner.add("a")
        runner.add("b")
        tokens = {"a": [2, 3, 4, 5, 6, 7], "b": [9, 8, 7]}
        out1 = runner.forward(["a", "b"], [tokens["a"], tokens["b"]], [2, 1])
        out2 = runner.forward(["a", "b"], [[11, 12], [13]], [2, 1])
        results[rank] = (out1, out2, num_parameters(model), full_params)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_match_the_unsharded_model(family):
    results = run_ranks(_worker, 2, family)
    reference = ModelRunner(make_tiny_model(family, seed=0))
    reference.add("a")
    reference.add("b")
    ref1 = reference.forward(["a", "b"], [[2, 3, 4, 5, 6, 7], [9, 8, 7]], [2, 1])
    ref2 = reference.forward(["a", "b"], [[11, 12], [13]], [2, 1])
    for rank in range(2):
        out1, out2, params, full = results[rank]
        torch.testing.assert_close(out1, ref1, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out2, ref2, atol=1e-4, rtol=1e-4)
        # each rank holds about half: everything but the replicated norms is split
        assert params < 0.52 * full, (params, full)


def _worker_with_diverging_slots(rank, world, port, results):
    """Ranks that took and freed cache slots in different orders (a release reaching one rank before a forward and
    the other after it) must still compute the same rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_tiny_model("llama", seed=0)
        shard_model(model, rank, world)
        runner = ModelRunner(model, vocab_size=model.config.vocab_size)
        for seq_id in ("a", "b", "c"):
            runner.add(seq_id)
        runner.forward(["a", "b", "c"], [[2, 3, 4], [5, 6], [7, 8, 9, 10]], [1, 1, 1])
        if rank == 0:
            runner.release("b")
            runner.add("d")  # takes b's slot here
        else:
            runner.add("d")  # takes a new slot here
            runner.release("b")
        results[rank] = runner.forward(["c", "d"], [[11], [12, 13]], [1, 1])
    finally:
        dist.destroy_process_group()


def test_ranks_whose_cache_slots_differ_still_agree():
    results = run_ranks(_worker_with_diverging_slots, 2)
    reference = ModelRunner(make_tiny_model("llama", seed=0))
    for seq_id in ("a", "b", "c", "d"):
        reference.add(seq_id)
    reference.forward(["a", "b", "c"], [[2, 3, 4], [5, 6], [7, 8, 9, 10]], [1, 1, 1])
    expected = reference.forward(["c", "d"], [[11], [12, 13]], [1, 1])
    for rank in range(2):
        torch.testing.assert_close(results[rank], expected, atol=1e-4, rtol=1e-4)


def test_indivisible_sizes_are_refused():
    model = make_tiny_model("llama")  # 4 heads, 2 kv heads
    with pytest.raises(TensorParallelError, match="tp_size 3 must divide"):
        check_shardable(model.config, 3)
    with pytest.raises(TensorParallelError, match="Llama-style"):
        shard_model(make_tiny_model("gpt2"), 0, 2)
