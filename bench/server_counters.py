"""What a served benchmark reads from the servers between its runs: our router's rounds and timings from /stats,
and prompt tokens read from the prefix cache (ours from /stats, vLLM's from its Prometheus counters)."""

from __future__ import annotations

from bench.peer_servers import ManagedServer

ROUND_TIMINGS = ("draft_ms_per_round", "verify_ms_per_round", "draft_compute_ms_per_round",
                 "verify_compute_ms_per_round", "target_draft_compute_ms_per_round", "orchestration_ms_per_round")


def round_timings(before: dict, after: dict) -> dict:
    """The router's group rounds between two /stats answers (warm-ups included): how many, their mean batch, and
    each of ROUND_TIMINGS over those rounds only (/stats gives means since start)."""
    n0, n1 = before.get("rounds", 0), after.get("rounds", 0)
    out = {"rounds": n1 - n0}
    if n1 > n0:
        total = lambda st, key: st.get(key, 0.0) * st.get("rounds", 0)  # noqa: E731
        out["mean_batch"] = round((total(after, "mean_batch") - total(before, "mean_batch")) / (n1 - n0), 2)
        for key in ROUND_TIMINGS:
            out[key] = round((total(after, key) - total(before, key)) / (n1 - n0), 2)
    return out


def prefix_cache_counts(server: ManagedServer) -> tuple[float, float] | None:
    """(prompt tokens looked up, tokens read from the prefix cache) since the server started: ours from /stats
    (the router's count of its requests' prompt tokens and of the hits the Target workers reported), vLLM's from its
    /metrics counters `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`; None if unavailable. Warm-up requests
    are counted too (they are part of each run's client call)."""
    import httpx

    try:
        if server.name.startswith("ours"):
            cache = httpx.get(f"{server.base_url}/stats", timeout=10).json().get("prefix_cache") or {}
            return float(cache["prompt_tokens"]), float(cache["cached_prompt_tokens"])
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return prometheus_total(text, "vllm:prefix_cache_queries_total"), prometheus_total(text, "vllm:prefix_cache_hits_total")


def prometheus_total(text: str, name: str) -> float:
    """The sum of a metric's samples (every label set) in Prometheus' text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prefix_cache_delta(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict | None:
    if before is None or after is None:
        return None
    queried, hits = after[0] - before[0], after[1] - before[1]
    return {"queried_tokens": int(queried), "hit_tokens": int(hits),
            "hit_rate": round(hits / queried, 4) if queried else None}


def ours_stats(server: ManagedServer) -> dict:
    import httpx

    try:
        return httpx.get(f"{server.base_url}/stats", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
