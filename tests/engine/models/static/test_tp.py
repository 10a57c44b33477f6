"""The static runner over tensor-parallel shards (2 gloo ranks, each loading only its shard from safetensors): the
single-rank static runner's logits for mixed row lengths, decode and verify widths, chunked prefill and a released
slot; greedy speculative decoding == plain decoding; 1/world of the weights and KV heads per rank, so the same byte
budget holds world times the sequences; no host sync inside a step; a peer killed mid-step fails the step with
CollectiveError at once, not after a hang."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from engine import DraftModelProposer, ModelRunner, SamplingParams, SpeculativeEngine
from engine.factory import EngineConfig, make_runner
from engine.models.loading import load_causal_lm, resolve
from engine.models.shard_loading import load_shard
from engine.models.static.forward import StaticLlama
from engine.models.static.runner import KVBudget, StaticRunner
from engine.models.static.steps import forbid_host_sync
from engine.models.tensor_parallel import num_parameters
from tests.conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy
from tests.engine.spawn_ranks import HANG_GUARD_S, TEST_TIMEOUT_S, run_ranks

# spawned ranks: pytest's limit as their hang guard (tests/engine/spawn_ranks.py)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)
WORLD = 2
CASES = ["llama", "llama-bias", "llama-tied", "qwen2"]  # GQA (4 heads, 2 KV heads) in all
BUDGET = KVBudget(gib=0.001, max_num_seqs=64)  # small enough that the slot count follows the KV heads held
CHUNK = 16  # prefill chunk: the 40-token prompt below runs as chunks, then joins a batched step

ROUNDS = [
    (["a", "b", "c"], [[2, 3, 4, 5, 6, 7], [9, 8], [5]], [2, 1, 1]),  # prompts of different lengths
    (["a", "b", "c"], [[11, 12, 13, 14], [13], [7, 9]], [4, 1, 2]),  # verify widths K+1 = 4, 1 (decode) and 2
    (["c", "a"], [[10], [21, 22, 23]], [1, 3]),  # a subset, out of slot order
    (["b"], [[(7 * t) % 60 + 2 for t in range(40)]], [3]),  # a long row: chunked prefill, then the batched tail
    (["d", "b", "c"], [[3, 4, 5], [6], [7, 8, 9, 10]], [1, 1, 4]),  # after "a" is released: "c" moved to its slot
    (["b", "c", "d"], [[30], [31], [32]], [1, 1, 1]),  # a decode step, batch 3
]
PROMPTS = [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 20, 21, 22, 20, 21]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _tiny(case):
    from transformers import LlamaForCausalLM

    if case in ("llama-bias", "llama-tied"):
        config = make_tiny_model("llama").config
        config.attention_bias = config.mlp_bias = case == "llama-bias"  # o_proj/down_proj: a whole bias after the sum
        config.tie_word_embeddings = case == "llama-tied"
        torch.manual_seed(5)
        model = LlamaForCausalLM(config).eval()
        if case == "llama-bias":
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.3)  # nonzero, so a bias added once per rank would show
        return model
    return make_tiny_model(case, seed=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-static")
    for case in CASES:
        _tiny(case).save_pretrained(root / case, safe_serialization=True)
    return {case: str(root / case) for case in CASES}


def script(runner):
    """ROUNDS through `runner` (a release before the fifth); each call's logits."""
    out = []
    for i, (seq_ids, feeds, widths) in enumerate(ROUNDS):
        if i == 4:
            runner.release("a")
        for s in seq_ids:
            if not runner.has(s):
                runner.add(s)
        out.append(runner.forward(seq_ids, feeds, widths))
    return out


def _greedy(target, draft_model, k, trees=False):
    proposer = None if draft_model is None else DraftModelProposer(ModelRunner(draft_model), target.vocab_size)
    from engine.spec.plan import TreeSettings
    engine = SpeculativeEngine(target, make_tiny_tokenizer(), proposer, k,
                               tree=TreeSettings("on", 6) if trees else TreeSettings())
    tokens = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    return tokens, engine.stats.acceptance_rate if proposer is not None else None


