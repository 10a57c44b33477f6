"""Closed-loop load on a running server, streamed or not, with the router's per-round figures from /stats (issue 16:
the streaming and niceness comparisons). Not a timed test.

    python -m bench.stream_load C stream|nostream [N]   # C at a time, N requests (default 2C) of 64 greedy tokens

Warms up with C requests first. /stats figures are averages over the server's life, not this window.
"""
import concurrent.futures
import sys
import time

import httpx

BASE = "http://127.0.0.1:8000"


def one(i: int, stream: bool) -> None:
    body = {"model": "smollm2-135m-instruct", "prompt": f"Story {i}: write a long story about a dragon and a knight.",
            "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=BASE, timeout=300) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass
        else:
            client.post("/v1/completions", json=body).raise_for_status()


def main() -> None:
    concurrency, stream = int(sys.argv[1]), sys.argv[2] == "stream"
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 2 * concurrency
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: one(i, stream), range(concurrency)))
        start = time.perf_counter()
        list(pool.map(lambda i: one(i, stream), range(count)))
        seconds = time.perf_counter() - start
    stats = httpx.get(f"{BASE}/stats", timeout=30).json()
    print(f"C={concurrency} stream={stream} tok/s {count * 64 / seconds:.1f}",
          {k: round(v, 2) for k, v in stats.items() if k.endswith("per_round")})


if __name__ == "__main__":
    main()
