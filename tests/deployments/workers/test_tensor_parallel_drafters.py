"""Drafters inside a tensor-parallel target (2 ranks, gloo, their own processes): rank 0 alone samples, so it tells
rank 1 where its drafter starts and what it drafted (deployments/workers/target.TargetDraftPeers). Checked against a
single-rank target with the same drafter given the same calls: the same drafts verified and the same tokens, round
after round, for greedy, seeded and unseeded rows. `self` steps the shard's layers on both ranks (collectives) and
chooses its L on both (rank 0's taken); an EAGLE-3 head without an embedding of its own looks tokens up in the
sharded embedding (collective); Medusa heads of their own draft on rank 0 alone, shared ones gather the sharded
LM head's logits with rank 1 (collective)."""

import asyncio
import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig

from deployments.transport.client import AsyncChannels
from deployments.transport.messages import Method, VerifyCall, VerifyResult
from deployments.workers.target import TargetWorkerCore
from engine.proposers.eagle3_checkpoint import save_speculators
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
from engine.proposers.medusa import MedusaConfig, MedusaHeads
from tests.deployments.conftest import tiny_config
from tests.deployments.workers.test_tensor_parallel_workers import _delta, _two_ranks
from tests.engine.spawn_ranks import TEST_TIMEOUT_S

# spawned ranks: pytest's limit as their hang guard (tests/engine/spawn_ranks.py)
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

ROUNDS = 8
SEQUENCES = 3  # greedy, seeded, unseeded
K = 3


def _medusa(target_dir, out, shared=False):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(K, 1, c.hidden_size, c.vocab_size, shared))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    heads.save(out)
    return f"medusa:{out}"


def _eagle3(target_dir, out):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(target_dir)
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, rms_norm_eps=1e-6)
    head = Eagle3Head(Eagle3Config(layer, c.vocab_size, (0, 1, 2), c.hidden_size))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    save_speculators(head, out, verifier=str(target_dir))
    return f"eagle3:{out}"


async def _rounds(call) -> tuple[dict[str, list[int]], list[dict[int, list[int]]]]:
    """ROUNDS rounds of SEQUENCES rows asking for K of the target's own drafts each: every row's tokens, and each
    round's verified drafts by row."""
    rng = random.Random(5)
    live = {f"s{i}": [rng.randrange(2, 60) for _ in range(rng.randrange(3, 10))] for i in range(SEQUENCES)}
    sent = dict.fromkeys(live, 0)
    verified = []
    for _ in range(ROUNDS):
        calls = [VerifyCall(_delta(s, sent[s], live[s], i % 3, 40 + i), [], None, False, K)
                 for i, s in enumerate(live)]
        result = VerifyResult.from_wire(await call(Method.VERIFY, [c.wire() for c in calls]))
        verified.append(result.target_drafts)
        for b, s in enumerate(live):
            sent[s] = len(live[s])
            live[s].extend(result.verdicts[b].tokens)
    return live, verified


@pytest.mark.parametrize("source", ["self", "self-after-reply", "medusa", "medusa-shared", "eagle3"])
def test_a_tensor_parallel_target_drafts_and_verifies_like_one_rank(tiny_model_dirs, tmp_path, source):
    """`self-after-reply`: the ranks draft after rank 0's reply (speculation.draft_after_reply), against one rank
    drafting before its reply: the same drafts and tokens."""
    draft = {"self": lambda: "self", "self-after-reply": lambda: "self", "medusa": lambda: _medusa(tiny_model_dirs[0], tmp_path / "medusa"),
             "medusa-shared": lambda: _medusa(tiny_model_dirs[0], tmp_path / "medusa", shared=True),
             "eagle3": lambda: _eagle3(tiny_model_dirs[0], tmp_path / "eagle3")}[source]()
    config = tiny_config(tiny_model_dirs, model={"draft": draft},
                         speculation={"num_speculative_tokens": K}).engine_config()
    served = dataclasses.replace(config, draft_after_reply=source == "self-after-reply")
    with _two_ranks(served) as (rank0, stats0, stats1):
        for stats in (stats0, stats1):
            assert stats["drafter"] is not None and stats["parameters"] < 0.55 * stats["full_parameters"], stats
        channel = AsyncChannels()
        tokens, verified = asyncio.run(asyncio.wait_for(
            _rounds(lambda method, *args: channel.call(rank0, method, *args)), 240))

    reference = TargetWorkerCore(config)
    assert reference.drafter.name == stats0["drafter"]["name"] == stats1["drafter"]["name"]

    async def local(method, *args):
        return getattr(reference, method)(*args)

    expected_tokens, expected_verified = asyncio.run(_rounds(local))
    assert verified == expected_verified
    assert tokens == expected_tokens
    assert sum(len(d) for drafts in verified[1:] for d in drafts.values()) > 0, "rounds after the first verified drafts"