def _init(rank, world, port, timeout_s=HANG_GUARD_S):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def _rank_worker(rank, world, port, dirs, results):
    _init(rank, world, port)
    try:
        for case, directory in dirs.items():
            shard = load_shard(resolve(directory), "float32", "cpu", rank, world)
            runner = StaticRunner(shard, budget=BUDGET, compile=False, prefill_chunk=CHUNK)
            step = runner._step

            def guarded(*args, step=step):
                with forbid_host_sync(runner.device):
                    return step(*args)

            runner._step = runner._prefill = guarded
            model = runner.model
            layout = {"params": num_parameters(model), "slots": runner.capacity,
                      "qkv": tuple(model.layers[0].qkv.weight.shape), "o": tuple(model.layers[0].o.weight.shape), "embed": tuple(model.embed.shape),
                      "k_cache": tuple(model.k_cache[0].shape), "vocab": runner.vocab_size}
            results[(case, rank)] = (script(runner), layout)
            # the CUDA-graph step's forward (every index a device tensor, collectives inside), run eagerly here
            rows = StaticRunner(load_shard(resolve(directory), "float32", "cpu", rank, world), budget=BUDGET,
                                compile="graphs", prefill_chunk=CHUNK)
            results[(case, "graphs", rank)] = script(rows)
        # greedy speculative decoding over the tensor-parallel static target, and plain decoding over it
        directory = dirs["llama"]
        draft = perturbed_copy(load_causal_lm(resolve(directory)), 0.05)
        target = StaticRunner(load_shard(resolve(directory), "float32", "cpu", rank, world), budget=BUDGET,
                              compile=False, prefill_chunk=CHUNK)
        results[("spec", rank)] = _greedy(target, draft, 3)
        results[("trees", rank)] = _greedy(target, draft, 3, trees=True)  # token trees over the shards
        results[("plain", rank)] = _greedy(target, None, 0)
        # the runner a shard gets, by config
        config = EngineConfig(target=directory, kv_cache_gib=0.001, compile=False)
        kinds = [type(make_runner(load_shard(resolve(directory), "float32", "cpu", rank, world),
                                  EngineConfig(**{**config.__dict__, "runner": kind}))).__name__
                 for kind in ("auto", "static", "transformers")]
        try:
            make_runner(shard, EngineConfig(**{**config.__dict__, "compile": "on"}))
            kinds.append("compiled")
        except ValueError as exc:
            kinds.append(str(exc))
        results[("kinds", rank)] = kinds
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(model_dirs):
    return run_ranks(_rank_worker, WORLD, model_dirs)


