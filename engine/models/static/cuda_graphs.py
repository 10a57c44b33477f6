"""Decode and verify steps replayed as CUDA graphs, captured with `torch.cuda.CUDAGraph` directly.

An eager step launches a few dozen kernels per layer from Python, and on a GPU that launching, not the weights'
reads, is the step's time. A captured graph replays all of a step's kernels with one launch. As in vLLM's and
SGLang's CUDA-graph runners (and nano-vllm's `capture_cudagraph`), one graph is captured per (batch bucket, width):
every index a step needs (token ids, each row's slot, start position and key limit) is read from static device
buffers that the host fills before each replay, and attention reads each row's length from them
(engine/models/static/attention.py), so a graph serves every context length and any set of slots. Capturing a shape is
one eager forward plus its capture: seconds for the whole set, against minutes for `torch.compile`'s CUDA graphs
(one per key-length bucket as well).

A step's inputs travel in one pinned host buffer and one copy: rows `[slot, start, limit, token 0 .. token W-1,
depth 0 .. depth W-1, ancestors 0 .. ancestors W-1]` per row (`Staging`). Every graph reads each row's depths and
ancestor bitmasks (engine/models/static/attention.py), so one graph per shape serves chains (their defaults: depth w,
the causal mask) and token trees (engine/spec/tree.py: a tree of N nodes replays the graph of the width bucket >= N).
A shape that was not captured (a short prompt's width, before its rows join the decode batch) runs the same forward
eagerly on the same buffers: never a capture while serving.

Tensor parallelism: the row-parallel all-reduces and the vocabulary all-gather (engine/models/static/tp.py) are NCCL
collectives, which CUDA graphs capture; every rank captures the same shapes in the same order at start, as it
applies every call in the same order while serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.models.static.attention import RowIndex
from engine.models.static.forward import StaticLlama

log = logging.getLogger(__name__)

SLOT, START, LIMIT, FIRST_TOKEN = 0, 1, 2, 3  # the staging buffer's fields, one column per row
# then max_width rows of depths from FIRST_TOKEN + max_width, and max_width of ancestor masks after them (`Staging`)


def chain_depths(width: int) -> list[int]:
    """A chain's depths: token w at depth w (RoPE at start + w)."""
    return list(range(width))


def chain_ancestors(width: int) -> list[int]:
    """A chain's ancestor bitmasks: token w sees the step's tokens 0..w (the causal mask)."""
    return [(2 << w) - 1 for w in range(width)]


