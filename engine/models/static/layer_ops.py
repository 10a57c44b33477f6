"""A static decoder layer's elementwise work and attention, the ways a step can run them
(engine/models/static/forward.py), given the layer's shape (`LayerShape`) rather than the model.

- ATen operators (CUDA, compiled steps, CPUs without specserve's operators);
- on CPU, in fp32, engine/models/cpu/csrc/layer_ops.cpp's fused operators: one call each for a norm, a residual add
  with the next norm, SwiGLU, and RoPE with the KV-cache write, where ATen takes 3-20 calls (at decode sizes their
  dispatch, not their arithmetic, is the cost), and `cache_attention`, whose result for a query does not depend on
  the step's width or chunk (prefix caching relies on it);
- a CUDA graph's step: every index a device tensor, attention by engine/models/static/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.cpu import extension as cpu_extension
from engine.models.static import attention as attention_kernels
from engine.models.static import fused_ops
from engine.models.static.attention import RowIndex
from engine.models.static.rope import apply_rope

# the fused fp32 layer operators of engine/models/cpu/csrc/layer_ops.cpp an eager CPU step runs (`LayerOps`)
FUSED_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_to_cache", "cache_attention")
# devices whose eager steps (prompt chunks, shapes no graph was captured for) also run the Triton elementwise kernels
# of engine/models/static/fused_ops.py, as graph steps do: launches, not arithmetic, bound an eager CUDA step (measured
# on an H100: bench/RESULTS.md). Tests add "cpu" to run them in Triton's interpreter.
TRITON_EAGER_DEVICES = {"cuda"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., H], weight [H] fp32
    """RMSNorm computed in float32 (as transformers does for every family here), back in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def grouped_attention(
    q: torch.Tensor,  # [B, H, W, D]
    keys: torch.Tensor,  # [B, KVH, L, D] (a view of the cache)
    values: torch.Tensor,  # [B, KVH, L, D]
    visible: torch.Tensor,  # [B, 1, W, L] bool: key t is visible to query w of row b (`visible_keys`)
    scale: float,
) -> torch.Tensor:  # [B, H, W, D]
    """Causal attention over each row's own prefix, GQA without repeating keys/values.

    Query heads h = g*i + j (j < g) share key/value head i, as in transformers' `repeat_kv`, so the queries are
    viewed as [B, KVH, g*W, D] and multiplied with the cache directly. Rows of different lengths share the call,
    each sees only its own keys (positions past a row's length hold stale or zero entries that `visible` hides).
    """
    batch, heads, width, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    qg = q.reshape(batch, kv_heads, groups * width, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, KVH, g*W, L]
    scores = scores.view(batch, kv_heads, groups, width, length)
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype).view(batch, kv_heads, groups * width, length)
    return torch.matmul(probs, values).view(batch, heads, width, dim)


def visible_keys(positions: torch.Tensor, kv_len: int,
                 ancestors: torch.Tensor | None = None,  # [B, W] int64 bitmasks (a tree step), None: causal
                 ) -> torch.Tensor:  # positions [B, W] -> [B, 1, W, L] bool
    """Key position t is visible to a query at position p iff t <= p (built once per step, shared by the layers). In
    a tree step (engine/spec/tree.py) query w of row b sees the row's committed keys (before the step's first
    position s) and the step's keys s + j for the set bits j of ancestors[b, w]: its own path."""
    t = torch.arange(kv_len, device=positions.device)[None, None, :]  # [1, 1, L]
    if ancestors is None:
        return (t <= positions[:, :, None])[:, None]
    start = positions[:, :1, None]  # [B, 1, 1]
    offset = t - start  # [B, 1, L]
    in_step = (offset >= 0) & (offset < positions.shape[1])
    bits = (ancestors[:, :, None] >> offset.clamp(0, 62)) & 1  # [B, W, L]
    return ((t < start) | (in_step & (bits == 1)))[:, None]


def use_fused_attention(device: torch.device, batch: int, width: int) -> bool:
    """Eager CPU steps of one token per row, or of at most 2 rows, run attention as one SDPA call (its fused CPU
    kernel with native GQA); other shapes keep `grouped_attention`. At SmolLM2-135M's shapes (9 heads, 3 KV heads,
    256 keys, 2 threads) SDPA was faster per layer at width 1 for every batch measured and at width 4 for a small
    batch, but slower at width 4 for a larger one (measured: bench/RESULTS.md).
    CUDA and compiled steps keep `grouped_attention` (measured there; the compiled graph fuses it)."""
    return device.type == "cpu" and (width == 1 or batch <= 2) and not torch.compiler.is_compiling()


