"""Which batch-invariant bf16 product computes a bf16 model's steps on this CPU: VDPBF16PS (csrc/bf16_gemm.cpp) or
AMX tiles (csrc/amx_gemm.cpp), chosen by measurement where the model is built.

Both compute the same product over the same packed weights (linear.pack_bf16) and both are batch invariant: a row's
result does not depend on the rows beside it. That is what keeps greedy speculation equal to plain decoding (a verify
row is scored as a decode step scores it) and a seeded text independent of load. Each operator alone keeps it; two
operators keep it together only if they give the same bits, and TDPBF16PS does not add a pair's products as
VDPBF16PS does. So the choice is made per shape class (`SHAPE_CLASSES`: one row, 2-8, 9-64, prompt chunks) only
where a probe finds the operators equal bit for bit on this CPU; otherwise one operator computes every class: the
one whose time, summed over the classes each relative to the fastest operator there, is least (each class counts
as much as another: one-stream decoding lives in the first, loaded servers in the second and third, time to first
token in the last).

The measurement times the model's own first-layer projections (`choose`), each class at a representative row count,
the operators alternating. One choice per process (the first bf16 model built there: a worker's target); `/stats`
(`stats()`) and the start-up log say which operator computes which class and why. `SPECSERVE_BF16_PRODUCT=vdpbf16ps`
or `=amx` fixes the operator for every class (A/B measurements); `auto` (default) measures.

Where the CPU has no AMX (or Linux refuses the tile state) there is nothing to choose and nothing is measured.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.cpu import extension as cpu_extension

log = logging.getLogger(__name__)

Product = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]

# (name, most rows in the class, rows measured for it); a product of more rows than the last bound is a prompt chunk
SHAPE_CLASSES = (("1 row", 1, 1), ("2-8 rows", 8, 8), ("9-64 rows", 64, 32), ("prompt chunks", None, 256))
MEASURE_BUDGET_S = 0.05  # per operator, class and projection: calls repeat until about this long (3 to 20 calls)


def _class_of(rows: int) -> int:
    for index, (_, most, _) in enumerate(SHAPE_CLASSES):
        if most is None or rows <= most:
            return index
    raise AssertionError("the last class has no bound")


@dataclass(frozen=True)
class ProductChoice:
    """The operator computing each of `SHAPE_CLASSES` and how it was chosen."""

    by_class: tuple[str, ...]  # operator name per class
    mixed: bool  # the operators agree bit for bit here, so classes may differ
    reason: str
    ms: dict[str, tuple[float, ...]]  # measured ms per operator per class (summed over the projections); {} if none

    def operator(self, rows: int) -> str:
        return self.by_class[_class_of(rows)]

    def stats(self) -> dict:
        return {"by_class": dict(zip((name for name, _, _ in SHAPE_CLASSES), self.by_class)), "mixed": self.mixed,
                "reason": self.reason, "ms": {op: [round(v, 4) for v in times] for op, times in self.ms.items()}}


class Bf16Products:
    """Calls the chosen operator for a product's row count; `product` is what steps call: the operator itself where
    one computes every class (no Python in between), else this dispatcher."""

    def __init__(self, choice: ProductChoice, operators: dict[str, Product]) -> None:
        self.choice = choice
        self._by_class = tuple(operators[name] for name in choice.by_class)
        self.product: Product = self._by_class[0] if len(set(choice.by_class)) == 1 else self

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return self._by_class[_class_of(x.shape[0])](x, packed, n, bias)  # x [M, K], packed [N/16, K/2, 16, 2]


_current: Bf16Products | None = None  # the measured choice (`choose`)
_fallback: Bf16Products | None = None  # products computed before any choice: VDPBF16PS


def operators() -> dict[str, Product]:
    """The batch-invariant bf16 products this CPU runs: "vdpbf16ps" where the operators load with AVX512_BF16, and
    "amx" beside it where `cpu_extension.amx_unavailable()` is None."""
    found = {}
    if cpu_extension.bf16_gemm() is not None:
        found["vdpbf16ps"] = cpu_extension.bf16_gemm()
        if cpu_extension.amx_bf16_gemm() is not None:
            found["amx"] = cpu_extension.amx_bf16_gemm()
    return found


def current() -> Product:
    """The process's bf16 product, `(x [M, K], packed, n, bias) -> [M, N]`: the choice once `choose` ran, else
    VDPBF16PS for every class."""
    global _fallback
    if _current is not None:
        return _current.product
    if _fallback is None:
        found = operators()
        if "vdpbf16ps" not in found:
            raise RuntimeError("bf16 products need specserve's CPU operators on a CPU with AVX512_BF16")
        _fallback = Bf16Products(_single("vdpbf16ps", "no choice made in this process"), found)
    return _fallback.product


def stats() -> dict | None:
    """The choice for /stats, or None where no bf16 product ran in this process."""
    return None if _current is None else _current.choice.stats()


def choose(projections: list[tuple[torch.Tensor, int]]) -> ProductChoice:
    """The process's choice, measured on `projections` ((packed weight [N/16, K/2, 16, 2], n) each: a layer's) the
    first time it is asked for; later calls return that choice."""
    global _current
    if _current is not None:
        return _current.choice
    found = operators()
    forced = os.environ.get("SPECSERVE_BF16_PRODUCT", "auto")
    if forced != "auto":
        if forced not in found:
            raise RuntimeError(f"SPECSERVE_BF16_PRODUCT={forced}: not available here (have: {sorted(found)}; "
                               f"AMX: {cpu_extension.amx_unavailable() or 'available'})")
        choice = _single(forced, f"SPECSERVE_BF16_PRODUCT={forced}")
    elif len(found) == 1:
        choice = _single(next(iter(found)), f"the only batch-invariant bf16 product here (AMX: "
                                            f"{cpu_extension.amx_unavailable()})")
    else:
        choice = _measured(found, projections)
    _current = Bf16Products(choice, found)
    log.info("bf16 products: %s (%s)", ", ".join(f"{name}: {op}" for (name, _, _), op in
                                                 zip(SHAPE_CLASSES, choice.by_class)), choice.reason)
    return choice


def _single(name: str, reason: str) -> ProductChoice:
    return ProductChoice(by_class=(name,) * len(SHAPE_CLASSES), mixed=False, reason=reason, ms={})


def agree(found: dict[str, Product], packed: torch.Tensor, n: int) -> bool:
    """Whether every operator gives the same bits on random rows (1, 8 and 40 of them) of one projection."""
    generator = torch.Generator().manual_seed(0)
    in_features = packed.shape[1] * 2
    for rows in (1, 8, 40):
        x = torch.randn(rows, in_features, generator=generator)
        results = [op(x, packed, n, None) for op in found.values()]
        if not all(torch.equal(results[0], other) for other in results[1:]):
            return False
    return True


def _measured(found: dict[str, Product], projections: list[tuple[torch.Tensor, int]],
              timer: Callable[[dict[str, Callable[[], object]], int], dict[str, float]] | None = None) -> ProductChoice:
    """The choice from each operator's time per class (`timer(calls, rows)`: ms per call, default alternating runs)."""
    timer = timer or _alternating_ms
    names = list(found)
    ms = {name: [0.0] * len(SHAPE_CLASSES) for name in names}
    for packed, n in projections:
        for index, (_, _, rows) in enumerate(SHAPE_CLASSES):
            x = torch.randn(rows, packed.shape[1] * 2)
            for name, value in timer({name: (lambda op=found[name]: op(x, packed, n, None)) for name in names},
                                     rows).items():
                ms[name][index] += value
    best = [min(ms[name][index] for name in names) for index in range(len(SHAPE_CLASSES))]
    timings = {name: tuple(times) for name, times in ms.items()}
    if agree(found, *projections[0]):
        by_class = tuple(min(names, key=lambda name: ms[name][index]) for index in range(len(SHAPE_CLASSES)))
        return ProductChoice(by_class, True, "the operators agree bit for bit here: the fastest per class", timings)
    relative = {name: sum(ms[name][i] / best[i] for i in range(len(SHAPE_CLASSES))) for name in names}
    winner = min(names, key=relative.__getitem__)
    reason = ("the operators differ in their bits here, so one computes every class: least relative time summed over "
              "the classes (" + ", ".join(f"{name} {relative[name]:.2f}" for name in names) + ")")
    return ProductChoice((winner,) * len(SHAPE_CLASSES), False, reason, timings)


def _alternating_ms(calls: dict[str, Callable[[], object]], rows: int) -> dict[str, float]:
    """Median ms of each call (a product of `rows` rows), the calls alternating (3 to 20 rounds, about
    MEASURE_BUDGET_S each)."""
    first = {}
    for name, call in calls.items():  # a warm call, which also sizes the rounds
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
    rounds = max(3, min(20, int(MEASURE_BUDGET_S / max(max(first.values()), 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}
