"""EAGLE-3 heads (Li et al. 2025, arXiv 2503.01840) as a draft source inside the target
(engine/spec/target_drafts.py): the head of engine/proposers/eagle3_head.py run over the static runner's state.

The target's forwards keep the states entering the head's three layers at every position they compute, prompt
chunks included (engine/models/static/pass_states.py). After a round's accept step the drafter first catches the
head's own KV cache up: for each position p the target computed since the row's last draft (the accepted window, or
the whole prompt on a request's first round) it runs the head on (fused state of p, token at p + 1), writing the
head's keys and values at p; its output at the last of them (the position that predicted the round's last token)
gives the first draft. Each further draft is one step on (its previous output state, the previous draft), one
position on. So a round is K head steps, and the head's cache always holds every committed position (positions the
target read from its prefix cache keep the head's entries the cached sequence left: moved with the target's slots,
engine/models/static/forward.add_slot_cache). Drafts are the head's argmax mapped to the target's ids (`d2t`), one-hot
proposals: our accept rule keeps the target's distribution at any temperature, and tokens outside the draft
vocabulary are simply never proposed.

The head's products run on the static runner's kernels in its dtypes (engine/models/static/forward.Projection);
norms, rotary and attention in ATen. A chain's steps feed each other on the device and its drafts reach the host
once (`_chains`); on CUDA the head's steps run eagerly (not captured as graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.models.static.forward import STEP_MAX_WIDTH, Projection
from engine.models.static.rope import apply_rope, rope_tables
from engine.models.static.tp import embed
from engine.proposers.eagle3_head import Eagle3Head, attend
from engine.spec.target_drafts import DraftFrom
from engine.spec.tree import TOP_CANDIDATES, Candidate, DraftTree, best_tree

ALONE_WIDTH = 16  # a row catching up over more positions than this (a prompt) runs alone, not padded beside others


class Eagle3Drafter:
    """TargetDrafter: an EAGLE-3 head over the static runner's aux states, with its own per-slot KV cache."""

    def __init__(self, head: Eagle3Head, runner) -> None:  # runner: a StaticRunner
        model = runner.model
        config = head.config
        self.config, self.head = config, head.eval()
        self.name = "eagle3"
        self.needs_hidden = False  # it reads the aux states (pass_states.keep_aux), not the final ones
        runner.pass_states.keep_aux(config.aux_layers)
        self.dtype, self.device = model.dtype, model.device
        weights = model.weight_dtype if model.weight_dtype.is_floating_point else model.dtype
        layer = head.layer
        attn = layer.self_attn

        def product(*modules):
            return Projection(list(modules), self.dtype, weight_dtype=weights).to(self.device)

        self.fc = product(head.fc)
        self.qkv = product(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = product(attn.o_proj)
        self.gate_up = product(layer.mlp.gate_proj, layer.mlp.up_proj)
        self.down = product(layer.mlp.down_proj)
        self.lm_head = product(head.lm_head)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        own = getattr(head, "embed_tokens", None)
        self.embed = own.weight.detach().to(self.device) if own is not None else model.embed
        # a head without its own embedding reads the target's: on a tensor-parallel shard that is this rank's
        # vocabulary rows, looked up with the other ranks (an all-reduce), so every rank steps the head with rank 0
        self.shard = model.shard if own is None else None
        self.collective = self.shard is not None
        head.to(self.device)  # its norms and d2t are used as they are (fp32 weights, the activations' dtype out)
        cos, sin = rope_tables(head.rotary, model.capacity, self.device)
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)  # [capacity, D]
        shape = (model.num_slots, self.num_kv_heads, model.capacity, self.head_dim)
        model.add_slot_cache("eagle3_k", torch.zeros(shape, dtype=self.dtype, device=self.device))
        model.add_slot_cache("eagle3_v", torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.k_cache, self.v_cache = model.eagle3_k, model.eagle3_v
        self.steps = 0  # head steps run (catch-ups and drafts)

    @torch.inference_mode()
    def draft(self, runner, rows: Sequence[DraftFrom], hidden: torch.Tensor | None) -> list[list[int] | DraftTree]:
        catch_up = [self._catch_up_inputs(runner, row) for row in rows]
        # a row without the target's state where its last token was predicted (only a step fed from the device
        # keeps none) drafts nothing this round
        ready = [b for b, inputs in enumerate(catch_up) if inputs is not None]
        drafted = self._draft([rows[b] for b in ready], [catch_up[b] for b in ready], runner) if ready else []
        drafts: list[list[int] | DraftTree] = [[] for _ in rows]
        for b, d in zip(ready, drafted):
            drafts[b] = d
        return drafts

    def _draft(self, rows: Sequence[DraftFrom], catch_up: list, runner) -> list[list[int] | DraftTree]:
        slots = [runner._seqs[row.seq_id].slot for row in rows]
        state = torch.empty(len(rows), self.config.hidden_size, dtype=self.dtype, device=self.device)
        short = [b for b, (positions, _, _) in enumerate(catch_up) if len(positions) <= ALONE_WIDTH]
        groups = [short] if short else []
        groups += [[b] for b in range(len(rows)) if b not in short]
        for group in groups:  # the head over every position the target computed since each row's last draft
            out = self._catch_up([slots[b] for b in group], [catch_up[b][0] for b in group],
                                 [catch_up[b][1] for b in group], [catch_up[b][2] for b in group])
            state[group] = torch.stack([out[i, len(catch_up[b][0]) - 1] for i, b in enumerate(group)])
        drafts: list[list[int] | DraftTree] = [[] for _ in rows]
        for b, row in enumerate(rows):  # tree rows: EAGLE-2's expansion, each on its own
            if row.tree:
                drafts[b] = self._tree(slots[b], row.committed, state[b], row.k, row.tree)
        chains = [b for b, row in enumerate(rows) if not row.tree]
        if chains:
            chained = self._chains([slots[b] for b in chains], [rows[b].committed for b in chains],
                                   [rows[b].k for b in chains], state[chains])
            for b, tokens in zip(chains, chained):
                drafts[b] = tokens
        return drafts

    def _chains(self, slots: list[int], committed: list[int], ks: list[int],
                state: torch.Tensor,  # [C, H]: each row's catch-up output at its last position
                ) -> list[list[int]]:
        """Each row's k-token chain: draft j is the head's pick from step j's output, and step j + 1 reads it at
        position committed - 1 + j. The steps feed each other on the device (the picks stay there, as positions
        and slots do) and the drafts come to the host once, at the end, so a GPU runs the steps back to back
        instead of waiting for each pick. Every row steps to the longest chain; a row's steps past its own k
        compute drafts it drops and write keys and values past its committed tokens, which nothing reads before
        the catch-up of a later round writes them again (positions at the cache's end are clamped to it)."""
        device, longest = self.device, max(ks)
        slot = torch.tensor(slots, device=device)
        start = torch.tensor([c - 1 for c in committed], device=device)
        picks = []
        for step in range(longest):
            picks.append(self._pick_ids(state))
            if step + 1 == longest:
                break
            pos = (start + step).clamp(max=self.cos.shape[0] - 1)
            kv_len = min(max(committed) + step, self.cos.shape[0])  # positions 0 .. the longest row's this step
            state = self._fed_step(slot, pos, picks[-1], self.head.carried(state).to(self.dtype), kv_len)
        drafted = torch.stack(picks, dim=1).tolist()  # [C, longest]: the one transfer to the host
        return [tokens[:k] for tokens, k in zip(drafted, ks)]

    def _pick_ids(self, state: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] target ids, on the device
        return self.head.draft_to_target(self.lm_head(self.head.norm(state).to(self.dtype), True).argmax(dim=-1))

    def _fed_step(self, slot: torch.Tensor,  # [C] the rows' cache slots
                  pos: torch.Tensor,  # [C] the position each row's step writes and queries at
                  ids: torch.Tensor,  # [C] the token at it (the last pick)
                  carried: torch.Tensor,  # [C, H] the state the step reads (the last step's, carried)
                  kv_len: int) -> torch.Tensor:  # -> [C, H], the layer's output
        """One head step of every chain row, one position each, from device tensors."""
        self.steps += 1
        q, k, v, residual = self._project(ids[:, None], carried[:, None], pos[:, None], fused=False)
        self.k_cache[slot, :, pos] = k[:, :, 0]
        self.v_cache[slot, :, pos] = v[:, :, 0]
        return self._attend_cached(q, residual, slot, pos[:, None], kv_len)[:, 0]

    def _catch_up_inputs(self, runner, row: DraftFrom) -> tuple[list[int], list[int], torch.Tensor] | None:
        """The positions p the target computed since the row's last draft (at most its committed tokens but the
        last), the token at each p + 1, and the aux states at each p [n, A]; None without a state at the last."""
        end = row.committed - 1  # the last committed token is not cached: its position has no state yet
        runs = runner.pass_states.take_aux(row.seq_id, end)
        if not runs or runs[-1][0] + len(runs[-1][1]) != end:
            return None
        known = runner._seqs[row.seq_id].tokens  # the committed tokens but the last
        positions = [p for start, states in runs for p in range(start, start + len(states))]
        tokens = [known[p + 1] if p + 1 < end else row.last for p in positions]
        return positions, tokens, torch.cat([states for _, states in runs]).to(self.dtype)

    def _candidates(self, state: torch.Tensor,  # [N, H]
                    ) -> list[list[tuple[int, float]]]:
        """Per row, the head's TOP_CANDIDATES best tokens (target ids) and their probabilities: a tree's children."""
        logits = self.lm_head(self.head.norm(state).to(self.dtype), True)
        probs = logits.float().softmax(dim=-1)
        values, ids = probs.topk(min(TOP_CANDIDATES, probs.shape[-1]), dim=-1)
        return [list(zip(m, v)) for m, v in zip(self.head.draft_to_target(ids).tolist(), values.tolist())]

    def _catch_up(self, slots: list[int], positions: list[list[int]], tokens: list[list[int]],
                  hidden: list[torch.Tensor]) -> torch.Tensor:  # -> [R, W, H], the layer's output
        """The head's layer over rows (slot, positions, tokens at them, the target's aux states there [n, A]),
        padded to the longest: writes each real position's keys and values into the row's slot, then attends over
        the row's keys up to each query's position."""
        self.steps += 1
        rows, width = len(slots), max(len(p) for p in positions)
        device = self.device
        pos = torch.zeros(rows, width, dtype=torch.long)
        ids = torch.zeros(rows, width, dtype=torch.long)
        real = torch.zeros(rows, width, dtype=torch.bool)
        for r, (p, t) in enumerate(zip(positions, tokens)):
            pos[r, :len(p)], ids[r, :len(t)], real[r, :len(p)] = torch.tensor(p), torch.tensor(t), True
        pos, ids, real = pos.to(device), ids.to(device), real.to(device)
        states = torch.zeros(rows, width, hidden[0].shape[-1], dtype=self.dtype, device=device)
        for r, h in enumerate(hidden):
            states[r, :len(h)] = h
        q, k, v, residual = self._project(ids, states, pos, fused=True)
        slot = torch.tensor(slots, device=device)
        r_idx, w_idx = real.nonzero(as_tuple=True)
        self.k_cache[slot[r_idx], :, pos[r_idx, w_idx]] = k[r_idx, :, w_idx]
        self.v_cache[slot[r_idx], :, pos[r_idx, w_idx]] = v[r_idx, :, w_idx]
        return self._attend_cached(q, residual, slot, pos, int(max(max(p) for p in positions)) + 1)

    def _attend_cached(self, q: torch.Tensor,  # [R, h, W, D]
                       residual: torch.Tensor,  # [R, W, H]
                       slot: torch.Tensor,  # [R] the rows' cache slots
                       pos: torch.Tensor,  # [R, W] each query's position
                       kv_len: int) -> torch.Tensor:  # -> [R, W, H], the layer's output
        """Attention over each row's cached keys up to each query's position, then the layer's output side."""
        keys, values = self.k_cache[slot, :, :kv_len], self.v_cache[slot, :, :kv_len]  # [R, KVH, L, D]
        mask = torch.arange(kv_len, device=self.device)[None, None, None, :] <= pos[:, None, :, None]  # [R,1,W,L]
        return self._finish(attend(q, keys, values, mask), residual)

    def _project(self, ids: torch.Tensor,  # [R, W] token ids
                 states: torch.Tensor,  # [R, W, A] aux states if `fused`, else [R, W, H] carried ones
                 pos: torch.Tensor,  # [R, W] positions
                 fused: bool) -> tuple[torch.Tensor, ...]:  # q [R, h, W, D], k, v [R, kvh, W, D], residual [R, W, H]
        """The layer's input side: [embedding; state] through its norms and q/k/v, rotated at `pos`."""
        rows, width = ids.shape
        step = width <= STEP_MAX_WIDTH  # which CPU kernel runs, as for the target's steps and prompt chunks
        if fused:
            states = self.fc(states, step)
        embeds = F.embedding(ids, self.embed) if self.shard is None else embed(ids, self.embed, self.shard)
        embeds = embeds.to(self.dtype)
        x, residual = self.head.layer.attention_input(embeds, states)
        qkv = self.qkv(x.to(self.dtype), step)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [R, 1, W, D]
        q = apply_rope(q.view(rows, width, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(rows, width, self.num_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(rows, width, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v, residual

    def _finish(self, attn: torch.Tensor,  # [R, h, W, D]
                residual: torch.Tensor,  # [R, W, H]
                ) -> torch.Tensor:  # [R, W, H]: the layer's output
        rows, _, width, _ = attn.shape
        step = width <= STEP_MAX_WIDTH
        hidden = residual + self.o(attn.transpose(1, 2).reshape(rows, width, -1), step)
        layer = self.head.layer
        gate, up = self.gate_up(layer.post_attention_layernorm(hidden).to(self.dtype), step).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up, step)

    def _tree(self, slot: int, committed: int, state: torch.Tensor,  # [H]: the catch-up's output at the last
              depth: int, budget: int) -> DraftTree:
        """EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858, section 4): from the head's state after the
        catch-up, each level expands the TOP_CANDIDATES nodes of the level before with the best path scores (the
        product of the head's probabilities down from the root), each by its own step over the committed positions'
        keys and its ancestors' (tree attention; the drafted nodes' keys and values stay out of the slot's cache),
        offering each expanded node's best candidates as its children; `depth` levels, then the `budget` best nodes
        of the whole pool (`best_tree`)."""
        prefix = committed - 1  # the head's cache holds positions 0 .. committed - 2
        keys, values = self.k_cache[slot, :, :prefix], self.v_cache[slot, :, :prefix]  # [kvh, P, D]
        pool: list[Candidate] = []
        level: list[int] = []  # the pool indices of the newest level's nodes
        for token, prob in self._candidates(state[None])[0]:
            level.append(len(pool))
            pool.append(Candidate(token, -1, prob))
        picked_by = {i: state for i in level}  # node -> the state its token was picked from (its parent's output)
        cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expanded node -> its (k, v) [kvh, D]
        for d in range(1, depth):
            expand = sorted(level, key=lambda i: -pool[i].score)[:TOP_CANDIDATES]
            paths = [self._ancestry(pool, i) for i in expand]  # root's child first, the node last
            ids = torch.tensor([[pool[i].token] for i in expand], device=self.device)
            states = torch.stack([self.head.carried(picked_by[i]) for i in expand])[:, None].to(self.dtype)
            pos = torch.full((len(expand), 1), prefix + d - 1, dtype=torch.long, device=self.device)
            q, k, v, residual = self._project(ids, states, pos, fused=False)  # q [F, h, 1, D], k, v [F, kvh, 1, D]
            for n, i in enumerate(expand):
                cached[i] = (k[n, :, 0], v[n, :, 0])
            path_k = torch.stack([torch.stack([cached[a][0] for a in path], dim=1) for path in paths])  # [F,kvh,d,D]
            path_v = torch.stack([torch.stack([cached[a][1] for a in path], dim=1) for path in paths])
            all_k = torch.cat([keys[None].expand(len(expand), -1, -1, -1).to(k.dtype), path_k], dim=2)
            all_v = torch.cat([values[None].expand(len(expand), -1, -1, -1).to(v.dtype), path_v], dim=2)
            mask = torch.ones(1, 1, 1, all_k.shape[2], dtype=torch.bool, device=self.device)
            out = self._finish(attend(q, all_k, all_v, mask), residual)[:, 0]  # [F, H]
            self.steps += 1
            candidates = self._candidates(out)
            level = []
            for n, i in enumerate(expand):
                for token, prob in candidates[n]:
                    level.append(len(pool))
                    pool.append(Candidate(token, i, pool[i].score * prob))
                    picked_by[len(pool) - 1] = out[n]
        return best_tree(pool, budget)[0]

    @staticmethod
    def _ancestry(pool: list[Candidate], node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = pool[node].parent
        return out[::-1]
