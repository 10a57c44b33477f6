"""The static runner on CUDA (skipped without a GPU; run there by hand, bench/RESULTS.md): the same logits as the
CPU transformers forward, CUDA graphs (captured per batch and width, serving any context) == eager, no host sync
inside a step (CUDA's sync debug mode), and tensor-parallel steps inside graphs over NCCL (two GPUs)."""

import pytest
import torch

from engine.models.static.runner import KVBudget, StaticRunner
from engine.models.static.steps import forbid_host_sync
from engine.models.transformers_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.engine.models.static.test_runner import ROUNDS, assert_same_logits, scripted

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SLOTS = KVBudget(gib=0.5, max_num_seqs=4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_cuda_static_forward_matches_cpu_transformers(family):
    model = make_tiny_model(family, seed=0)
    want = scripted(ModelRunner(model), ROUNDS)
    got = scripted(StaticRunner(model.to("cuda"), budget=SLOTS, compile=False, prefill_chunk=16), ROUNDS)
    assert_same_logits([g.cpu() for g in got], want, atol=1e-3, rtol=1e-3)


def test_cuda_graphs_agree_with_eager_serve_growing_contexts_and_make_no_host_sync():
    """`compile: auto` captures a graph per (batch bucket, width) at warm-up; replays give the eager logits, also
    at contexts far longer than any seen at capture (each row's length is a device tensor), without host syncs."""
    model = make_tiny_model("llama", seed=4).to("cuda")
    eager = StaticRunner(model, budget=SLOTS, compile="off", prefill_chunk=32)
    runner = StaticRunner(model, budget=SLOTS, compile="auto", prefill_chunk=32)
    assert runner.step_mode == "graphs"
    runner.warm_up(max_k=3)
    assert set(runner.graphs.graphs) == {(rows, width, None) for rows in runner.batch_buckets for width in (1, 2, 4)}
    assert runner.graphs.pool_bytes > 0
    assert_same_logits([c.cpu() for c in scripted(runner, ROUNDS)], [e.cpu() for e in scripted(eager, ROUNDS)],
                       atol=1e-3, rtol=1e-3)
    step = runner.graphs.step

    def guarded(*args):
        with forbid_host_sync(runner.device):
            return step(*args)

    runner.graphs.step = guarded
    replays = runner.graphs.replays
    for i in range(150):  # contexts grow past 150 tokens: one graph per shape serves them all
        feeds = [[(i * 7 + b) % 60 + 2] for b in range(3)]
        got = runner.forward(["a", "b", "c"], feeds, [1, 1, 1])
        want = eager.forward(["a", "b", "c"], feeds, [1, 1, 1])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert runner.graphs.replays == replays + 150


def test_tensor_parallel_steps_run_inside_cuda_graphs_over_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from tests.engine.spawn_ranks import run_ranks

    results = run_ranks(_nccl_rank, 2, timeout=300)
    assert results[0] == results[1] == "same logits"


def _nccl_rank(rank, world, port, results):
    import os
    import tempfile

    import torch.distributed as dist

    from engine.models.loading import resolve
    from engine.models.shard_loading import load_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    directory = os.path.join(tempfile.gettempdir(), f"specserve-nccl-{port}")
    if rank == 0:
        make_tiny_model("llama", seed=6).save_pretrained(directory, safe_serialization=True)
    dist.barrier()
    shard = load_shard(resolve(directory), "float32", "cuda", rank, world)
    runner = StaticRunner(shard, budget=SLOTS, compile="auto", prefill_chunk=32)
    runner.warm_up(max_k=3)
    got = scripted(runner, ROUNDS)
    want = scripted(StaticRunner(make_tiny_model("llama", seed=6).to(f"cuda:{rank}"), budget=SLOTS,
                                 compile="off", prefill_chunk=32), ROUNDS)
    assert_same_logits([g.cpu() for g in got], [w.cpu() for w in want], atol=1e-3, rtol=1e-3)
    assert runner.graphs.replays > 0
    results[rank] = "same logits"
    dist.destroy_process_group()


def test_bf16_static_greedy_equals_plain_decoding_of_the_same_dtype():
    model = make_tiny_model("llama", seed=5).to("cuda", torch.bfloat16)
    runner = StaticRunner(model, budget=SLOTS, compile="auto")
    runner.warm_up(max_k=0)
    runner.add("s")
    tokens = [2, 3, 4, 5]
    logits = runner.forward(["s"], [tokens], [1])
    for _ in range(8):
        tokens.append(int(logits[0, -1].argmax()))
        logits = runner.forward(["s"], [runner.sync("s", tokens)], [1])
    with torch.no_grad():
        full = model(torch.tensor([tokens], device="cuda")).logits[0, 3:-1].float().argmax(-1).tolist()
    assert full == tokens[4:]


def test_tree_steps_replay_the_captured_graphs_and_score_each_node_as_its_path():
    """A token tree's step (engine/spec/tree.py) replays the graph of its width bucket (every graph reads each row's
    depths and ancestor masks) and scores every node as decoding its path does (fp32: to the rounding of the
    kernels); the verify step with trees emits plain greedy decoding's tokens."""
    from engine.spec.tree import DraftTree
    from engine.spec.verify import TargetVerifier
    from tests.engine.models.static.test_tree_steps import (
        PROMPT,
        _plain_logits,
        greedy_continuation,
        tree_rounds,
        wrong,
    )

    model = make_tiny_model("llama", seed=4).to("cuda")
    runner = StaticRunner(model, budget=SLOTS, compile="auto", prefill_chunk=32)
    runner.warm_up(max_k=7)
    tree = DraftTree(tokens=(3, 8, 3, 21, 9, 50), parents=(0, 0, 1, 1, 3, 2))
    runner.add("t")
    runner.forward(["t"], [PROMPT[:-1]], [1])
    replays = runner.graphs.replays
    logits = runner.forward(["t"], [[PROMPT[-1], *tree.tokens]], [tree.width], trees=[tree])[0]
    assert runner.graphs.replays == replays + 1, "a tree replays a captured graph"
    for node in (0, 2, 4, 6):
        plain = _plain_logits(runner, f"p{node}", PROMPT, tree.path_tokens(node))
        torch.testing.assert_close(logits[node], plain[-1], atol=1e-3, rtol=1e-3)
        runner.release(f"p{node}")
    runner.release("t")
    want = greedy_continuation(model.cpu(), PROMPT, 12)
    model.to("cuda")
    verifier = TargetVerifier(runner, None)
    out, _, _ = tree_rounds(lambda rows: verifier.verify(rows).verdicts[0], want, 12,
                            lambda r, nxt: DraftTree.from_paths([wrong(nxt), nxt]))
    assert out[:12] == want
