"""The fast model runner: `StaticLlama` over a KV cache preallocated within a byte budget, compiled per shape bucket.

- **Slots.** The cache holds `num_slots` sequences of `max_model_len` positions (plus a scratch tail), allocated
  once at start from the byte budget (`plan_num_slots`); `add` raises `KVCacheFull` when every slot is taken.
  Slots stay compact (a released slot takes the last one's keys/values, a copy made once per release), so a
  forward over the live sequences is a contiguous range of slots: views of the cache, never a per-step gather.
- **Shapes.** A step runs `B` consecutive slots at width `W` (the new tokens per row: 1 to decode, K+1 to verify).
  Under CUDA graphs both are rounded up to buckets (elsewhere they are exact); a bucket's padding rows feed dummy
  tokens into the scratch tail past `max_model_len`, which no real row ever reads, and attend to no key.
  Rows shorter than `W` are right-padded: their pad tokens land past the row's length and are overwritten by its
  next tokens. Long rows (prompts) run in chunks of at most `prefill_chunk` tokens, never padded beyond the longest
  chunk of the neighbouring rows sharing their forward; their last tokens join the batched step
  (engine/models/static/prefill_plan.py).
- **Step modes** (`runner.compile`, `step_mode` in engine/models/static/steps.py). On CUDA (`auto`, `on`) decode and
  verify steps replay CUDA graphs captured at start per (batch bucket, width) (engine/models/static/cuda_graphs.py);
  each row's slot, start and key limit are device tensors there, so a graph serves any context length and its
  attention reads only the row's own keys (engine/models/static/attention.py). On CPU steps run eagerly (`auto`,
  `off`), or through `torch.compile`'s inductor with frozen, prepacked weights and dynamic sizes (`on`; inductor
  keeps its compiled code in its on-disk cache, `TORCHINDUCTOR_CACHE_DIR`, so a restart compiles faster). Prefill
  chunks always run eagerly on CUDA.
- **No host sync inside a step.** Inputs are built on the host and copied in one go; the step itself never reads
  a device value back (tests/engine/models/static/test_runner.py runs it with host reads made to raise).
- **Tensor parallelism.** Given a rank's shard (engine/models/shard_loading.py's `load_shard`), the runner holds that
  rank's fused weights and its heads' KV cache only, so one slot costs 1/world of its single-rank bytes and the same
  byte budget holds world times more sequences per rank (still at most `max_num_seqs`); the ranks agree on the
  fewest slots any of them can hold. On CUDA the steps' NCCL collectives run inside the captured graphs; on CPU
  (gloo) steps run eagerly (engine/models/static/tp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.models.kv_budget import KVBudget, plan_num_slots
from engine.models.runner import (
    ContextWindowError,
    SeqSlot,
    SlotTable,
    SlotTableAccess,
    config_context_window,
)
from engine.models.static.cuda_graphs import GraphSteps, estimate_graph_bytes
from engine.models.static.forward import STEP_MAX_WIDTH, StaticLlama
from engine.models.static.pass_states import PassStates
from engine.models.static.prefill_plan import prefill_heads, split_heads
from engine.models.static.prefix_cache import runner_prefix_cache
from engine.models.static.steps import (
    bucket,
    buckets_up_to,
    compile_step,
    pick_logits,
    step_mode,
)
from engine.models.static.tp import agree_num_slots, shard_of
from engine.models.static.tree_steps import graph_masks, keep_path, row_shapes, step_masks
from engine.models.static.warm_up import warm_up

MAX_WIDTH = STEP_MAX_WIDTH  # rows with more new tokens than this are prefilled in chunks first
PENDING = -1  # a token fed from the device whose value the host has not read yet (`forward_fed`)


class StaticRunner(SlotTableAccess):
    """Runner protocol (engine/models/runner.py) over `StaticLlama`."""

    def __init__(self, model: torch.nn.Module, max_model_len: int | None = None, vocab_size: int | None = None,
                 budget: KVBudget = KVBudget(), compile: bool | str = "auto", prefill_chunk: int = 256,
                 dtype: torch.dtype | None = None, weight_dtype: torch.dtype | None = None,
                 prefix_caching: str = "auto", cache_dtype: torch.dtype | None = None) -> None:
        config = model.config
        window = config_context_window(config)
        self.max_model_len = min(window, max_model_len) if max_model_len else window
        self.prefill_chunk = max(MAX_WIDTH, prefill_chunk)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = dtype or (param.dtype if param.is_floating_point() else torch.float32)
        capacity = self.max_model_len + self.prefill_chunk  # scratch tail for padded and dummy rows
        shard = shard_of(model)
        self.step_mode = step_mode(compile, self.device)
        if shard is not None and self.step_mode == "inductor":
            raise ValueError(
                f"runner.compile: on is not supported for tensor-parallel targets on CPU (tp_size {shard.world}): "
                f"gloo collectives do not run inside inductor graphs; use compile: auto or off (eager steps). On "
                f"CUDA, tensor-parallel steps run as CUDA graphs")
        self.kv_cache_dtype = cache_dtype or self.dtype
        world = shard.world if shard else 1
        slot_bytes = StaticLlama.slot_bytes(config, capacity, self.kv_cache_dtype, world)
        reserve = 0
        if self.step_mode == "graphs":
            reserve = estimate_graph_bytes(config, budget.max_num_seqs, MAX_WIDTH, vocab_size or config.vocab_size,
                                           world)
        num_slots = plan_num_slots(slot_bytes, budget.bytes_for(self.device, reserve), budget.max_num_seqs,
                                   f" of {self.max_model_len} tokens")
        if shard is not None:
            num_slots = agree_num_slots(num_slots, shard, self.device)
        self.model = StaticLlama(model, num_slots=num_slots, capacity=capacity, dtype=self.dtype,
                                 cache_dtype=self.kv_cache_dtype, weight_dtype=weight_dtype)
        self.vocab_size = vocab_size or self.model.vocab_size
        self.batch_buckets = buckets_up_to(num_slots)
        self.width_buckets = buckets_up_to(MAX_WIDTH)
        self.chunk_buckets = buckets_up_to(self.prefill_chunk, first=MAX_WIDTH * 2)
        self.kv_buckets = buckets_up_to(capacity, first=256)  # key lengths of eager CUDA steps
        self.compiled = self.step_mode != "eager"
        self._step = compile_step(self.model) if self.step_mode == "inductor" else self.model.forward
        # CUDA graphs replay fixed shapes, so batch and width are padded to buckets there (each row's key length is a
        # device tensor: engine/models/static/attention.py); eager steps and CPU's dynamic graph take any shape, so
        # nothing is padded (a prompt padded to a bucket pays for the padded tokens as for real ones)
        self.graphs = None
        if self.step_mode == "graphs":
            self.graphs = GraphSteps(self.model, num_slots, MAX_WIDTH, scratch_start=self.max_model_len)
        # prefill chunks are compute-bound: on CUDA they run eagerly (vLLM likewise captures graphs for decode
        # batches only); on CPU the dynamic graph serves them too
        self._prefill = self.model.forward if self.device.type == "cuda" else self._step
        self._seqs = SlotTable(self.max_model_len, num_slots, self.model.move_slot)
        self.prefix_cache = runner_prefix_cache(prefix_caching, self.model, self.compiled)
        self.last_prefix_hits: dict[int, int] = {}  # the last forward's rows that read a prefix from the cache: tokens
        # what the forwards leave for a draft source inside the target (keep_hidden, keep_aux)
        self.pass_states = PassStates(self.model, self.model.num_slots, MAX_WIDTH)
        self.forward_calls = 0
        self.forward_rows = 0

    # ---- sequence table -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.model.num_slots

    def add(self, seq_id: str) -> None:
        if self.prefix_cache is not None and seq_id not in self._seqs:
            self.prefix_cache.vacate(len(self._seqs), len(self._seqs))  # the new sequence's slot
        self._seqs.add(seq_id)  # KVCacheFull when every slot is taken

    def release(self, seq_id: str) -> None:
        """Free a sequence's slot now; the last slot moves into the hole so slots stay compact. With the prefix
        cache, the sequence's keys and values stay in a free slot first (engine/models/static/prefix_cache.py)."""
        if self.prefix_cache is not None and seq_id in self._seqs:
            self.prefix_cache.keep(self._seqs[seq_id], len(self._seqs))
        self._seqs.release(seq_id)
        self.pass_states.forget(seq_id)

    def graph_stats(self) -> dict | None:
        """The CUDA graphs' counters and step times (engine/models/static/cuda_graphs.py); None where steps are not
        graphs."""
        return None if self.graphs is None else self.graphs.stats()

    def prefix_cache_stats(self) -> dict | None:
        return None if self.prefix_cache is None else self.prefix_cache.index.stats.as_dict()

    def keep_hidden(self) -> None:
        """Make every forward keep its final hidden states at the positions it returns logits for (`last_hidden`):
        the input of a draft source that reads the target's last hidden state (Medusa heads)."""
        self.pass_states.keep_hidden()

    @property
    def last_hidden(self) -> torch.Tensor | None:  # [B, max(num_logits), H]: the last step's, with keep_hidden
        return self.pass_states.last_hidden

    takes_trees = True  # verifies token trees (engine/spec/tree.py): `forward(..., trees=)`, then `keep_path`

    @torch.inference_mode()
    def forward(self, seq_ids: Sequence[str], new_tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int],
                trees: Sequence | None = None,  # per row a DraftTree (its nodes: the row's last tree.width tokens)
                ) -> torch.Tensor:  # [B, max(num_logits), V] float32
        """Runner.forward; a row's tree's nodes are its last tokens, each sees its own path (tree attention)."""
        assert len(seq_ids) == len(new_tokens) == len(num_logits) == len(trees or seq_ids)
        states = [self._seqs[s] for s in seq_ids]
        for state, toks, k in zip(states, new_tokens, num_logits):
            if not 0 < k <= len(toks):
                raise ValueError(f"num_logits {k} for {len(toks)} new tokens")
            if len(state.tokens) + len(toks) > self.max_model_len:
                raise ContextWindowError(
                    f"sequence would reach {len(state.tokens) + len(toks)} tokens > {self.max_model_len}")
        new_tokens = [list(toks) for toks in new_tokens]
        if self.prefix_cache is not None:
            self.last_prefix_hits = self.prefix_cache.reuse(states, new_tokens, num_logits)
        # long rows: everything but their last num_logits tokens is prefilled first, in chunks; the rest joins the
        # batch
        heads, tails = split_heads(new_tokens, num_logits, MAX_WIDTH)
        prefill_heads(states, heads, self.prefill_chunk, self._prefill_rows, self.model.move_slot)
        logits = self._batched_step(states, tails, list(num_logits), row_shapes(trees, tails))
        self.forward_calls += 1
        self.forward_rows += len(states)
        return logits

    @property
    def takes_device_tokens(self) -> bool:
        """Whether `forward_fed` runs here: graph steps, without a prefix cache (which reads every fed token)."""
        return self.graphs is not None and self.prefix_cache is None

    @torch.inference_mode()
    def forward_fed(self, seq_ids: Sequence[str],
                    tokens: torch.Tensor,  # [B] int64 on the device: each row's next token (a draft's last pick)
                    ) -> torch.Tensor:  # [B, 1, V] float32, a view of the graph's output: valid until the next step
        """A decode step whose input tokens never visit the host: the next step can be queued before this one's
        tokens are known there, so a draft's host work per step overlaps the device's steps instead of waiting on
        each. The rows' tokens are recorded as PENDING until `settle` gives their values."""
        assert self.takes_device_tokens
        states = [self._seqs[s] for s in seq_ids]
        if any(len(state.tokens) + 1 > self.max_model_len for state in states):
            raise ContextWindowError(f"a sequence would pass {self.max_model_len} tokens")
        rows = bucket(len(states), self.batch_buckets)
        logits = self.graphs.step_fed([s.slot for s in states], [len(s.tokens) for s in states], tokens, rows)
        for state in states:
            state.tokens.append(PENDING)
        self.forward_calls += 1
        self.forward_rows += len(states)
        return logits[: len(states), :1]

    def settle(self, seq_id: str, tokens: Sequence[int]) -> None:
        """The values of a sequence's last len(tokens) tokens fed from the device (`forward_fed`)."""
        if tokens:
            state = self._seqs[seq_id]
            assert all(t == PENDING for t in state.tokens[-len(tokens):]), "only fed tokens are settled"
            state.tokens[-len(tokens):] = [int(t) for t in tokens]

    @torch.inference_mode()
    def prompt_logits(self, seq_id: str, new_tokens: Sequence[int]) -> torch.Tensor:  # [N, V] float32
        """Runner.prompt_logits: one row, logits at every position. Eager on every device: a rare request's path
        must not compile graphs (CPU) or capture shapes (CUDA graphs) that other requests never use."""
        state, tokens = self._seqs[seq_id], list(new_tokens)
        start = len(state.tokens)
        if start + len(tokens) > self.max_model_len:
            raise ContextWindowError(f"sequence would reach {start + len(tokens)} tokens > {self.max_model_len}")
        logits = self._run(torch.tensor([tokens]), torch.tensor([start]), state.slot,
                           self._kv_len(start + len(tokens)), last_only=False, step=self.model.forward)
        self.pass_states.after_chunk([seq_id], [start], [len(tokens)])
        state.tokens.extend(tokens)
        return logits[0]

    def _prefill_rows(self, states: list[SeqSlot], chunks: list[list[int]]) -> None:
        """One forward of prompt chunks for rows in consecutive slots; chunks never run as CUDA graphs (see
        __init__), so only the shorter chunks are padded, to the longest (their padding writes past their own
        tokens, which the next tokens overwrite and no query sees before that)."""
        width = max(len(c) for c in chunks)
        ids = torch.zeros(len(states), width, dtype=torch.long)
        for r, chunk in enumerate(chunks):
            ids[r, : len(chunk)] = torch.tensor(chunk)
        starts = torch.tensor([len(state.tokens) for state in states])
        kv_len = self._kv_len(max(len(state.tokens) for state in states) + width)
        self._run(ids, starts, states[0].slot, kv_len, last_only=True, step=self._prefill)
        self.pass_states.after_chunk([s.seq_id for s in states], starts.tolist(), [len(c) for c in chunks])
        for state, chunk in zip(states, chunks):
            state.tokens.extend(chunk)

    def keep_path(self, seq_id: str, width: int, path: Sequence[int]) -> None:
        """After a tree step: the accepted path's keys and values kept, the rest dropped (tree_steps.keep_path)."""
        keep_path(self.model, self.pass_states, self._seqs[seq_id], width, path)

    def _batched_step(self, states: list[SeqSlot], tails: list[list[int]], num_logits: list[int],
                      shapes: list | None = None,  # per row its tree's (depths, ancestors), or None (a chain)
                      ) -> torch.Tensor:  # [B, max(num_logits), V]
        if self.graphs is not None:
            return self._graph_step(states, tails, num_logits, shapes)
        lo = min(s.slot for s in states)
        rows = max(s.slot for s in states) - lo + 1
        width = max(len(t) for t in tails)
        lo = min(lo, self.model.num_slots - rows)  # the range must stay inside the cache
        ids = torch.zeros(rows, width, dtype=torch.long)
        starts = torch.full((rows,), self.max_model_len, dtype=torch.long)  # dummy rows: the scratch tail
        need = 1
        for state, toks in zip(states, tails):
            r = state.slot - lo
            ids[r, : len(toks)] = torch.tensor(toks)
            starts[r] = len(state.tokens)
            need = max(need, len(state.tokens) + width)
        # a tree step runs eagerly (compiled steps take chains only), with each row's depths and ancestor masks
        masks = {} if shapes is None else step_masks(rows, width, [(s.slot - lo, shape)
                                                                   for s, shape in zip(states, shapes) if shape])
        logits = self._run(ids, starts, lo, self._kv_len(need), False, self.model.forward if masks else None,
                           **masks)  # [rows, width, V]
        self.pass_states.after_step([s.seq_id for s in states], [len(s.tokens) for s in states],
                                    [s.slot - lo for s in states], tails, num_logits, width, graph=False)
        for state, toks in zip(states, tails):
            state.tokens.extend(int(t) for t in toks)
        return pick_logits(logits, [s.slot - lo for s in states], [len(t) for t in tails], num_logits)

    def _graph_step(self, states: list[SeqSlot], tails: list[list[int]], num_logits: list[int],
                    shapes: list | None = None) -> torch.Tensor:  # [B, max(num_logits), V]
        """The step as a CUDA graph's replay (engine/models/static/cuda_graphs.py): the rows in call order (any slots),
        padded to the batch and width buckets; each row's logits at its last num_logits positions. Every graph reads
        each row's depths and ancestor masks, so a tree replays the graph of its width bucket."""
        width = bucket(max(len(t) for t in tails), self.width_buckets)
        rows = bucket(len(states), self.batch_buckets)
        logits = self.graphs.step([s.slot for s in states], [len(s.tokens) for s in states], tails, rows, width,
                                  **graph_masks(shapes))
        self.pass_states.after_step([s.seq_id for s in states], [len(s.tokens) for s in states],
                                    range(len(states)), tails, num_logits, width, graph=True)
        for state, toks in zip(states, tails):
            state.tokens.extend(toks)
        return pick_logits(logits, range(len(states)), [len(t) for t in tails], num_logits)

    def _kv_len(self, need: int) -> int:
        """Keys read per row by an eager step or prompt chunk (graph steps read each row's own length): on CUDA
        rounded up to a power of two, as when torch.compile's CUDA graphs took the steps (whether a multiple of 64
        reads less there at no cost is not measured on a GPU); on CPU to a multiple of 64."""
        if self.device.type == "cuda":
            return bucket(need, self.kv_buckets)
        return min(self.model.capacity, -(-need // 64) * 64)

    def _run(self, ids: torch.Tensor, starts: torch.Tensor, first_slot: int, kv_len: int,
             last_only: bool, step: Callable | None = None, **masks: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device, non_blocking=True)
        starts = starts.to(self.device, non_blocking=True)
        masks = {name: mask.to(self.device, non_blocking=True) for name, mask in masks.items()}
        return (step or self._step)(ids, starts, first_slot, kv_len, last_only, **masks)

    # ---- start-up -------------------------------------------------------------------------------------------
    def warm_up(self, max_k: int, progress: Callable[[str], None] | None = None,
                exit_layers: int | tuple[int, ...] | None = None) -> int:
        """Capture or compile every step shape the serving loop uses (engine/models/static/warm_up.py); the number
        of shapes."""
        return warm_up(self, max_k, progress, exit_layers)

