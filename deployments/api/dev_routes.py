"""Routes for tests and operators, served only with `dev_endpoints: true` (vLLM serves the same three under
VLLM_SERVER_DEV_MODE): POST /pause stops the receiving Router replica's rounds between two rounds, keeping its
requests (vLLM's `mode=keep`, the only mode here); POST /resume lets them continue; GET /is_paused. Each acts on the
replica that receives it, as vLLM's act on one engine behind an external load balancer: with several Router replicas,
pin their count to one for a pause to reach the one holding a request (the answer says how many sequences it holds).
Behind the API key like /v1 (router.check_http). A kept request's output is the same as without the pause."""

from __future__ import annotations

from fastapi import FastAPI

from deployments.api.errors import APIError

DEV_ROUTES = ("/pause", "/resume", "/is_paused")


def add_dev_routes(app: FastAPI, router) -> None:
    """The pause routes over `router.scheduler` (deployments/router/scheduler.Scheduler.pause, deployments/router/pause.py)."""
    scheduler = router.scheduler

    @app.post("/pause")
    async def pause(mode: str = "keep"):
        if mode != "keep":
            raise APIError(400, f"mode {mode!r} is not supported: only 'keep' (requests stay and continue on "
                                f"/resume)", param="mode", code="unsupported_value")
        await scheduler.pause()  # returns once the round in flight is back
        return {"paused": True, "live_sequences": scheduler.num_live}

    @app.post("/resume")
    async def resume():
        scheduler.resume()
        return {"paused": False, "live_sequences": scheduler.num_live}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": scheduler.gate.paused}
