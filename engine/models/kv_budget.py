"""How many sequences a runner's KV cache holds: a byte budget (fixed, or a fraction of the free memory) over the
bytes one sequence of the full length takes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.models.runner import KVBudgetError

GIB = 1 << 30


@dataclass(frozen=True)
class KVBudget:
    """How much memory the KV cache may take: a fixed size, or a fraction of the memory free after the weights."""

    gib: float | None = None
    fraction: float | None = 0.2
    max_num_seqs: int = 32  # more slots than this are never allocated (the scheduler batches at most this many)

    def bytes_for(self, device: torch.device, reserve: int = 0) -> int:
        """The cache's bytes: `gib` as given, or `fraction` of the free memory left after `reserve` (what the
        CUDA graphs will hold, captured after the cache is allocated)."""
        if self.gib is not None:
            return int(self.gib * GIB)
        return int(max(0, free_memory_bytes(device) - reserve) * (self.fraction or 0.0))


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the cache will live: the GPU's (cudaMemGetInfo), or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_slots(slot_bytes: int, budget_bytes: int, max_num_seqs: int, what: str = "") -> int:
    """Sequences of full length that fit the budget (at most max_num_seqs); at least one, or an error that says
    what to change."""
    slots = min(max_num_seqs, budget_bytes // slot_bytes)
    if slots < 1:
        raise KVBudgetError(
            f"the KV-cache budget ({budget_bytes / GIB:.3f} GiB) does not hold one sequence{what} "
            f"({slot_bytes / GIB:.3f} GiB per sequence): raise kv_cache_gib / kv_cache_fraction or lower "
            f"max_model_len")
    return slots
