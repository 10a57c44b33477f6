"""Readiness: whether the router can lease the model replicas a completion needs, for GET /health.

A Draft or Target replica takes its first call only once its constructor has run, and the constructor returns only
when its model workers have loaded and opened their channels (model_deployments.py): so a replica that answers a
`ready()` call can be leased. Until the Target deployment (and the Draft deployment, when the config uses a draft
model; n-gram and plain decoding need none) has answered one, /health answers 503; from then on 200. A probe waits
PROBE_TIMEOUT_S at most (Serve holds a call to a deployment with no running replica until one starts), concurrent
health requests share the probe in flight, and a deployment found ready is not asked again: losing a replica later
is Serve's health check's business (it replaces it), and a request then waits for its lease.

This is not Serve's own `/-/healthz`, which the proxy answers by itself as soon as it runs, whatever the
application's state (DEPLOY.md: the probes).
"""

from __future__ import annotations

import asyncio

PROBE_TIMEOUT_S = 1.0  # under a probe's usual timeout (wget -T 2 in the Kubernetes manifests)
NAMES = {"draft": "Draft", "target": "Target"}  # the Serve deployments (deployments/app.py)


class Readiness:
    def __init__(self, broker, kinds: tuple[str, ...], timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._broker = broker  # live.LeaseBroker: `ready(kind, timeout_s)`
        self.kinds = kinds  # "draft", "target": the deployments a completion leases
        self.timeout_s = timeout_s
        self._ready: set[str] = set()
        self._probe: asyncio.Task | None = None

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