@dataclass(frozen=True)
class LayerShape:
    """What a layer's elementwise work and attention need to know of the model, built once per model
    (`StaticLlama.layer_shape`): this rank's heads, the norms' epsilon, the MLP's activation, and the activation and
    KV-cache dtypes (which decide whether the fused CPU operators can run)."""

    num_heads: int  # query heads on this rank (a tensor-parallel shard holds 1/world of them)
    num_kv_heads: int  # key/value heads on this rank
    head_dim: int
    eps: float  # RMSNorm's epsilon
    gelu: bool  # GELU-tanh MLP (Gemma); else SiLU (SwiGLU)
    dtype: torch.dtype  # activations
    cache_dtype: torch.dtype  # the KV cache's

    @classmethod
    def of(cls, config, world: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> "LayerShape":
        """From a transformers config, for one of `world` tensor-parallel ranks."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        return cls(num_heads=config.num_attention_heads // world, num_kv_heads=kv_heads // world, head_dim=head_dim,
                   eps=getattr(config, "rms_norm_eps", 1e-6), gelu=act != "silu", dtype=dtype,
                   cache_dtype=cache_dtype)

    @property
    def q_size(self) -> int:  # the queries' width in the fused q/k/v projection's output
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # the keys' (and the values') width there
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:  # attention's softmax scale
        return self.head_dim ** -0.5


class LayerOps:
    """A layer's elementwise work: ATen operators, or on CPU in fp32 engine/models/cpu/csrc/layer_ops.cpp's fused ones
    (one call each for a norm, a residual add with the next norm, SwiGLU, and RoPE with the KV-cache write, where ATen
    takes 3-20 calls; at decode sizes their dispatch, not their arithmetic, is the cost). Compiled steps keep ATen's
    (inductor fuses them itself)."""

    def __init__(self, shape: LayerShape,
                 cos: torch.Tensor,  # [capacity, D]: RoPE's tables (engine/models/static/rope.py)
                 sin: torch.Tensor,  # [capacity, D]
                 fused: dict | None,
                 positions: torch.Tensor,  # [B, W]
                 first_slot: int, kv_len: int, rows: RowIndex | None = None,
                 depths: torch.Tensor | None = None,  # [B, W] int64: a tree step's depths (RoPE at start + depth)
                 ancestors: torch.Tensor | None = None,  # [B, W] int64: a tree step's ancestor bitmasks
                 ) -> None:
        self.shape, self.cos, self.sin, self.fused = shape, cos, sin, fused
        self.positions, self.first_slot, self.kv_len = positions, first_slot, kv_len  # the step's, [B, W] positions
        self.rows = rows  # a graph step's slots and key limits as device tensors (`StaticLlama.forward_rows`)
        # a tree step (engine/spec/tree.py): token w of row b is written at positions[b, w] but rotated at its depth
        # below the step's first position, and sees only its own path among the step's tokens
        if rows is not None:
            depths, ancestors = rows.depths, rows.ancestors
        self.depths, self.ancestors = depths, ancestors
        self.rope_positions = positions if depths is None else positions[:, :1] + depths  # [B, W]
        # the elementwise work as one Triton kernel each (engine/models/static/fused_ops.py): graph steps, and eager
        # steps on TRITON_EAGER_DEVICES (their attention stays ATen's)
        self.triton = ((rows is not None or positions.device.type in TRITON_EAGER_DEVICES)
                       and not torch.compiler.is_compiling() and fused_ops.available())
        self._cache_rows = rows  # where RoPE's kernel writes each row's keys and values
        self._visible: torch.Tensor | None = None

    @classmethod
    def for_step(cls, shape: LayerShape,
                 cos: torch.Tensor,  # [capacity, D]
                 sin: torch.Tensor,  # [capacity, D]
                 positions: torch.Tensor,  # [B, W]
                 first_slot: int, kv_len: int,
                 depths: torch.Tensor | None = None,  # [B, W] int64: a tree step's (None: a chain)
                 ancestors: torch.Tensor | None = None,  # [B, W] int64
                 ) -> "LayerOps":
        """An eager or compiled step's: on CPU in fp32 over an fp32 or bf16 cache, the fused operators where they
        load."""
        fused = None
        if (positions.device.type == "cpu" and shape.dtype == torch.float32
                and shape.cache_dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()):
            fused = {name: cpu_extension.op(name) for name in FUSED_OPS}
            fused = fused if all(fused.values()) else None
        return cls(shape, cos, sin, fused, positions, first_slot, kv_len, depths=depths, ancestors=ancestors)

    def cache_rows(self) -> RowIndex:
        """The step's rows as device tensors: a graph step's own, or an eager step's consecutive slots from
        first_slot and its rows' start positions (built once per step)."""
        if self._cache_rows is None:
            starts = self.positions[:, 0].contiguous()
            slots = torch.arange(self.first_slot, self.first_slot + starts.shape[0], device=starts.device)
            self._cache_rows = RowIndex(slots=slots, starts=starts, limits=starts + self.positions.shape[1],
                                        depths=self.depths, ancestors=self.ancestors)
        return self._cache_rows

    def visible(self) -> torch.Tensor:  # [B, 1, W, L]: built once per step, and only where a path masks
        if self._visible is None:
            self._visible = visible_keys(self.positions, self.kv_len, self.ancestors)
        return self._visible

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [B, W, H]
        if self.triton:
            return fused_ops.rms_norm(x, weight, self.shape.eps)
        if self.fused is not None:
            return self.fused["rms_norm"](x, weight, self.shape.eps)
        return _rms_norm(x, weight, self.shape.eps)

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, W, H] hidden + delta, its norm)
        if self.triton:
            return fused_ops.add_rms_norm(hidden, delta, weight, self.shape.eps)
        if self.fused is not None:  # adds in place: `hidden` is the step's own tensor
            return hidden, self.fused["add_rms_norm"](hidden, delta.contiguous(), weight, self.shape.eps)
        hidden = hidden + delta
        return hidden, _rms_norm(hidden, weight, self.shape.eps)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [B, W, 2I] -> [B, W, I]
        if self.triton and not self.shape.gelu:
            return fused_ops.silu_mul(gate_up)
        if self.fused is not None and not self.shape.gelu:
            return self.fused["silu_mul"](gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.shape.gelu else F.silu(gate)) * up

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> torch.Tensor:  # q [B, H, W, D] -> [B, H, W, D]
        """Causal GQA attention over each row's cached keys: by `cache_attention` where the fused operators run (each
        row reads only its own keys, nothing is materialized, and a query's result does not depend on the step's
        width or on the chunk it falls in: `layout_invariant`); else one SDPA call (`use_fused_attention`) or
        `grouped_attention`."""
        m, (batch, _, width, _) = self.shape, q.shape
        first, kv_len = self.first_slot, self.kv_len
        if self.rows is not None:
            return attention_kernels.cache_attention(q, k_cache, v_cache, self.rows, m.scale)
        if self.fused is not None and m.head_dim % 8 == 0:  # a tree node over its own path: decoding that path's bits
            return self.fused["cache_attention"](q.contiguous(), k_cache, v_cache, first, self.positions, kv_len,
                                                 m.scale, self.ancestors)
        keys = k_cache[first : first + batch, :, :kv_len].to(q.dtype)
        values = v_cache[first : first + batch, :, :kv_len].to(q.dtype)
        if self.fused is not None and batch > 1:
            # prompt chunks on the CPU operators: one SDPA call per row, so a row's prefill is the same computation
            # whatever prompts share the forward (with bf16 products a last-bit difference here becomes a bf16
            # rounding step: grouped and alone prefills of SmolLM2 gave first-token logits 0.07-0.24 apart)
            visible = self.visible()
            return torch.cat([F.scaled_dot_product_attention(q[b : b + 1], keys[b : b + 1], values[b : b + 1],
                                                             attn_mask=visible[b : b + 1], scale=m.scale,
                                                             enable_gqa=True) for b in range(batch)])
        if use_fused_attention(q.device, batch, width):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.visible(), scale=m.scale,
                                                  enable_gqa=True)
        return grouped_attention(q, keys, values, self.visible(), m.scale)

    def rope_to_cache(self, qkv: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:  # qkv [B, W, ...] -> q [B, H, W, D]
        """RoPE on the queries and keys; keys and values written to the cache at (first_slot + b, :, position)."""
        m, positions, first_slot = self.shape, self.positions, self.first_slot
        if self.triton:
            return fused_ops.rope_to_cache(qkv, self.cos, self.sin, self.cache_rows(), k_cache, v_cache, m.num_heads,
                                           m.num_kv_heads)
        if self.fused is not None:
            rotate_at = None if self.depths is None else self.rope_positions  # a chain rotates where it writes
            return self.fused["rope_to_cache"](qkv.contiguous(), self.cos, self.sin, positions, k_cache, v_cache,
                                               first_slot, m.num_heads, m.num_kv_heads, rotate_at)
        batch, width = positions.shape
        cos, sin = self.cos[self.rope_positions][:, None], self.sin[self.rope_positions][:, None]  # [B, 1, W, D]
        q = qkv[..., : m.q_size].view(batch, width, -1, m.head_dim).transpose(1, 2)
        k = qkv[..., m.q_size : m.q_size + m.kv_size].view(batch, width, -1, m.head_dim)
        v = qkv[..., m.q_size + m.kv_size :].view(batch, width, -1, m.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if self.rows is not None:
            slots = self.rows.slots[:, None]  # [B, 1]
        else:
            slots = torch.arange(first_slot, first_slot + batch, device=qkv.device)[:, None]
        k_cache[slots, :, positions] = k.transpose(1, 2).to(k_cache.dtype)  # [B, W, KVH, D] at (slot, pos)
        v_cache[slots, :, positions] = v.to(v_cache.dtype)
        return q
