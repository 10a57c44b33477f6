"""Tensor parallelism for Llama-style transformers models: each rank holds 1/world of the weights.

Megatron-LM's scheme (Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3): attention heads and MLP columns are split
across ranks (column-parallel q/k/v and gate/up projections), the following projection is row-parallel (o_proj,
down_proj) and its partial sums are all-reduced; the embedding and LM head are split over the vocabulary. Norms and
rotary tables are replicated (tiny). The attention modules reshape with `-1` heads, so a rank simply runs its own
heads, and its KV cache holds only those. Works with any torch.distributed backend (gloo on CPU, nccl on GPU).

The parallel modules take their shards ready-sliced. `install_shards` puts them into a model given a function that
returns a named tensor's part for this rank: `shard_model` slices a model already in memory, and
engine/models/shard_loading.py reads the parts straight from safetensors files (a rank never holds the full weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.models.cpu.linear import linear

# How a tensor is split across ranks (its part for one rank: `split_part`)
ROWS = "rows"  # dim 0: column-parallel weights and biases ([out, in] -> [out/world, in]), vocabulary shards
COLUMNS = "columns"  # dim 1: row-parallel weights ([out, in] -> [out, in/world])
WHOLE = "whole"  # replicated: norms, row-parallel biases

# (tensor name as in the model's state_dict, ROWS | COLUMNS | WHOLE) -> this rank's part of it
TakePart = Callable[[str, str], torch.Tensor]


class TensorParallelError(ValueError):
    """The model cannot be split this way (unsupported family, dtype, or sizes not divisible by the world size)."""


class CollectiveError(RuntimeError):
    """A collective failed (a peer rank died, or timed out): this process group can no longer compute."""


def all_reduce_sum(t: torch.Tensor, group) -> None:
    """Sum `t` over the group's ranks, in place; CollectiveError if a peer is gone or the group timed out."""
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as exc:
        raise CollectiveError(f"all_reduce failed: {exc}") from exc


def all_gather_parts(parts: list[torch.Tensor], t: torch.Tensor, group) -> None:
    """Every rank's `t` into `parts` (rank order); CollectiveError as all_reduce_sum."""
    try:
        dist.all_gather(parts, t, group=group)
    except RuntimeError as exc:
        raise CollectiveError(f"all_gather failed: {exc}") from exc


def part_range(size: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous range of `size` indices (size divisible by world: check_shardable)."""
    if size % world:
        raise TensorParallelError(f"a dimension of size {size} does not split into {world} equal parts")
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def split_part(t: torch.Tensor, split: str, rank: int, world: int) -> torch.Tensor:
    """This rank's part of `t`, a view (ROWS: a row range; COLUMNS: a column range; WHOLE: all of it)."""
    if split == ROWS:
        return t[part_range(t.shape[0], rank, world)]
    if split == COLUMNS:
        return t[:, part_range(t.shape[1], rank, world)]
    if split == WHOLE:
        return t
    raise ValueError(f"unknown split {split!r}")


def part_shape(shape: tuple[int, ...], split: str, world: int) -> tuple[int, ...]:
    """The shape of one rank's part of a tensor of `shape`."""
    dim = {ROWS: 0, COLUMNS: 1, WHOLE: None}[split]
    return tuple(n // world if i == dim else n for i, n in enumerate(shape))


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; no communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = _frozen(weight)  # [out/world, in]
        self.bias = None if bias is None else _frozen(bias)  # [out/world]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out/world]
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs all-reduced, bias (whole) added once after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None) -> None:
        super().__init__()
        self.weight = _frozen(weight)  # [out, in/world]
        self.bias = None if bias is None else _frozen(bias)  # [out]
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in/world] -> [..., out]
        out = linear(x, self.weight)
        all_reduce_sum(out, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*V/world, (rank+1)*V/world) of the table; each rank embeds its ids, the sum is all-reduced."""

    def __init__(self, weight: torch.Tensor, rank: int, group=None) -> None:
        super().__init__()
        self.weight = _frozen(weight)  # [V/world, H]
        self.start = rank * self.weight.shape[0]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N, H]
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        all_reduce_sum(out, self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice, all-gathered into the full vocabulary."""

    def __init__(self, weight: nn.Parameter, world: int, group=None) -> None:
        super().__init__()
        self.weight = weight  # [V/world, H]; the embedding shard's own Parameter when the model ties them
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        local = linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        all_gather_parts(parts, local, self.group)
        return torch.cat(parts, dim=-1)


