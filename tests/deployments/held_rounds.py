"""Rounds a test holds: a LocalBroker's target verify calls past the first `free` wait until the test lets them go.

A test that must act while a request is mid-generation (a hang-up, a second request, a burst) holds the request's
rounds instead of slowing them down: a slow round is only a head start, which a busy machine can
use up before the test acts; a held round waits for it however long that takes. The wait is bounded (HOLD_LIMIT_S)
only so that a test that never lets go fails instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time

HOLD_LIMIT_S = 60.0


class HeldRounds:
    """Holds `broker`'s target verify calls (plain and chained rounds alike) past the first `free` until `release()`.

    `passed` counts the calls let through, `held` the calls waiting now. Thread-safe to drive from the test's thread
    while the router runs its rounds on a server thread's event loop."""

    def __init__(self, broker, monkeypatch, free: int = 0) -> None:
        self.free, self.passed, self.held = free, 0, 0
        self._released = threading.Event()
        lease = broker._lease

        async def _lease(kind, seq_id):
            got = await lease(kind, seq_id)
            if kind == "target":
                verify = got._verify

                async def _verify(run):
                    await self._turn()
                    return await verify(run)

                got._verify = _verify
            return got

        monkeypatch.setattr(broker, "_lease", _lease)

    async def _turn(self) -> None:
        if self.passed >= self.free and not self._released.is_set():
            self.held += 1
            deadline = time.monotonic() + HOLD_LIMIT_S
            try:
                while self.passed >= self.free and not self._released.is_set():
                    if time.monotonic() > deadline:
                        raise AssertionError(f"a round was held for over {HOLD_LIMIT_S:.0f} s: never released")
                    await asyncio.sleep(0.001)
            finally:
                self.held -= 1
        self.passed += 1

    def allow(self, rounds: int) -> None:
        """Let `rounds` more calls through (the held ones first); the calls after them are held again."""
        self.free += rounds

    def release(self) -> None:
        """Let every held round go, and every later one."""
        self._released.set()

    def hold(self) -> None:
        """Hold the calls from now on again (after `release()` or `allow(n)`); call it while no round is on the way."""
        self.free = self.passed
        self._released.clear()

    def __enter__(self) -> HeldRounds:
        return self

    def __exit__(self, *exc) -> None:
        self.release()  # a failing test must not leave the server's rounds waiting


def until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait (from a test's thread) until `condition()`; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.005)
