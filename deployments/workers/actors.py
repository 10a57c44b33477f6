"""The model workers as Ray actors: the plain worker classes wrapped by `ray.remote` (imported lazily, so the
classes stay usable and unit-testable without Ray)."""

from __future__ import annotations

from deployments.workers.draft import DraftWorkerCore
from deployments.workers.target import TargetWorkerCore


def ray_actor_classes():
    """The Ray actor versions of the cores (imported lazily so the cores stay usable without Ray)."""
    import ray

    # `cancel` and `ping` run on their own thread while a model call computes; every other method stays serial
    # (the default group's size is the actor's max_concurrency, 1)
    return (ray.remote(concurrency_groups={"control": 1})(DraftWorkerCore),
            ray.remote(concurrency_groups={"control": 1})(TargetWorkerCore))


