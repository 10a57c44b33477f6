"""A batched forward over many sequences of a transformers causal LM, each with its own rolled-back KV cache.

The runner remembers, per sequence, which token ids its cache holds. `sync` compares that with the tokens the
caller says are now committed, rolls the cache back to the common prefix (rejected drafts go, the accepted
prefix stays) and returns the tokens still to feed. Draft and target use the same runner, which is why both
sides "roll their caches back to the accepted length" with no extra bookkeeping.

The forward is transformers' own, for every family: this runner is the fallback for models the static runner
(engine/models/static/) does not cover and for `runner: transformers`, and the reference the static forward is
tested against, so it runs the model exactly as the model defines itself. The Llama family's fast forward is the
static one alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.models.cpu.linear import use_small_batch_linear
from engine.models.kv_cache import SlotKVCache, WritePlan
from engine.models.runner import ContextWindowError, SlotTable, SlotTableAccess, config_context_window

PREFILL_THRESHOLD = 32  # rows with more new tokens than this run in their own forward, not padded together


class ModelRunner(SlotTableAccess):
    """Owns a model, its slotted KV cache and the slot table of the live sequences."""

    def __init__(self, model: torch.nn.Module, max_model_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.model = model
        config = model.config
        window = config_context_window(config)
        self.max_model_len = min(window, max_model_len) if max_model_len else window
        # logits width; a tensor-parallel model's embedding holds only a shard, so its runner is told
        self.vocab_size = vocab_size or model.get_input_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            use_small_batch_linear(model)  # verification is a few-row matmul: engine/models/cpu/linear.py
        self.dtype = next(model.parameters()).dtype
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._base = model.base_model
        self._lm_head = model.get_output_embeddings()
        self._tensor_parallel = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        self.cache = SlotKVCache(num_layers=config.num_hidden_layers if hasattr(config, "num_hidden_layers")
                                 else config.n_layer)
        self._seqs = SlotTable(self.max_model_len, None, self.cache.move_slot)
        self.forward_calls = 0  # plain counters, read by stats and tests
        self.forward_rows = 0

    # ---- sequence table -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> None:
        return None  # the cache grows with the live sequences

    @torch.inference_mode()
    def add(self, seq_id: str) -> None:
        slot = self._seqs.add(seq_id)
        self.cache.ensure(slot + 1, self.cache.capacity)

    @torch.inference_mode()
    def release(self, seq_id: str) -> None:
        """Free a sequence's slot now; the last slot moves into the hole so slots stay compact."""
        self._seqs.release(seq_id)

    # ---- forward --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        seq_ids: Sequence[str],
        new_tokens: Sequence[Sequence[int]],
        num_logits: Sequence[int],
    ) -> torch.Tensor:  # [B, max(num_logits), V] float32; row b's logits for its last num_logits[b] new tokens
        """Append `new_tokens[b]` to sequence b's cache and return logits at its last `num_logits[b]` positions."""
        assert len(seq_ids) == len(new_tokens) == len(num_logits)
        width = max(num_logits)
        out = torch.zeros(len(seq_ids), width, self.vocab_size, dtype=torch.float32, device=self.device)
        for group in _groups(new_tokens):
            logits = self._forward_group([seq_ids[i] for i in group], [new_tokens[i] for i in group],
                                         [num_logits[i] for i in group])
            out[group, : logits.shape[1]] = logits
        return out

    def prompt_logits(self, seq_id: str, new_tokens: Sequence[int]) -> torch.Tensor:  # [N, V] float32
        """Runner.prompt_logits: a forward of the one row with logits at every position."""
        return self.forward([seq_id], [list(new_tokens)], [len(new_tokens)])[0]

    def _forward_group(
        self, seq_ids: list[str], new_tokens: list[Sequence[int]], num_logits: list[int]
    ) -> torch.Tensor:  # [B, max(num_logits), V]
        states = [self._seqs[s] for s in seq_ids]
        # slot order makes contiguous views, but slots depend on this process's add/release history; under tensor
        # parallelism rows must be in an order every rank agrees on (the collectives pair rows by position)
        order = (sorted(range(len(states)), key=lambda i: states[i].slot) if not self._tensor_parallel
                 else list(range(len(states))))
        states = [states[i] for i in order]
        new_tokens = [new_tokens[i] for i in order]
        num_logits = [num_logits[i] for i in order]
        lengths = [len(s.tokens) for s in states]
        n_new = [len(t) for t in new_tokens]
        assert all(n >= 1 for n in n_new) and all(0 < k <= n for k, n in zip(num_logits, n_new))
        query_len = max(n_new)
        end = max(length + query_len for length in lengths)
        for state, length, n in zip(states, lengths, n_new):
            if length + n > self.max_model_len:
                raise ContextWindowError(f"sequence would reach {length + n} tokens > {self.max_model_len}")
        self.cache.ensure(self.cache.num_slots, end)

        device = self.device
        ids = torch.zeros(len(states), query_len, dtype=torch.long)
        for b, toks in enumerate(new_tokens):
            ids[b, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
        ids = ids.to(device)
        plan = WritePlan([s.slot for s in states], lengths, query_len, device)
        self.cache.plan = plan
        starts = torch.tensor(lengths, device=device)
        positions = starts[:, None] + torch.arange(query_len, device=device)[None, :]  # [B, N]
        key_pos = torch.arange(plan.kv_len, device=device)
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, N, kv_len]: causal within own row
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        hidden = self._base(
            input_ids=ids,
            attention_mask=mask[:, None],
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        ).last_hidden_state  # [B, N, H]
        self.cache.plan = None

        width = max(num_logits)
        offsets = torch.arange(width, device=device)[None, :]
        first = torch.tensor([n - k for n, k in zip(n_new, num_logits)], device=device)
        gather_at = (first[:, None] + offsets).clamp(max=query_len - 1)  # [B, width]
        picked = hidden.gather(1, gather_at[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self._lm_head(picked).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        for state, toks in zip(states, new_tokens):
            state.tokens.extend(int(t) for t in toks)
        self.forward_calls += 1
        self.forward_rows += len(states)
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        return logits[inverse]


def _groups(new_tokens: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rows batched together: all short rows in one group; each long (prefill) row on its own."""
    short = [i for i, t in enumerate(new_tokens) if len(t) <= PREFILL_THRESHOLD]
    long = [[i] for i, t in enumerate(new_tokens) if len(t) > PREFILL_THRESHOLD]
    return ([short] if short else []) + long
