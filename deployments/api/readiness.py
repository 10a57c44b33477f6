"""Readiness: whether the router can lease the model replicas a completion needs, for GET /health.

A Draft or Target replica takes its first call only once its constructor has run, and the constructor returns only
when its model workers have loaded and opened their channels (deployments/workers/replicas.py): so a replica that answers a
`ready()` call can be leased. Until the Target deployment (and the Draft deployment, when the config uses a draft
model; n-gram and plain decoding need none) has answered one, /health answers 503; from then on 200. A probe waits
PROBE_TIMEOUT_S at most (Serve holds a call to a deployment with no running replica until one starts), concurrent
health requests share the probe in flight, and a deployment found ready is not asked again: losing a replica later
is Serve's health check's business (it replaces it), and a request then waits for its lease.

Why a deployment is not ready comes from Serve's status of it (`DeploymentStatuses`): still starting, or failed,
with Serve's message, whose StartupError line (deployments/errors.py) names the setting to change. The 503 carries
it, and the router's log has it once per distinct reason. The lookup is cached STATUS_TTL_S and bounded by
STATUS_TIMEOUT_S; when it fails, /health answers as without it.

This is not Serve's own `/-/healthz`, which the proxy answers by itself as soon as it runs, whatever the
application's state (DEPLOY.md: the probes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from deployments.errors import StartupError

PROBE_TIMEOUT_S = 1.0  # under a probe's usual timeout (wget -T 2 in the Kubernetes manifests)
NAMES = {"draft": "Draft", "target": "Target"}  # the Serve deployments (deployments/app.py)
STATUS_TTL_S = 3.0  # a looked-up status answers the health requests of this long (a probe every second or two)
STATUS_TIMEOUT_S = 2.0  # Serve's controller answers within milliseconds; a busy or lost one is not waited for
MESSAGE_CHARS = 600  # a 503's reason at most (Serve's message can hold a whole traceback)
LOGGED_KEPT = 64  # distinct reasons remembered as logged

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class DeploymentState:
    """A deployment as Serve reports it: its status (UPDATING, HEALTHY, UNHEALTHY, DEPLOY_FAILED...) and message."""

    status: str
    message: str = ""

    def reason(self) -> str:
        """The message in one line: the StartupError it holds (what to change), else its first and last lines."""
        error = StartupError.found_in(self.message)
        if error is not None:
            return str(error)[:MESSAGE_CHARS]
        lines = [line.strip() for line in self.message.splitlines() if line.strip()]
        text = " ... ".join(dict.fromkeys(lines[:1] + lines[-1:]))  # one line once, when the message is one line
        return text[:MESSAGE_CHARS]

    def wire(self) -> dict:
        return {"status": self.status, "message": self.reason()}


def serve_statuses() -> dict[str, DeploymentState]:
    """The deployments of the calling replica's application, as Serve's controller reports them (blocking: a call to
    the controller; `DeploymentStatuses` runs it in a thread)."""
    from ray import serve

    app = serve.status().applications.get(serve.get_replica_context().app_name)
    if app is None:
        return {}
    return {name: DeploymentState(getattr(d.status, "value", str(d.status)), d.message or "")
            for name, d in app.deployments.items()}


class DeploymentStatuses:
    """`lookup()` (a blocking call: `serve_statuses`) cached for `ttl_s`; concurrent callers share one lookup in
    flight, and a lookup that fails or takes over `timeout_s` answers {} (cached too: a failing controller is not
    asked on every health request)."""

    def __init__(self, lookup: Callable[[], dict[str, DeploymentState]], ttl_s: float = STATUS_TTL_S,
                 timeout_s: float = STATUS_TIMEOUT_S) -> None:
        self._lookup, self.ttl_s, self.timeout_s = lookup, ttl_s, timeout_s
        self._value: dict[str, DeploymentState] | None = None
        self._at = 0.0  # time.monotonic() of the cached value
        self._pending: asyncio.Task | None = None

    async def get(self) -> dict[str, DeploymentState]:
        if self._value is not None and time.monotonic() - self._at < self.ttl_s:
            return self._value
        pending = self._pending
        if pending is None or pending.done() or pending.get_loop() is not asyncio.get_running_loop():
            pending = self._pending = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(pending)

    async def _refresh(self) -> dict[str, DeploymentState]:
        try:
            value = await asyncio.wait_for(asyncio.to_thread(self._lookup), self.timeout_s)
        except Exception as exc:  # the reason is a courtesy: /health answers without it
            logger.debug("Serve's deployment status could not be read: %r", exc)
            value = {}
        self._value, self._at = value, time.monotonic()
        return value


class Readiness:
    def __init__(self, broker, kinds: tuple[str, ...], timeout_s: float = PROBE_TIMEOUT_S,
                 statuses: DeploymentStatuses | None = None) -> None:
        self._broker = broker  # live.LeaseBroker: `ready(kind, timeout_s)`
        self.kinds = kinds  # "draft", "target": the deployments a completion leases
        self.timeout_s = timeout_s
        self.statuses = statuses  # why a deployment is not ready; None: not known (outside Serve)
        self._ready: set[str] = set()
        self._probe: asyncio.Task | None = None
        self._logged: set[tuple[str, DeploymentState]] = set()  # reasons the router's log has had

    async def missing(self) -> list[str]:
        """The deployments (Serve names) with no replica that answered yet; [] once all have."""
        if self._ready.issuperset(self.kinds):
            return []
        probe = self._probe
        if probe is None or probe.done() or probe.get_loop() is not asyncio.get_running_loop():
            probe = self._probe = asyncio.ensure_future(self._check())
        await asyncio.shield(probe)  # a health request that goes away leaves the probe to the others
        return [NAMES[kind] for kind in self.kinds if kind not in self._ready]

    async def _check(self) -> None:
        pending = [kind for kind in self.kinds if kind not in self._ready]
        answers = await asyncio.gather(*(self._ask(kind) for kind in pending))
        self._ready.update(kind for kind, ok in zip(pending, answers) if ok)

    async def _ask(self, kind: str) -> bool:
        try:
            return bool(await self._broker.ready(kind, self.timeout_s))
        except Exception:  # no replica yet, or one failing: not ready
            return False

    async def why(self, missing: list[str]) -> dict[str, DeploymentState]:
        """Serve's state of each of the `missing` deployments it reports ({} without a status source, or when the
        lookup failed); each new reason is logged once."""
        if self.statuses is None:
            return {}
        try:
            states = await self.statuses.get()
        except Exception:  # never let the reason break /health
            return {}
        found = {name: states[name] for name in missing if name in states}
        for name, state in found.items():
            if state.message and (name, state) not in self._logged:  # a plain start (no message) is no news
                if len(self._logged) >= LOGGED_KEPT:
                    self._logged.clear()
                self._logged.add((name, state))
                log = logger.error if state.status == "DEPLOY_FAILED" else logger.warning
                log("/health: the %s deployment is not ready: %s: %s", name, state.status, state.reason())
        return found
