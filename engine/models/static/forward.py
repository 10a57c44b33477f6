"""A device-agnostic, compile-friendly decoder forward for the Llama family over a preallocated KV cache.

The transformers modules carry per-operator Python and build a dense additive mask per step; on CUDA such a mask
also turns off SDPA's native GQA and flash kernels. This forward is one function of fixed-shape tensors, so
`torch.compile` turns it into a few fused kernels (inductor with frozen, prepacked weights on CPU; CUDA graphs on
CUDA), in the spirit of gpt-fast's `model.py` (static cache + `torch.compile(mode="reduce-overhead")`):

- q/k/v and gate/up projections fused into one matrix each (4 matrix products per layer instead of 7);
- RoPE from a cos/sin table built once by the model's own `rotary_emb` (every static RoPE variant transformers
  knows: default, linear, llama3, yarn, ...);
- keys/values live in one preallocated buffer per layer, `[slots, kv_heads, capacity, head_dim]`; a forward runs
  over a contiguous range of slots, so it reads views, never a gather copy;
- attention with native GQA (queries grouped under their key/value head: keys and values are never repeated) and
  no host-built mask: each row's causal limit comes from its own start position, inside the graph.

Families: Llama, Mistral, Qwen2 (q/k/v biases) and Gemma (embedding scaled by sqrt(hidden), (1 + w) RMSNorm
weights, GELU-tanh MLP). Others keep the transformers path (engine/models/transformers_runner.py). A tensor-parallel
rank's shard (engine/models/tensor_parallel.py) runs here too, its heads and KV cache only, with collectives:
engine/models/static/tp.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu import bf16_products
from engine.models.cpu import extension as cpu_extension
from engine.models.cpu.linear import kernel_takes, linear, pack_bf16, small_gemm_for, unpack_bf16
from engine.models.quantize import Int8WeightOnlyLinear
from engine.models.static.attention import RowIndex
from engine.models.static.layer_ops import LayerOps, LayerShape
from engine.models.static.rope import rope_tables, why_rope_unsupported
from engine.models.static.tp import (
    Shard,
    embed,
    gather_vocab,
    reduce_sum,
    row_parallel_bias,
    shard_of,
    why_shard_unsupported,
)

FAMILIES = ("llama", "mistral", "qwen2", "gemma")
# ATen's int8 weight-only kernel is built for decode (a few rows); a prompt chunk dequantizes for one dense product
INT8_KERNEL_MAX_ROWS = 32
# forwards of at most this many tokens per row are steps (decode, verify, a token tree's nodes): their fp32 products
# take the CPU kernel, so a verify scores each position with the bits a decode step gives it (greedy speculation is
# plain decoding token for token). The runner's widest step (runner.MAX_WIDTH); wider forwards are prompt chunks.
STEP_MAX_WIDTH = 16


class UnsupportedModel(ValueError):
    """The model is outside the fast path (family, activation, RoPE variant, or already sharded)."""


def why_unsupported(model: nn.Module) -> str | None:
    """None if `StaticLlama` can run `model`, else the reason."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model family {config.model_type!r} (fast path: {', '.join(FAMILIES)})"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu"):
        return f"activation {act!r}"
    rope = why_rope_unsupported(config)
    if rope is not None:
        return rope
    base = model.base_model
    if shard_of(model) is not None:
        return why_shard_unsupported(model)
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(m) in (nn.Linear, Int8WeightOnlyLinear) or type(m).__name__ == "SmallBatchLinear"
                   for m in mods):
            return "projections are not plain (or int8 weight-only) linear layers (a tensor-parallel shard?)"
    if not isinstance(base.embed_tokens, nn.Embedding):
        return "the embedding is not a plain nn.Embedding"
    return None


