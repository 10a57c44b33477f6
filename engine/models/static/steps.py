"""How the static runner's steps run (engine/models/static/runner.py): the step mode, the shape buckets a step is
padded to, the compiled CPU step, the logits a step hands back, and the guard that proves a step never reads the
device back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from engine.models.static.forward import StaticLlama

STEP_MODES = ("eager", "inductor", "graphs")


def step_mode(compile: bool | str, device: torch.device) -> str:
    """How the static runner runs its decode and verify steps, from `runner.compile` (`auto | on | off`; True and
    False read as on and off) and the device: `graphs` (CUDA graphs, engine/models/static/cuda_graphs.py) on CUDA unless
    off; on CPU `inductor` (torch.compile) when on, else `eager` (auto: compiling costs minutes per shape on a small
    CPU, README). A mode's own name is taken as is (tests run the graph path's forward eagerly on a CPU)."""
    setting = {True: "on", False: "off"}.get(compile, compile) if isinstance(compile, bool) else compile
    if setting in STEP_MODES:
        return setting
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"runner.compile must be auto, on or off, got {compile!r}")
    if setting == "off":
        return "eager"
    return "graphs" if device.type == "cuda" else ("inductor" if setting == "on" else "eager")


def buckets_up_to(limit: int, first: int = 1) -> list[int]:
    """Powers of two from `first` below `limit`, then `limit` itself."""
    out, size = [], first
    while size < limit:
        out.append(size)
        size *= 2
    return out + [limit]


def bucket(value: int, sizes: Sequence[int]) -> int:
    return next(s for s in sizes if s >= value)


@contextlib.contextmanager
def forbid_host_sync(device: torch.device) -> Iterator[None]:
    """Make a device -> host read inside the block raise: CUDA's sync debug mode on CUDA; on CPU (no syncs to
    catch) the tensor methods that read values back (`item`, `tolist`, `cpu`, `numpy`, `__bool__`) raise."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name: str) -> Callable:
        def method(*args, **kwargs):
            raise RuntimeError(f"host sync inside a model step: Tensor.{name}")
        return method

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def pick_logits(logits: torch.Tensor,  # [rows, width, V]: a step's output (a graph's own buffer on CUDA)
                rows: Sequence[int], lengths: Sequence[int], num_logits: Sequence[int]
                ) -> torch.Tensor:  # [B, max(num_logits), V]
    """Call row b's logits, from step row rows[b], at the last num_logits[b] of its lengths[b] new positions (a
    row asking fewer repeats its last one), gathered into a new tensor (a graph's buffer is free again)."""
    lengths_np = np.asarray(lengths)
    firsts = lengths_np - np.asarray(num_logits)
    index = np.minimum(firsts[:, None] + np.arange(max(num_logits))[None, :], (lengths_np - 1)[:, None])
    index = torch.from_numpy(index).to(logits.device, non_blocking=True)
    picked = torch.as_tensor(np.asarray(rows), dtype=torch.long).to(logits.device, non_blocking=True)
    return logits[picked[:, None], index]


def compile_step(model: StaticLlama) -> Callable:
    """The CPU step through inductor (`runner.compile: on` on a CPU)."""
    import torch._dynamo

    # dynamo specializes sizes 0 and 1: more graphs than its default 8 per function, which would fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    # frozen weights (constants, prepacked where the kernels allow), symbolic sizes: one graph serves every
    # batch, width and key length (dynamo still specializes sizes 0 and 1)
    return torch.compile(model.forward, dynamic=True, fullgraph=True, options={"freezing": True})
