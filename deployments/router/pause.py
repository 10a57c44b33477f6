"""A router's pause (vLLM's `pause_generation(mode="keep")`): while paused no round starts, and pausing waits for the
round in flight to come back, so from then until resume no round's call leaves the router. The scheduler
(deployments/router/scheduler.py) runs each round through `round()`; the routes are deployments/api/dev_routes.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RoundGate:
    def __init__(self) -> None:
        self._resumed = asyncio.Event()  # cleared while paused
        self._resumed.set()
        self._round = asyncio.Lock()  # held by the round in flight

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def renew(self) -> None:
        """Fresh primitives for a new event loop (the last loop's may be gone); a pause carries over."""
        paused, self._resumed, self._round = self.paused, asyncio.Event(), asyncio.Lock()
        if not paused:
            self._resumed.set()

    async def pause(self) -> None:
        """Pause, once the round in flight (if any) is back."""
        self._resumed.clear()
        async with self._round:
            pass

    def resume(self) -> None:
        self._resumed.set()

    async def resumed(self) -> None:
        await self._resumed.wait()

    @asynccontextmanager
    async def round(self) -> AsyncIterator[bool]:
        """Hold the round's place; yields whether it may run (a pause may have come while it waited)."""
        async with self._round:
            yield not self.paused