def _fuse(modules: list[nn.Module], dtype: torch.dtype, with_bias: bool = True,
          weight_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight [out, in] in `weight_dtype` (default `dtype`), int8 scales [out] or None, bias [out] or None) of
    projections fused along outputs (`with_bias=False`: biases left out, a row-parallel layer's whole bias is added
    after its all-reduce)."""
    if all(isinstance(m, Int8WeightOnlyLinear) for m in modules):
        weight = torch.cat([m.weight_int8 for m in modules])
        scales = torch.cat([m.scales for m in modules]).to(dtype)
    else:
        weight, scales = torch.cat([m.weight.detach() for m in modules]).to(weight_dtype or dtype), None
    biases = [getattr(m, "bias", None) if with_bias else None for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach().to(dtype) if b is not None
                          else torch.zeros(m.weight.shape[0], dtype=dtype, device=m.weight.device)
                          for m, b in zip(modules, biases)])
    return weight, scales, bias


class Projection(nn.Module):
    """One fused projection; int8 weights (per-channel scales) are dequantized inside the product."""

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype, with_bias: bool = True,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        weight, scales, bias = _fuse(modules, dtype, with_bias, weight_dtype)
        self.out_features, self.in_features = weight.shape
        # a bf16 weight beside fp32 activations on a CPU with AVX512_BF16: packed once for bf16_gemm (or AMX tiles,
        # cpu/bf16_products.py), which then computes every product of it (steps and prompt chunks); the [out, in]
        # copy is not kept
        self.packed = None
        if (scales is None and weight.dtype == torch.bfloat16 and dtype == torch.float32
                and weight.device.type == "cpu" and cpu_extension.bf16_gemm() is not None):
            self.packed = nn.Parameter(pack_bf16(weight), requires_grad=False)
            weight = None
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.scales = None if scales is None else nn.Parameter(scales, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # ATen's CPU int8 kernel is fast only for bf16 activations (several times faster than with fp32 inputs on
        # this project's AVX2 machine: bench/RESULTS.md), even where bf16 arithmetic is
        # emulated; so an fp32 model casts the few rows it feeds it, and the rest of the step stays fp32
        self.kernel_scales = None
        if scales is not None and weight.device.type == "cpu":
            self.kernel_scales = nn.Parameter(scales.to(torch.bfloat16), requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids [N] -> [N, in], the weight's dtype (int8: dequantized)
        """Some output rows of the weight as a dense matrix (a draft vocabulary's rows of the LM head)."""
        if self.packed is not None:
            return unpack_bf16(self.packed, self.out_features, self.in_features)[ids]
        if self.scales is not None:
            return self.weight[ids].to(self.scales.dtype) * self.scales[ids, None]
        return self.weight[ids]

    def forward(self, x: torch.Tensor, step: bool | None = None) -> torch.Tensor:  # [..., in] -> [..., out]
        """`step`: a decode/verify step (True) or a prompt chunk (False); which CPU kernel runs (cpu/linear.py)."""
        if self.packed is not None:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return bf16_products.current()(rows, self.packed, self.out_features, self.bias).reshape(
                *x.shape[:-1], self.out_features)
        if self.scales is None:
            return linear(x, self.weight, self.bias, step)  # on CPU: specserve's kernel or ATen's, cpu/linear.py
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        kernel = small_gemm_for(x, self.weight)
        if kernel is not None and kernel_takes(rows.shape[0], self.weight, step):
            # int8 widened to fp32 in registers, fp32 activations and sums, scaled per output channel
            return kernel(rows.contiguous(), self.weight, self.bias, self.scales).reshape(*shape[:-1], -1)
        if x.device.type == "cpu" and rows.shape[0] <= INT8_KERNEL_MAX_ROWS and kernel is None:
            out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight, self.kernel_scales).to(x.dtype)
        else:  # prefill on CPU, and CUDA: dequantize inside the product (gpt-fast's WeightOnlyInt8Linear)
            out = F.linear(rows, self.weight.to(x.dtype)) * self.scales
        out = out.reshape(*shape[:-1], -1)
        return out if self.bias is None else out + self.bias


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, dtype: torch.dtype, norm_offset: float, weight_dtype: torch.dtype) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = nn.Parameter(layer.input_layernorm.weight.detach().float() + norm_offset,
                                       requires_grad=False)
        self.post_norm = nn.Parameter(layer.post_attention_layernorm.weight.detach().float() + norm_offset,
                                      requires_grad=False)
        self.qkv = Projection([attn.q_proj, attn.k_proj, attn.v_proj], dtype, weight_dtype=weight_dtype)
        self.gate_up = Projection([mlp.gate_proj, mlp.up_proj], dtype, weight_dtype=weight_dtype)
        # row-parallel (a shard): the product's partial sums are all-reduced, then the whole bias is added once
        self.o_bias, self.down_bias = row_parallel_bias(attn.o_proj, dtype), row_parallel_bias(mlp.down_proj, dtype)
        self.o = Projection([attn.o_proj], dtype, with_bias=self.o_bias is None, weight_dtype=weight_dtype)
        self.down = Projection([mlp.down_proj], dtype, with_bias=self.down_bias is None, weight_dtype=weight_dtype)


