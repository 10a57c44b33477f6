"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840) as a plain torch module: the reference computation the served drafter
(engine/proposers/eagle3.py) is tested against, and what `specserve train-heads --method eagle3` trains
(engine/training/eagle3.py).

The head reads the target's hidden states entering three of its layers (`aux_layers`: by default 2, N // 2 and
N - 3 of N, as the paper, vLLM and speculators choose), concatenated and projected to its width by `fc` (Sec. 3.2,
"fusing low-, mid- and high-level features"). Its one decoder layer reads [norm(embedding of the next token);
hidden_norm(state)]: q/k/v project 2H -> heads, the residual is the state, then a Llama MLP; `norm` and `lm_head`
map its output to a draft vocabulary, and `d2t` maps draft ids to the target's (target = draft + d2t[draft]). At
position t it takes the fused state of target position t and the token at t + 1 and predicts the token at t + 2;
the following steps take its own output state (pre-norm, or post-norm with `norm_output`) in place of the fused
one, one position further each (Sec. 3.3, training-time test).

Module and parameter names are the speculators package's (`Eagle3DraftModel`: `fc`, `layers.0.*`, `norm`,
`lm_head`, `d2t`, `t2d`), so `state_dict()` is a speculators checkpoint; EAGLE's own checkpoints name the layer
`midlayer` (engine/proposers/eagle3_checkpoint.py maps it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from engine.models.static.rope import apply_rope


@dataclass(frozen=True)
class Eagle3Config:
    layer: LlamaConfig  # the decoder layer's shape (hidden_size, heads, rope, rms_norm_eps, vocab_size: the target's)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input states the head fuses
    target_hidden_size: int
    norm_before_residual: bool = False  # the residual is the normed state (speculators' option)
    norm_output: bool = False  # steps after the first read the post-norm state (speculators' "Eagle 3.1")
    norm_before_fc: bool = False  # one RMSNorm over the concatenated states before fc
    fc_norm: bool = False  # an RMSNorm per aux state before concatenation

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:  # the target's
        return self.layer.vocab_size

    @property
    def head_dim(self) -> int:
        return getattr(self.layer, "head_dim", None) or self.layer.hidden_size // self.layer.num_attention_heads


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The paper's, vLLM's and speculators' default: low, middle and high (2, N // 2, N - 3)."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = config.layer
        bias = bool(getattr(c, "attention_bias", False))
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # x [B, W, 2H], cos/sin [B, 1, W, D]
        """q [B, heads, W, D] and k, v [B, kv_heads, W, D], q and k rotated."""
        b, w, _ = x.shape
        q = self.q_proj(x).view(b, w, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, w, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, w, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding); hidden_norm(state)], residual the state."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = config.layer
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, W, H] each -> [B, W, 2H], residual [B, W, H]
        normed = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), (normed if self.norm_before_residual
                                                                              else hidden)

    def after_attention(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:  # [B, W, H] each
        hidden = residual + self.self_attn.o_proj(attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The head's weights in speculators' layout, and its forward over whole sequences with training-time test."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = config.layer
        if getattr(c, "num_hidden_layers", 1) != 1:
            raise ValueError("EAGLE-3 heads here have one decoder layer (transformer_layer_config.num_hidden_layers)")
        self.config = config
        n = len(config.aux_layers)
        self.fc = nn.Linear(n * config.target_hidden_size, c.hidden_size, bias=False)
        self.input_norm = LlamaRMSNorm(n * config.target_hidden_size, eps=c.rms_norm_eps) \
            if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, eps=c.rms_norm_eps) for _ in range(n)) \
            if config.fc_norm else None
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c)
        self.embed_tokens: nn.Embedding | None = None  # the target's is used unless a checkpoint has its own
        if config.draft_vocab_size != config.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:  # [draft_vocab] ascending target ids
        """d2t and t2d for a draft vocabulary of these target tokens."""
        self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [..., n * target H] -> [..., H]
        """The target's aux states fused to the head's width (`fc`, after the optional norms)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(aux)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # the layer's output [..., H] -> [..., draft vocab]
        return self.lm_head(self.norm(out))

    def carried(self, out: torch.Tensor) -> torch.Tensor:
        """The state the next step reads: the layer's output, or its norm with `norm_output`."""
        return self.norm(out) if self.config.norm_output else out

    def forward(self, aux: torch.Tensor,  # [B, T, n * target H]: the target's states at positions 0..T-1
                embeds: torch.Tensor,  # [B, T + steps - 1, H]: embeddings of the tokens at positions 1..T+steps-1
                steps: int = 1) -> list[torch.Tensor]:  # per step [B, T, draft vocab]
        """Training-time test (arXiv 2503.01840, Sec. 3.3) over whole sequences: step 0 at position t reads the fused
        state of t and the token at t + 1, predicting t + 2; step j reads its step j - 1 state at t and the token at
        t + 1 + j (the true one: teacher forcing), at rotary position t + j, attending over step 0's keys at
        positions <= t and its own earlier steps' keys at t (what a draft sees at inference after j steps)."""
        b, t, _ = aux.shape
        hidden = self.fuse(aux)
        positions = torch.arange(t, device=aux.device)
        causal = positions[:, None] >= positions[None, :]  # [T, T]
        diagonal = torch.eye(t, dtype=torch.bool, device=aux.device)
        keys, values, out = [], [], []
        for step in range(steps):
            cos, sin = self.rotary(hidden, (positions + step)[None])
            x, residual = self.layer.attention_input(embeds[:, step:step + t], hidden)
            q, k, v = self.layer.self_attn.qkv(x, cos[:, None], sin[:, None])
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * step, dim=1)  # [T, T * (step + 1)]
            attn = attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            state = self.layer.after_attention(residual, attn.transpose(1, 2).reshape(b, t, -1))
            out.append(self.logits(state))
            hidden = self.carried(state)
        return out


def attend(q: torch.Tensor,  # [B, heads, W, D]
           k: torch.Tensor,  # [B, kv_heads, L, D]
           v: torch.Tensor,  # [B, kv_heads, L, D]
           mask: torch.Tensor,  # [W, L] or [B, 1, W, L] bool: True where a query reads a key
           ) -> torch.Tensor:  # [B, heads, W, D]
    """Scaled dot-product attention with grouped key/value heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