def check_shardable(config, world: int) -> None:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = {"attention heads": heads, "key/value heads": kv_heads,
             "MLP intermediate size": getattr(config, "intermediate_size", 0), "vocabulary": config.vocab_size}
    bad = [f"{name} ({value})" for name, value in sizes.items() if not value or value % world]
    if bad:
        raise TensorParallelError(f"tp_size {world} must divide the model's {', '.join(bad)}")


def check_llama_style(model: nn.Module) -> None:
    """Raise TensorParallelError unless `model` has the Llama layout the sharding knows (works on a meta model)."""
    base = model.base_model
    if not hasattr(base, "layers") or not hasattr(base.layers[0], "self_attn") or not hasattr(
        base.layers[0].self_attn, "q_proj"
    ):
        raise TensorParallelError(
            f"tensor parallelism supports Llama-style models (q_proj/k_proj/v_proj/o_proj, gate/up/down_proj); "
            f"{type(model).__name__} is not one"
        )


def install_shards(model: nn.Module, take: TakePart, rank: int, world: int, group=None) -> nn.Module:
    """Replace a Llama-style model's projections, embedding and LM head by parallel modules holding the parts
    `take(name, split)` returns (name: the tensor's key in the model's state_dict, that is in its checkpoint).
    Norms and other modules stay as they are. A tied LM head shares the embedding shard."""
    check_llama_style(model)
    check_shardable(model.config, world)
    names = {id(m): name for name, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight

    def parts(module: nn.Module, split: str, bias_split: str):
        prefix = names[id(module)]
        bias = None if getattr(module, "bias", None) is None else take(f"{prefix}.bias", bias_split)
        return take(f"{prefix}.weight", split), bias

    for layer in model.base_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, column, row in ((attn, ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                   (mlp, ("gate_proj", "up_proj"), "down_proj")):
            for name in column:
                setattr(owner, name, ColumnParallelLinear(*parts(getattr(owner, name), ROWS, ROWS)))
            setattr(owner, row, RowParallelLinear(*parts(getattr(owner, row), COLUMNS, WHOLE), group=group))
    embedding = VocabParallelEmbedding(take(f"{names[id(embed)]}.weight", ROWS), rank, group)
    head_weight = embedding.weight if tied else _frozen(take(f"{names[id(head)]}.weight", ROWS))
    model.base_model.embed_tokens = embedding
    model.lm_head = VocabParallelLMHead(head_weight, world, group)
    return model


def shard_model(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Replace a Llama-style model's layers by this rank's shards, in place (the full weights are in memory first:
    engine/models/shard_loading.py loads a shard without that). world == 1 is a no-op."""
    if world == 1:
        return model
    tensors = dict(model.named_parameters())

    def take(name: str, split: str) -> torch.Tensor:  # a copy, so the full tensor can go
        return split_part(tensors[name].data, split, rank, world).clone(memory_format=torch.contiguous_format)

    return install_shards(model, take, rank, world, group)


def _split_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that are 1/world of a full tensor (the others are replicated)."""
    split = set()
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding, VocabParallelLMHead)):
            split.update(id(p) for p in m.parameters(recurse=False))
        elif isinstance(m, RowParallelLinear):
            split.add(id(m.weight))
    return split


def num_parameters(model: nn.Module) -> int:
    """Distinct parameter elements held by this process (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def full_num_parameters(model: nn.Module, world: int) -> int:
    """Parameter elements of the whole model, counted from one rank's shard (split tensors count world times)."""
    split = _split_parameters(model)
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * (world if id(p) in split else 1)
    return total