class StaticLlama(nn.Module):
    """The model's weights (fused, in `weight_dtype`, default `dtype`) and its preallocated KV cache: `num_slots`
    sequences of `capacity` positions; activations, norms and the cache in `dtype`. Build with
    `StaticLlama.from_model`; the transformers model can be dropped after.

    `weight_dtype=bfloat16` with `dtype=float32` is how bf16 models run on CPU (engine/factory.cpu_step_dtypes): each
    product is a bf16 product (activations rounded to bf16, fp32 sums and output), so a step reads half the bytes of
    an fp32 model, and norms, residuals, RoPE and attention compute in fp32 (over a `cache_dtype` KV cache: fp32 or
    bf16, engine/factory.kv_cache_dtype_for). On CPUs with AVX512_BF16 the weights are packed once for
    engine/models/cpu/csrc/bf16_gemm.cpp (VDPBF16PS) or amx_gemm.cpp (AMX tiles), whichever
    engine/models/cpu/bf16_products.py measured faster; elsewhere engine/models/cpu/csrc/small_gemm.cpp widens
    them as they stream in."""

    def __init__(self, model: nn.Module, num_slots: int, capacity: int, dtype: torch.dtype | None = None,
                 cache_dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        reason = why_unsupported(model)
        if reason is not None:
            raise UnsupportedModel(reason)
        config, base = model.config, model.base_model
        param = next(model.parameters())
        device = param.device
        dtype = dtype or (param.dtype if param.is_floating_point() else torch.float32)
        gemma = config.model_type == "gemma"
        weight_dtype = weight_dtype or dtype
        self.dtype, self.weight_dtype, self.device = dtype, weight_dtype, device
        self.num_slots, self.capacity = num_slots, capacity
        self.shard: Shard | None = shard_of(model)  # a tensor-parallel rank's: its heads, KV heads, vocabulary rows
        world = self.shard.world if self.shard else 1
        cache_dtype = cache_dtype or dtype
        self.layer_shape = LayerShape.of(config, world, dtype, cache_dtype)  # what the layers' operators read
        self.embed_scale = math.sqrt(config.hidden_size) if gemma else None
        norm_offset = 1.0 if gemma else 0.0
        self.embed = nn.Parameter(base.embed_tokens.weight.detach().to(weight_dtype), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(layer, dtype, norm_offset, weight_dtype) for layer in base.layers)
        self.final_norm = nn.Parameter(base.norm.weight.detach().float() + norm_offset, requires_grad=False)
        head = model.get_output_embeddings()
        self.lm_head = Projection([head], dtype, weight_dtype=weight_dtype)
        if getattr(head, "weight", None) is base.embed_tokens.weight and self.lm_head.scales is None:
            self.lm_head.weight = self.embed  # tied: one copy
        self.vocab_size = self.lm_head.out_features * world
        first = self.layers[0]
        if first.qkv.packed is not None:  # which batch-invariant operator computes bf16 products here, measured
            bf16_products.choose([(p.packed, p.out_features) for p in (first.qkv, first.o, first.gate_up, first.down)])
        cos, sin = rope_tables(base.rotary_emb, capacity, device)
        self.register_buffer("cos", cos.to(dtype), persistent=False)  # [capacity, D]
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        shape = (num_slots, self.layer_shape.num_kv_heads, capacity, self.layer_shape.head_dim)
        # zeros, not empty: a masked position gets probability 0, and 0 * NaN would still be NaN
        # buffers (not plain attributes): compiled graphs, CUDA graphs included, then treat them as static state
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=cache_dtype, device=device), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=cache_dtype, device=device), persistent=False)

    @property
    def k_cache(self) -> list[torch.Tensor]:  # per layer [slots, KVH, capacity, D]
        return [getattr(self, f"k_cache_{i}") for i in range(len(self.layers))]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return [getattr(self, f"v_cache_{i}") for i in range(len(self.layers))]

    @staticmethod
    def slot_bytes(config, capacity: int, dtype: torch.dtype, world: int = 1) -> int:
        """KV-cache bytes of one slot (keys and values of every layer) on one of `world` tensor-parallel ranks,
        which holds 1/world of the key/value heads."""
        shape = LayerShape.of(config, world, dtype, dtype)
        element = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * shape.num_kv_heads * capacity * shape.head_dim * element

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, W] int64: row b feeds these tokens (its slot is first_slot + b)
        starts: torch.Tensor,  # [B] int64: positions already in row b's cache; row b writes starts[b] .. + W - 1
        first_slot: int,
        kv_len: int,  # keys read per row: >= max(starts) + W over the rows whose outputs are used
        last_only: bool = False,  # logits of the last position only (a prefill chunk)
        num_layers: int | Sequence[int] | None = None,  # the first layers (an early exit), or these layer ids
        depths: torch.Tensor | None = None,  # [B, W] int64: a tree step's (engine/spec/tree.py); None: a chain
        ancestors: torch.Tensor | None = None,  # [B, W] int64 bitmasks: the step's tokens each one sees
    ) -> torch.Tensor:  # [B, W or 1, V] float32
        """A step of `W` tokens per row. A tree step (`depths`, `ancestors`) writes token w at starts[b] + w, rotates
        it at starts[b] + depths[b, w] and lets it see the committed keys and its own path only (tree attention)."""
        positions = starts[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]  # [B, W]
        ops = LayerOps.for_step(self.layer_shape, self.cos, self.sin, positions, first_slot, kv_len, depths=depths,
                                ancestors=ancestors)
        return self._layers(tokens, ops, last_only, num_layers)

    def forward_rows(
        self,
        tokens: torch.Tensor,  # [B, W] int64
        rows: RowIndex,  # each row's slot, start and key limit, as device tensors
        num_layers: int | None = None,  # the first layers only (an early exit: `forward`)
    ) -> torch.Tensor:  # [B, W, V] float32
        """A decode or verify step whose every index is a device tensor (what a CUDA graph replays): row b writes
        slot `rows.slots[b]` at positions `rows.starts[b]..+W-1` and attends over that slot's keys up to its own
        length (engine/models/static/attention.py), so one captured graph serves any rows, slots and context lengths."""
        positions = rows.starts[:, None] + torch.arange(tokens.shape[1], device=tokens.device)[None, :]  # [B, W]
        ops = LayerOps(self.layer_shape, self.cos, self.sin, None, positions, 0, self.capacity, rows)
        return self._layers(tokens, ops, last_only=False, num_layers=num_layers)

    def keep_hidden(self, max_rows: int, max_width: int) -> None:
        """From now on every full step of at most `max_rows` x `max_width` tokens leaves its final hidden states
        (after the final norm: what the LM head reads) in `hidden_out`, for a draft source that reads them (Medusa
        heads, engine/proposers/medusa.py). A buffer, not an output: a CUDA graph's capture copies into it too."""
        self.register_buffer("hidden_out", torch.zeros(max_rows, max_width, self.final_norm.shape[0],
                                                       dtype=self.dtype, device=self.device), persistent=False)

    def keep_aux(self, layers: Sequence[int], max_rows: int, max_width: int) -> None:
        """From now on every full forward leaves the states entering `layers` (the residual stream before each one's
        input norm; `len(self.layers)`: the last layer's output, before the final norm), concatenated in that order,
        at every position it computes: `aux_last` [B, W, len(layers) * H] (any forward; a prompt chunk's too), and
        for steps of at most `max_rows` x `max_width` tokens in the `aux_out` buffer, which a CUDA graph's capture
        copies into (an EAGLE-3 head reads them: engine/proposers/eagle3.py)."""
        if any(not 0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"aux layers {list(layers)} outside the target's {len(self.layers)} layers")
        self.aux_layers = tuple(layers)
        width = len(layers) * self.final_norm.shape[0]
        self.register_buffer("aux_out", torch.zeros(max_rows, max_width, width, dtype=self.dtype, device=self.device),
                             persistent=False)

    def add_slot_cache(self, name: str, cache: torch.Tensor) -> None:  # [slots, X, capacity, Y]
        """Another per-slot, per-position cache (a draft head's keys or values) that moves with the sequences' slots
        (`move_slot`: compaction on release, the prefix cache's copies)."""
        assert cache.shape[0] == self.num_slots and cache.shape[2] == self.capacity
        self.register_buffer(name, cache, persistent=False)
        self.slot_caches = (*getattr(self, "slot_caches", ()), name)

    def _layers(self, tokens: torch.Tensor,  # [B, W] int64
                ops: LayerOps, last_only: bool, num_layers: int | Sequence[int] | None = None
                ) -> torch.Tensor:  # [B, W or 1, V] float32
        """Every layer, or the first `num_layers` (an early exit: only their keys and values are written), or the
        layers a tuple of ids names, in order (the others skipped, as Draft & Verify's self-speculation skips middle
        layers: Zhang et al. 2023, arXiv 2309.08168), then the final norm and the LM head."""
        batch, width = tokens.shape
        if num_layers is None:
            ids = range(len(self.layers))
        else:
            ids = range(num_layers) if isinstance(num_layers, int) else tuple(num_layers)
        layers = [self.layers[i] for i in ids]
        hidden = F.embedding(tokens, self.embed) if self.shard is None else embed(tokens, self.embed, self.shard)
        hidden = hidden.to(self.dtype)  # [B, W, H]: bf16 weights beside fp32 activations are widened here
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        # decode/verify steps run every product on the CPU kernel, whatever the batch, so a row's step is computed
        # the same in any batch; fp32 prompt chunks (compute-bound) take MKL (bf16 ones stay on the kernel too:
        # engine/models/cpu/linear.linear)
        step = width <= STEP_MAX_WIDTH
        aux_layers = getattr(self, "aux_layers", ()) if num_layers is None else ()
        aux = {}
        x = ops.norm(hidden, layers[0].input_norm)
        for index, (layer_id, layer) in enumerate(zip(ids, layers)):
            if index in aux_layers:
                aux[index] = hidden.clone()  # add_norm may update the residual stream in place
            k_cache, v_cache = getattr(self, f"k_cache_{layer_id}"), getattr(self, f"v_cache_{layer_id}")
            q = ops.rope_to_cache(layer.qkv(x, step), k_cache, v_cache)  # [B, H, W, D]
            attn = ops.attention(q, k_cache, v_cache)
            attn = attn.transpose(1, 2).reshape(batch, width, -1)
            hidden, x = ops.add_norm(hidden, self._row_parallel(layer.o, layer.o_bias, attn, step), layer.post_norm)
            mlp = self._row_parallel(layer.down, layer.down_bias, ops.activation(layer.gate_up(x, step)), step)
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else self.final_norm
            hidden, x = ops.add_norm(hidden, mlp, next_norm)
        if aux_layers:
            aux[len(layers)] = hidden
            self.aux_last = torch.cat([aux[i] for i in aux_layers], dim=-1)  # [B, W, len(aux_layers) * H]
            if batch <= self.aux_out.shape[0] and width <= self.aux_out.shape[1]:
                self.aux_out[:batch, :width].copy_(self.aux_last)
        kept = getattr(self, "hidden_out", None)
        if kept is not None and num_layers is None and not last_only and batch <= kept.shape[0] \
                and width <= kept.shape[1]:
            kept[:batch, :width].copy_(x)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(x, step or last_only)
        return (logits if self.shard is None else gather_vocab(logits, self.shard)).float()

    def _row_parallel(self, projection: Projection, bias: torch.Tensor | None, x: torch.Tensor,
                      step: bool) -> torch.Tensor:  # [B, W, in (/world)] -> [B, W, H]
        """o_proj / down_proj: whole, or a shard's partial product summed over the ranks (then its whole bias)."""
        out = projection(x, step)
        if self.shard is None:
            return out
        out = reduce_sum(out, self.shard)
        return out if bias is None else out + bias

    @torch.no_grad()
    def move_slot(self, src: int, dst: int, length: int, start: int = 0) -> None:
        """Copy positions [start, length) of slot `src`'s keys and values into slot `dst`."""
        for cache in self._slot_caches():
            cache[dst, :, start:length] = cache[src, :, start:length]

    @torch.no_grad()
    def move_positions(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Within one slot, copy the keys and values at positions `src` to positions `dst` (a tree's accepted path
        into place: engine/spec/tree.py); every source is read before any destination is written. The layers'
        caches only: a draft head's own cache (`add_slot_cache`) is refilled from the kept states by its catch-up."""
        src_t = torch.tensor(list(src), device=self.device)
        dst_t = torch.tensor(list(dst), device=self.device)
        for cache in self.k_cache + self.v_cache:
            cache[slot, :, dst_t] = cache[slot, :, src_t]

    def _slot_caches(self) -> list[torch.Tensor]:  # every per-slot, per-position cache: the layers', the heads'
        return self.k_cache + self.v_cache + [getattr(self, n) for n in getattr(self, "slot_caches", ())]

