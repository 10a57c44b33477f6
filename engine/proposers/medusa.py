"""Medusa heads (Cai et al. 2024, arXiv 2401.10774; the seeds' extra prediction heads) as a draft source inside the
target (engine/spec/target_drafts.py).

Head i is `medusa_num_layers` ResBlocks (x + SiLU(W x + b), W zero-initialised) then a Linear H -> vocabulary, all on
the target's last hidden state (after its final norm): where the target's LM head predicts the token after position
t, head i predicts the token i + 1 places after that one. So a row's K drafts for the next round come from the one
hidden state that produced this round's last token, all heads in one pass (the first ResBlocks of all heads as one
product). Drafts are each head's argmax (one-hot proposals): our rejection rule keeps the target's distribution at
any temperature (not Medusa's typical acceptance, which changes it).

Checkpoints: Medusa-1 as FasterDecoding publishes them, a directory with `config.json` (`medusa_num_heads`,
`medusa_num_layers`) and `medusa_lm_head.safetensors` (or `.pt`) holding `{i}.{j}.linear.weight|bias` for ResBlock j
of head i and `{i}.{medusa_num_layers}.weight` for its LM head. One extension (written by `specserve train-heads
--shared-lm-head`, engine/training/medusa.py): `"shared_lm_head": true` in the config and no per-head LM heads, each
head's states going through the target's own LM head in one product for all heads. Where the LM head is a large share
of the model (the embedded 135M's is about a fifth of its weights) that keeps a round's drafting near one LM head's
cost instead of K; other engines do not read that variant.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.models.static.forward import Projection
from engine.models.static.tp import gather_vocab
from engine.spec.target_drafts import DraftFrom
from engine.spec.tree import DraftTree, independent_heads, top_candidates

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaError(ValueError):
    """A Medusa checkpoint that cannot serve this target: the message names the field."""


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    shared_lm_head: bool = False  # heads end in the target's LM head (this project's extension)
    # the token ids heads draft from (this project's extension, as EAGLE-3's draft vocabulary): the LM heads have
    # these rows only; None: the whole vocabulary
    draft_vocab: tuple[int, ...] | None = None

    @property
    def head_rows(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """The heads as FasterDecoding's `medusa_head` lays them out (a Sequential per head: ResBlocks, then its LM
    head unless shared), so `state_dict()` is the checkpoint's."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)],
                          *([] if config.shared_lm_head else [nn.Linear(config.hidden_size, config.head_rows,
                                                                        bias=False)]))
            for _ in range(config.num_heads))

    def states(self, hidden: torch.Tensor, k: int) -> torch.Tensor:  # hidden [N, H] -> [N, k, H]
        """The first k heads' states before their LM heads."""
        out = []
        for head in self.heads[:k]:
            x = hidden
            for block in head[: self.config.num_layers]:
                x = block(x)
            out.append(x)
        return torch.stack(out, dim=1)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., heads, V or the draft vocabulary's size]: every head (`lm_head` the
        target's, for shared heads: its draft vocabulary's rows where there is one)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        states = self.states(flat, self.config.num_heads)  # [N, heads, H]
        if self.config.shared_lm_head:
            logits = lm_head(states)
        else:
            logits = torch.stack([head[-1](states[:, i]) for i, head in enumerate(self.heads)], dim=1)
        return logits.reshape(*hidden.shape[:-1], self.config.num_heads, -1)

    def save(self, directory: str | Path, base_model: str | None = None) -> None:
        """The checkpoint: config.json and medusa_lm_head.safetensors."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        c = self.config
        meta = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "base_model_name_or_path": base_model}
        if c.shared_lm_head:
            meta["shared_lm_head"] = True
        if c.draft_vocab is not None:
            meta["draft_vocab"] = list(c.draft_vocab)
        (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        save_file({name: t.detach().contiguous() for name, t in self.heads.state_dict().items()},
                  str(directory / WEIGHT_FILES[0]))


def load_medusa(directory: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Medusa heads from a checkpoint directory, checked against the target's hidden size and vocabulary (a
    MedusaError naming the field otherwise)."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise MedusaError(f"model.draft: no Medusa config.json in {directory}")
    meta = json.loads(config_file.read_text())
    for name in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(meta.get(name), int) or meta[name] < (1 if name == "medusa_num_heads" else 0):
            raise MedusaError(f"model.draft: {config_file} has no valid {name}")
    weights = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
    if weights is None:
        raise MedusaError(f"model.draft: none of {', '.join(WEIGHT_FILES)} in {directory}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    num_layers = meta["medusa_num_layers"]
    shared = bool(meta.get("shared_lm_head", False))
    draft_vocab = meta.get("draft_vocab")
    if draft_vocab is not None:
        draft_vocab = tuple(int(t) for t in draft_vocab)
        if not draft_vocab or max(draft_vocab) >= vocab_size or min(draft_vocab) < 0:
            raise MedusaError(f"Medusa draft_vocab of {config_file} names tokens outside this target's vocabulary "
                              f"(vocab_size {vocab_size})")
    rows = vocab_size if draft_vocab is None else len(draft_vocab)
    first = state.get("0.0.linear.weight")
    if num_layers and first is not None and first.shape[1] != hidden_size:
        raise MedusaError(f"Medusa heads of hidden_size {first.shape[1]} cannot read this target's hidden states "
                          f"(hidden_size {hidden_size})")
    if not shared:
        head = state.get(f"0.{num_layers}.weight")
        if head is None:
            raise MedusaError(f"Medusa checkpoint {weights} has no LM head '0.{num_layers}.weight' and its config "
                              f"does not set shared_lm_head")
        if head.shape[1] != hidden_size:
            raise MedusaError(f"Medusa heads of hidden_size {head.shape[1]} cannot read this target's hidden states "
                              f"(hidden_size {hidden_size})")
        if head.shape[0] != rows and draft_vocab is None:
            raise MedusaError(f"Medusa heads of vocab_size {head.shape[0]} do not match this target's vocabulary "
                              f"(vocab_size {vocab_size})")
        if head.shape[0] != rows:
            raise MedusaError(f"Medusa heads of {head.shape[0]} output rows do not match their draft_vocab of "
                              f"{rows} tokens")
    heads = MedusaHeads(MedusaConfig(meta["medusa_num_heads"], num_layers, hidden_size, vocab_size, shared,
                                     draft_vocab))
    missing, unexpected = heads.heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise MedusaError(f"Medusa checkpoint {weights}: missing {sorted(missing)[:4]}, unexpected "
                          f"{sorted(unexpected)[:4]} (medusa_num_heads {meta['medusa_num_heads']}, "
                          f"medusa_num_layers {num_layers})")
    return heads.eval()


class MedusaDrafter:
    """TargetDrafter: the heads on each row's hidden state where this round's last token was predicted, fused for
    the static runner (its dtypes and CPU kernels): the first ResBlocks of every head as one product, then the LM
    heads (the target's in one product for shared heads)."""

    def __init__(self, heads: MedusaHeads, model) -> None:  # model: the runner's StaticLlama
        config = heads.config
        self.config = config
        self.name = "medusa"
        self.needs_hidden = True  # the verifier makes the runner keep the pass's hidden states
        dtype, weight_dtype = model.dtype, model.weight_dtype
        self.blocks = [Projection([head[j].linear for head in heads.heads], dtype) for j in
                       range(min(config.num_layers, 1))]  # layer 0 of every head: one product
        self.later = [[Projection([head[j].linear], dtype) for j in range(1, config.num_layers)]
                      for head in heads.heads]
        self.vocab_ids = None if config.draft_vocab is None else torch.tensor(config.draft_vocab)
        self.lm_head = model.lm_head if config.shared_lm_head else None
        if config.shared_lm_head and self.vocab_ids is not None:  # the target's LM head, its draft vocabulary's rows
            if model.shard is not None:
                raise MedusaError("Medusa heads with shared_lm_head and a draft_vocab read rows of the target's LM "
                                  "head, which a tensor-parallel rank holds a slice of: use tp_size 1 or heads "
                                  "without draft_vocab")
            rows = nn.Linear(config.hidden_size, len(config.draft_vocab), bias=False)
            rows.weight = nn.Parameter(model.lm_head.rows(self.vocab_ids.to(model.device)), requires_grad=False)
            self.lm_head = Projection([rows], dtype, weight_dtype=weight_dtype)
        self.own_heads = None if config.shared_lm_head else [
            Projection([head[config.num_layers]], dtype, weight_dtype=weight_dtype) for head in heads.heads]
        self.dtype = dtype
        # on a tensor-parallel shard, heads of their own are whole on every rank and rank 0 drafts alone; shared
        # heads end in the shard's slice of the target's LM head, gathered with the other ranks, which draft with it
        self.shard = model.shard if config.shared_lm_head else None
        self.collective = self.shard is not None

    @torch.inference_mode()
    def draft(self, runner, rows: Sequence[DraftFrom], hidden: torch.Tensor | None) -> list[list[int] | DraftTree]:
        if hidden is None:
            raise RuntimeError("Medusa heads need the verify pass's hidden states (runner.keep_hidden)")
        k = min(max(row.k for row in rows), self.config.num_heads)
        index = torch.tensor([row.index for row in rows], device=hidden.device)
        position = torch.tensor([row.position for row in rows], device=hidden.device)
        h = hidden[index, position].to(self.dtype)  # [N, H]
        states = self._states(h, k)  # [N, k, H]
        if self.lm_head is not None:
            logits = self.lm_head(states, True)  # [N, k, V] (a shard's [N, k, V / world], then gathered)
            if self.shard is not None:
                logits = gather_vocab(logits, self.shard)
        else:
            logits = torch.stack([self.own_heads[i](states[:, i], True) for i in range(k)], dim=1)
        picked = logits.reshape(-1, logits.shape[-1]).argmax(dim=-1)
        if self.vocab_ids is not None:  # draft vocabulary -> the target's token ids
            picked = self.vocab_ids.to(picked.device)[picked]
        tokens = picked.tolist()
        drafts: list[list[int] | DraftTree] = [tokens[n * k: n * k + min(row.k, k)] for n, row in enumerate(rows)]
        for n, row in enumerate(rows):
            if row.tree:  # Medusa's tree: every path through the heads' best candidates, the best `tree` of them
                depth = min(row.k, k)
                steps = top_candidates(logits[n, :depth].float().softmax(dim=-1))
                if self.vocab_ids is not None:
                    ids = self.vocab_ids.tolist()
                    steps = [[(ids[t], p) for t, p in step] for step in steps]
                drafts[n] = independent_heads(steps, row.tree)
        return drafts

    def _states(self, h: torch.Tensor, k: int) -> torch.Tensor:  # [N, H] -> [N, k, H]
        n, size = h.shape
        if not self.blocks:  # no ResBlocks: every head reads the hidden state itself
            return h[:, None].expand(n, k, size)
        first = self.blocks[0](h, True).reshape(n, self.config.num_heads, size)[:, :k]
        states = h[:, None] + torch.nn.functional.silu(first)
        for i in range(k):
            x = states[:, i]
            for block in self.later[i]:
                x = x + torch.nn.functional.silu(block(x, True))
            states[:, i] = x
        return states