class Staging:
    """A step's inputs: `[3 + 3 max_width, max_rows]` int64 on the device (what the graphs read): slot, start, limit,
    then max_width rows each of tokens, depths and ancestor bitmasks; and its pinned host twin the host writes before
    one copy. The next fill waits until the previous copy has left the host buffer."""

    def __init__(self, max_rows: int, max_width: int, device: torch.device) -> None:
        assert max_width <= 63, "ancestor bitmasks are int64"
        self.max_width = max_width
        self.first_depth = FIRST_TOKEN + max_width  # the buffer's first depth row
        self.first_ancestors = self.first_depth + max_width  # its first ancestor-mask row
        shape = (FIRST_TOKEN + 3 * max_width, max_rows)
        self.device_buffer = torch.zeros(shape, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.long, pin_memory=pinned)
        self.host_view = self.host.numpy()  # the host writes through numpy: no tensor per row
        self._copied = torch.cuda.Event() if pinned else None
        self._chain_depths = np.array(chain_depths(max_width), dtype=np.int64)  # [max_width]
        self._chain_ancestors = np.array(chain_ancestors(max_width), dtype=np.int64)

    def views(self, rows: int, width: int) -> tuple[torch.Tensor, RowIndex]:  # tokens [rows, width], RowIndex
        """The first `rows` rows' tokens and RowIndex (depths and ancestors [rows, width] included: every graph reads
        them), views of the device buffer."""
        buf = self.device_buffer
        tokens = buf[FIRST_TOKEN : FIRST_TOKEN + width, :rows].t()
        depths = buf[self.first_depth : self.first_depth + width, :rows].t()
        ancestors = buf[self.first_ancestors : self.first_ancestors + width, :rows].t()
        return tokens, RowIndex(slots=buf[SLOT, :rows], starts=buf[START, :rows], limits=buf[LIMIT, :rows],
                                depths=depths, ancestors=ancestors)

    def fill(self, rows: int, width: int, slots: Sequence[int], starts: Sequence[int],
             tokens: Sequence[Sequence[int]], scratch_start: int,
             depths: Sequence[Sequence[int] | None] | None = None,  # per real row its W depths; None: a chain's
             ancestors: Sequence[Sequence[int] | None] | None = None,  # per real row its W ancestor bitmasks
             ) -> None:
        """Real rows first (each row's tokens right-padded with 0 to `width`), then padding rows up to `rows`: slot
        0 at `scratch_start` (its scratch tail, which no real row reads) with limit 0 (they read no key). A token
        tree's row (engine/spec/tree.py) gives its nodes' depths and ancestor bitmasks (as `RowIndex`'s); a row given
        None (or every row, where the argument is None), its unlisted positions and padding rows get a chain's:
        depth w and mask (2 << w) - 1."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        host, n = self.host_view, len(slots)
        assert width <= self.max_width and n <= rows
        host[FIRST_TOKEN : FIRST_TOKEN + width, :rows] = 0
        host[SLOT, :n], host[START, :n] = slots, starts
        host[LIMIT, :n] = host[START, :n] + width
        host[SLOT, n:rows], host[START, n:rows], host[LIMIT, n:rows] = 0, scratch_start, 0
        for b, toks in enumerate(tokens):
            host[FIRST_TOKEN : FIRST_TOKEN + len(toks), b] = toks
        first_depth, first_ancestors = self.first_depth, self.first_ancestors
        host[first_depth : first_depth + width, :rows] = self._chain_depths[:width, None]
        host[first_ancestors : first_ancestors + width, :rows] = self._chain_ancestors[:width, None]
        for b, row in enumerate(depths or ()):
            if row is not None:
                assert len(row) <= width
                host[first_depth : first_depth + len(row), b] = row
        for b, row in enumerate(ancestors or ()):
            if row is not None:
                assert len(row) <= width
                host[first_ancestors : first_ancestors + len(row), b] = row
        # the whole buffer ((3 + 3 max_width) x 8 bytes per row: ~100 KiB at 256 rows of width 16): a column slice is
        # strided, which torch would stage through pageable memory
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class StepClock:
    """Host and device time of the graph steps, so /stats shows whether host work per step stays below the
    device's: host = filling the inputs and launching (wall clock), device = a replay's own time (CUDA events
    around it, read back only when asked and only for replays that have finished: never a sync in a step)."""

    KEPT = 64  # event pairs in the ring

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._next = 0

    def events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The next (start, end) pair of the ring to record around a replay; None off CUDA."""
        if not self.cuda:
            return None
        if len(self._events) < self.KEPT:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        pair = self._events[self._next % len(self._events)]
        self._next += 1
        return pair

    def as_dict(self, steps: int) -> dict:
        """Over `steps` timed steps (the replays); device time over the ring's finished replays."""
        done = [start.elapsed_time(end) for start, end in self._events if end.query()]
        return {"host_ms_per_step": 1e3 * self.host_seconds / steps if steps else None,
                "device_ms_per_step": sum(done) / len(done) if done else None}


