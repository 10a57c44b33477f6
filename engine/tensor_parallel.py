"""Tensor parallelism for Llama-style transformers models: each rank holds 1/world of the weights.

Megatron-LM's scheme (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3): attention heads and MLP columns are split
across ranks (column-parallel q/k/v and gate/up projections), the following projection is row-parallel (o_proj,
down_proj) and its partial sums are all-reduced; the embedding and LM head are split over the vocabulary. Norms and
rotary tables are replicated (tiny). The attention modules reshape with `-1` heads, so a rank simply runs its own
heads, and its KV cache holds only those. Works with any torch.distributed backend (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import linear


class TensorParallelError(ValueError):
    """The model cannot be split this way (unsupported family or sizes not divisible by the world size)."""


class CollectiveError(RuntimeError):
    """A collective failed (a peer rank died, or timed out): this process group can no longer compute."""


def _all_reduce(t: torch.Tensor, group) -> None:
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as exc:
        raise CollectiveError(f"all_reduce failed: {exc}") from exc


def _all_gather(parts: list[torch.Tensor], t: torch.Tensor, group) -> None:
    try:
        dist.all_gather(parts, t, group=group)
    except RuntimeError as exc:
        raise CollectiveError(f"all_gather failed: {exc}") from exc


def _slice_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = t.shape[0] // world
    return t[rank * size : (rank + 1) * size].clone()


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; no communication."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_slice_rows(full.weight.data, rank, world), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(_slice_rows(full.bias.data, rank, world),
                                                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out/world]
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs all-reduced, bias added once after."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group=None) -> None:
        super().__init__()
        weight_t = _slice_rows(full.weight.data.t(), rank, world)  # [in/world, out]
        self.weight = nn.Parameter(weight_t.t().contiguous(), requires_grad=False)  # [out, in/world]
        self.bias = None if full.bias is None else nn.Parameter(full.bias.data.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in/world] -> [..., out]
        out = linear(x, self.weight)
        _all_reduce(out, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*V/world, (rank+1)*V/world) of the table; each rank embeds its ids, the sum is all-reduced."""

    def __init__(self, full: nn.Embedding, rank: int, world: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(_slice_rows(full.weight.data, rank, world), requires_grad=False)
        self.start = rank * self.weight.shape[0]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N, H]
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        _all_reduce(out, self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice, all-gathered into the full vocabulary."""

    def __init__(self, weight: torch.Tensor, world: int, group=None) -> None:
        super().__init__()
        self.weight = weight  # shared with the embedding shard when the model ties them
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        local = linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        _all_gather(parts, local, self.group)
        return torch.cat(parts, dim=-1)


def check_shardable(config, world: int) -> None:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads, "key/value heads": kv_heads,
             "MLP intermediate size": getattr(config, "intermediate_size", 0), "vocabulary": config.vocab_size}
    bad = [f"{name} ({value})" for name, value in sizes.items() if not value or value % world]
    if bad:
        raise TensorParallelError(f"tp_size {world} must divide the model's {', '.join(bad)}")


def shard_model(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Replace a Llama-style model's layers by this rank's shards, in place. world == 1 is a no-op."""
    if world == 1:
        return model
    base = model.base_model
    if not hasattr(base, "layers") or not hasattr(base.layers[0], "self_attn") or not hasattr(
        base.layers[0].self_attn, "q_proj"
    ):
        raise TensorParallelError(
            f"tensor parallelism supports Llama-style models (q_proj/k_proj/v_proj/o_proj, gate/up/down_proj); "
            f"{type(model).__name__} is not one"
        )
    check_shardable(model.config, world)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), rank, world))
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group)
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), rank, world))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group)
    embedding = VocabParallelEmbedding(model.get_input_embeddings(), rank, world, group)
    head_weight = embedding.weight if tied else nn.Parameter(
        _slice_rows(model.get_output_embeddings().weight.data, rank, world), requires_grad=False)
    base.embed_tokens = embedding
    model.lm_head = VocabParallelLMHead(head_weight, world, group)
    return model


def num_parameters(model: nn.Module) -> int:
    """Distinct parameter elements held by this process (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
