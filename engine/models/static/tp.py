"""The static runner's forward over one tensor-parallel rank's shard: what changes, and the three collectives.

`StaticLlama` (engine/models/static/forward.py) builds from a model whose projections, embedding and LM head
engine/models/tensor_parallel.py's `install_shards` replaced by parallel modules (as engine/models/shard_loading.py's
`load_shard` leaves them), and fuses them per rank, on the shard: this rank's q/k/v row slices become its fused qkv
matrix (its heads only, the same for GQA: query heads rank*H/w.. share key/value heads rank*KVH/w..), gate/up its fused
gate_up (its MLP columns), o_proj and down_proj keep their column slices (row-parallel). A step then runs this rank's
heads against its heads' KV cache only, with three collectives (Megatron-LM's layout, Shoeybi et al. 2019, arXiv
1909.08053):

- the embedding: each rank looks up the ids in its vocabulary rows (zeros elsewhere), then the sum is all-reduced;
- o_proj and down_proj: partial products all-reduced (2 per layer), a replicated bias added once after;
- the LM head: this rank's vocabulary slice of the logits, all-gathered, so every rank returns the full logits (as
  the transformers path's `VocabParallelLMHead` does; rank 0 scores them, deployments/workers/draft.py).

Every collective fails with `CollectiveError` when a peer is gone (gloo: at once; a live but stuck peer: after the
group's timeout), as the transformers path does. None reads a device value back, so a step stays free of host
syncs. The ranks pair rows by position in the call, so they must apply the same add / release / forward calls in
the same order: deployments/workers/draft.py guarantees it (rank 0 forwards every call to the others, in its order).

On CUDA the collectives (NCCL) are captured inside the steps' CUDA graphs (engine/models/static/cuda_graphs.py), every
rank capturing the same shapes in the same order. On CPU (gloo) steps run eagerly: inductor (`runner.compile: on`) is
refused for a shard, as gloo collectives do not run inside its graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.tensor_parallel import (
    CollectiveError,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    all_gather_parts,
    all_reduce_sum,
)


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds."""

    rank: int
    world: int
    group: object  # torch.distributed ProcessGroup; None: the default group
    vocab_start: int  # first vocabulary id of this rank's embedding rows


def shard_of(model: nn.Module) -> Shard | None:
    """The shard a model sharded by `install_shards` holds (None: a whole model)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, VocabParallelEmbedding):
        return None
    return Shard(rank=embed.start // embed.weight.shape[0], world=head.world, group=embed.group,
                 vocab_start=embed.start)


def why_shard_unsupported(model: nn.Module) -> str | None:
    """None if a sharded model has exactly the layout `install_shards` makes, else what differs."""
    base = model.base_model
    if not isinstance(model.get_output_embeddings(), VocabParallelLMHead):
        return "the embedding is vocabulary-parallel but the LM head is not"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        columns = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(type(m) is ColumnParallelLinear for m in columns) or not all(
                type(m) is RowParallelLinear for m in (attn.o_proj, mlp.down_proj)):
            return "a tensor-parallel shard whose projections are not the column/row-parallel layers of " \
                   "engine/models/tensor_parallel.py"
    return None


def row_parallel_bias(module: nn.Module, dtype: torch.dtype) -> nn.Parameter | None:
    """A row-parallel layer's (whole) bias, added after the all-reduce; None for other layers or no bias."""
    if not isinstance(module, RowParallelLinear) or module.bias is None:
        return None
    return nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)


def embed(tokens: torch.Tensor,  # [B, W] int64, full-vocabulary ids
          weight: torch.Tensor,  # [V/world, H] this rank's rows
          shard: Shard) -> torch.Tensor:  # [B, W, H]
    """Each rank embeds the ids in its rows (zeros for the others); the sum over ranks is every id's row."""
    local = tokens - shard.vocab_start
    mine = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * mine[..., None].to(weight.dtype)
    return reduce_sum(out, shard)


def reduce_sum(t: torch.Tensor, shard: Shard) -> torch.Tensor:  # [...] -> [...] summed over ranks
    t = t.contiguous()
    all_reduce_sum(t, shard.group)
    return t


def gather_vocab(local: torch.Tensor,  # [..., V/world] this rank's vocabulary slice
                 shard: Shard) -> torch.Tensor:  # [..., V]
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(shard.world)]
    all_gather_parts(parts, local, shard.group)
    return torch.cat(parts, dim=-1)


def agree_num_slots(num_slots: int, shard: Shard, device: torch.device) -> int:
    """The fewest slots any rank's budget allows (once, at start): every rank must refuse the same sequence when
    full, and pair the same rows in its steps."""
    t = torch.tensor([num_slots], dtype=torch.int64, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=shard.group)
    except RuntimeError as exc:
        raise CollectiveError(f"all_reduce of the KV-cache slot count failed: {exc}") from exc
    return int(t.item())


def first_rank_value(value: int, shard: Shard, device: torch.device) -> int:
    """Rank 0's `value` on every rank (a choice made from timings, which differ between ranks, must be one)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    try:
        dist.broadcast(t, src=dist.get_global_rank(shard.group, 0) if shard.group is not None else 0,
                       group=shard.group)
    except RuntimeError as exc:
        raise CollectiveError(f"broadcast of rank 0's choice failed: {exc}") from exc
    return int(t.item())