def _single_rank(directory):
    return StaticRunner(load_causal_lm(resolve(directory)), budget=BUDGET, compile=False, prefill_chunk=CHUNK)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_single_rank_static_logits(case, model_dirs, two_ranks):
    want = script(_single_rank(model_dirs[case]))
    for rank in range(WORLD):
        got, _ = two_ranks[(case, rank)]
        for g, w, (_, _, widths) in zip(got, want, ROUNDS):
            assert g.shape == w.shape  # the full vocabulary on every rank
            for b, k in enumerate(widths):
                torch.testing.assert_close(g[b, :k], w[b, :k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_the_graph_steps_forward_over_two_ranks_gives_the_single_rank_logits(case, model_dirs, two_ranks):
    want = script(_single_rank(model_dirs[case]))
    for rank in range(WORLD):
        got = two_ranks[(case, "graphs", rank)]
        for g, w, (_, _, widths) in zip(got, want, ROUNDS):
            for b, k in enumerate(widths):
                torch.testing.assert_close(g[b, :k], w[b, :k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_shard_and_its_heads_kv_cache(case, model_dirs, two_ranks):
    single = _single_rank(model_dirs[case])
    full = single.model
    slot_bytes = StaticLlama.slot_bytes(load_causal_lm(resolve(model_dirs[case])).config, full.capacity,
                                        torch.float32)
    for rank in range(WORLD):
        _, layout = two_ranks[(case, rank)]
        assert layout["qkv"] == (full.layers[0].qkv.weight.shape[0] // WORLD, full.layers[0].qkv.weight.shape[1])
        assert layout["o"] == (full.layers[0].o.weight.shape[0], full.layers[0].o.weight.shape[1] // WORLD)
        assert layout["embed"] == (full.embed.shape[0] // WORLD, full.embed.shape[1])
        assert layout["vocab"] == single.vocab_size
        # every split tensor is halved; only norms (and row-parallel biases) are whole
        assert layout["params"] < 0.55 * num_parameters(full), (layout["params"], num_parameters(full))
        shape = full.k_cache[0].shape
        assert layout["k_cache"][1:] == (shape[1] // WORLD, shape[2], shape[3])  # this rank's KV heads only
        # the same byte budget holds WORLD times the sequences per rank (before max_num_seqs caps it)
        assert layout["slots"] == int(BUDGET.gib * (1 << 30)) // (slot_bytes // WORLD) > single.capacity


def test_greedy_speculative_decoding_over_two_ranks_equals_plain_decoding(model_dirs, two_ranks):
    want, _ = _greedy(_single_rank(model_dirs["llama"]), None, 0)
    for rank in range(WORLD):
        spec, acceptance = two_ranks[("spec", rank)]
        plain, _ = two_ranks[("plain", rank)]
        trees, tree_acceptance = two_ranks[("trees", rank)]
        assert spec == plain == trees == want
        assert 0.0 < acceptance < 1.0  # drafts were accepted and rejected: the caches were rolled back
        assert tree_acceptance > 0.0  # tree rounds kept accepted paths over the shards


def test_the_runner_a_shard_gets(two_ranks):
    for rank in range(WORLD):
        auto, static, transformers, compiled = two_ranks[("kinds", rank)]
        assert (auto, static, transformers) == ("StaticRunner", "StaticRunner", "ModelRunner")
        assert "not supported for tensor-parallel targets on CPU" in compiled  # inductor; CUDA graphs on CUDA


# ---- a peer killed mid-step -----------------------------------------------------------------------------------
def _dying_worker(rank, world, port, directory, results):
    import engine.models.static.forward as forward
    from engine.models.tensor_parallel import CollectiveError

    _init(rank, world, port, timeout_s=GROUP_TIMEOUT_S)
    runner = StaticRunner(load_shard(resolve(directory), "float32", "cpu", rank, world), budget=BUDGET,
                          compile=False)
    runner.add("a")
    runner.forward(["a"], [[2, 3, 4]], [1])  # healthy
    if rank == 1:
        calls = []
        reduce_sum = forward.reduce_sum

        def dies_on_the_third(t, shard):
            calls.append(1)
            if len(calls) == 3:
                os._exit(3)  # killed inside the step: between the first layer's collectives and the rest
            return reduce_sum(t, shard)

        forward.reduce_sum = dies_on_the_third
    try:
        runner.forward(["a"], [[5]], [1])
        results[rank] = "no error"
    except CollectiveError as exc:
        results[rank] = f"CollectiveError: {exc}"
    os._exit(0)  # the group is broken: nothing to tear down


# far past run_ranks' hang guard: a survivor that fails at all failed on the peer's closed sockets, not by waiting out
# the group's timeout
GROUP_TIMEOUT_S = 3 * HANG_GUARD_S


def test_a_peer_killed_mid_step_fails_the_step_with_collective_error_at_once(model_dirs):
    results = run_ranks(_dying_worker, WORLD, model_dirs["llama"], exitcodes={1: 3})
    outcome = results[0]
    assert outcome.startswith("CollectiveError"), outcome
    assert "timed out" not in outcome.lower(), outcome  # gloo names the dead peer's connection, not a timeout