class GraphSteps:
    """A StaticLlama's decode and verify steps: replayed graphs for the captured (rows, width) shapes, the same
    forward run eagerly for others."""

    def __init__(self, model: StaticLlama, max_rows: int, max_width: int, scratch_start: int) -> None:
        self.model = model
        self.scratch_start = scratch_start  # a position past max_model_len: padding rows write there
        self.staging = Staging(max_rows, max_width, model.device)
        # (rows, width, layers): layers None for a full step, L for an early exit's (engine/proposers/early_exit.py)
        self.graphs: dict[tuple[int, int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.pool_bytes = 0  # device memory the captured graphs hold (their activations and outputs)
        self.replays = 0
        self.eager_steps = 0
        self.clock = StepClock(model.device)

    def capture(self, shapes: Sequence[tuple[int, int]], progress: Callable[[str], None] | None = None,
                layers: int | None = None) -> None:
        """Capture a graph per (rows, width) (of the first `layers` layers only: an early exit's steps), larger
        batches first (later, smaller graphs reuse the pool's blocks,
        as vLLM orders its captures). Each shape is run once eagerly first, on padding rows only (Triton's kernels
        compile there, cuBLAS picks its algorithms), then captured."""
        device, began = self.model.device, time.perf_counter()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        ordered = sorted(set(shapes), key=lambda s: (-s[0], -s[1]))
        for done, (rows, width) in enumerate(ordered, 1):
            self.staging.fill(rows, width, [], [], [], self.scratch_start)
            tokens, index = self.staging.views(rows, width)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.inference_mode():
                self.model.forward_rows(tokens, index, layers)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
                out = self.model.forward_rows(tokens, index, layers)
            self.graphs[(rows, width, layers)] = (graph, out)
            if progress is not None:
                progress(f"captured {done}/{len(ordered)}: batch {rows} width {width}")
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        log.info("captured %d CUDA graphs in %.1f s, holding %.0f MiB", len(ordered), time.perf_counter() - began,
                 self.pool_bytes / (1 << 20))

    def step(self, slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]],
             rows: int, width: int, layers: int | None = None, *,
             depths: Sequence[Sequence[int] | None] | None = None,  # per real row: a tree's depths, or None (a chain)
             ancestors: Sequence[Sequence[int] | None] | None = None,  # per real row: its ancestor bitmasks, or None
             ) -> torch.Tensor:  # [rows, width, V] float32 (a graph's output buffer)
        """Fill the staging buffer and run the (rows, width) step (of the first `layers` layers: an early exit):
        its graph's replay, or eagerly if not captured. Rows with `depths` and `ancestors` are token trees
        (`Staging.fill`), replayed by the same graphs as chains. A replay's output is the graph's own buffer, valid
        until the next step: read it (index it) before then."""
        began = time.perf_counter()
        self.staging.fill(rows, width, slots, starts, tokens, self.scratch_start, depths=depths, ancestors=ancestors)
        return self._run(rows, width, began, layers)

    def step_fed(self, slots: Sequence[int], starts: Sequence[int],
                 tokens: torch.Tensor,  # [n] int64 on the device: each real row's one new token
                 rows: int, layers: int | tuple[int, ...] | None = None,
                 ) -> torch.Tensor:  # [rows, 1, V] float32 (a graph's output buffer)
        """A width-1 step (of the first `layers` layers: an early exit) whose tokens are on the device: copied into
        the staging buffer behind its host copy, in the stream's order, so nothing waits for them on the host."""
        began = time.perf_counter()
        self.staging.fill(rows, 1, slots, starts, [], self.scratch_start)
        self.staging.device_buffer[FIRST_TOKEN, : len(slots)].copy_(tokens)
        return self._run(rows, 1, began, layers)

    def _run(self, rows: int, width: int, began: float, layers: int | None = None) -> torch.Tensor:
        captured = self.graphs.get((rows, width, layers))
        if captured is None:
            self.eager_steps += 1
            return self.model.forward_rows(*self.staging.views(rows, width), layers)
        graph, out = captured
        events = self.clock.events()
        if events is not None:
            events[0].record()
        graph.replay()
        if events is not None:
            events[1].record()
        self.clock.host_seconds += time.perf_counter() - began
        self.replays += 1
        return out

    def stats(self) -> dict:
        """For a worker's /stats: captured shapes, replays, eager fallbacks, pool memory, host vs device time."""
        return {"captured": len(self.graphs), "replays": self.replays, "eager_steps": self.eager_steps,
                "pool_mib": round(self.pool_bytes / (1 << 20), 1), **self.clock.as_dict(self.replays)}


def estimate_graph_bytes(config, max_rows: int, max_width: int, vocab_size: int, world: int = 1) -> int:
    """An upper estimate of what the captured graphs hold, reserved out of a KV budget given as a fraction of free
    memory: the largest step's float32 logits and their model-dtype source, plus its activations (hidden states,
    the fused qkv and gate/up outputs, in up to 4 bytes each) and attention's split buffers. The graphs share one
    pool, so the largest shape bounds it; `GraphSteps.pool_bytes` reports what capture actually took."""
    tokens = max_rows * max_width
    hidden, inter = config.hidden_size, config.intermediate_size // world
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * (getattr(config, "num_key_value_heads", None)
                                             or config.num_attention_heads)) * head_dim // world
    activations = tokens * (4 * hidden + qkv + 3 * inter) * 4
    logits = tokens * vocab_size * (4 + 4)
    attention = max_rows * 64 * 64 * max(64, head_dim) * 4
    return activations + logits + attention
