"""bench/peer_serve.py's figures: a run's summary from the JSON vLLM's benchmark client writes, greedy texts
against a reference, the issue's targets, the table and the plot (pure: tests/bench/test_peer_serve.py)."""

from __future__ import annotations

from pathlib import Path

# (label, numerator server, denominator servers (best of), concurrency, metric, op, threshold)
TARGETS = (
    ("ours plain / vLLM plain, tok/s", "ours-plain", ("vllm-plain",), 1, "tok_s", ">=", 1.0),
    ("ours plain / vLLM plain, tok/s", "ours-plain", ("vllm-plain",), 8, "tok_s", ">=", 1.0),
    ("ours default / vLLM plain, tok/s", "ours-default", ("vllm-plain",), 1, "tok_s", ">=", 1.5),
    ("ours default / vLLM best speculative, tok/s", "ours-default", ("vllm-ngram",), 1, "tok_s", ">=", 1.2),
    ("ours default / vLLM plain, tok/s", "ours-default", ("vllm-plain",), 8, "tok_s", ">=", 1.0),
    ("ours default / vLLM plain, tok/s", "ours-default", ("vllm-plain",), 16, "tok_s", ">=", 1.0),
    ("ours default / vLLM plain, TTFT p50", "ours-default", ("vllm-plain",), 1, "ttft_p50_ms", "<=", 1.5),
)


def summarize(raw: dict, max_tokens: int | None = None) -> dict:
    """The figures we compare, from the JSON that `vllm bench serve --save-result --save-detailed` writes;
    `short_outputs` counts completed requests with fewer than max_tokens tokens (ignore_eos not honoured)."""
    pick = lambda key: raw.get(key)  # noqa: E731
    errors = sorted({e for e in raw.get("errors", []) if e})
    return {
        "completed": raw["completed"], "failed": raw.get("failed", 0), "duration_s": raw["duration"],
        "output_tokens": raw["total_output_tokens"], "tok_s": raw["output_throughput"],
        "ttft_p50_ms": pick("p50_ttft_ms") if pick("p50_ttft_ms") is not None else pick("median_ttft_ms"),
        "ttft_p99_ms": pick("p99_ttft_ms"),
        "tpot_p50_ms": pick("p50_tpot_ms") if pick("p50_tpot_ms") is not None else pick("median_tpot_ms"),
        "itl_p50_ms": pick("p50_itl_ms") if pick("p50_itl_ms") is not None else pick("median_itl_ms"),
        "itl_p99_ms": pick("p99_itl_ms"), "e2el_p50_ms": pick("p50_e2el_ms"),
        "spec_acceptance_rate": pick("spec_decode_acceptance_rate"),
        "spec_acceptance_length": pick("spec_decode_acceptance_length"),
        "errors": errors[:5],
        "short_outputs": None if max_tokens is None or "output_lens" not in raw else
        sum(1 for n in raw["output_lens"] if n and n < max_tokens),
    }


def same_text_fraction(texts: list[str], reference: list[str]) -> float | None:
    if not texts or len(texts) != len(reference):
        return None
    return sum(a == b for a, b in zip(texts, reference)) / len(texts)


def evaluate_targets(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """The issue's targets over runs[server][concurrency] summaries; n/a where a side is missing."""
    out = []
    for label, num, dens, c, metric, op, threshold in TARGETS:
        row = {"target": label, "concurrency": c, "numerator": num, "op": op, "threshold": threshold,
               "ratio": None, "status": "n/a"}
        top = runs.get(num, {}).get(c)
        candidates = [(d, runs[d][c]) for d in dens if c in runs.get(d, {})]
        if top is None or not candidates:
            row["denominator"] = "/".join(dens)
            out.append(row)
            continue
        best = (min if op == "<=" else max)(candidates, key=lambda kv: kv[1][metric] or 0.0)
        row["denominator"] = best[0]
        a, b = top[metric], best[1][metric]
        broken = top["failed"] or best[1]["failed"] or not top["completed"] or not best[1]["completed"]
        if a is not None and b:
            row["ratio"] = a / b
            ok = row["ratio"] >= threshold if op == ">=" else row["ratio"] <= threshold
            row["status"] = "FAIL" if broken or not ok else "PASS"
        if broken:
            row["note"] = "failed requests"
        out.append(row)
    return out


def table(runs: dict[str, dict[int, dict]], targets: list[dict]) -> str:
    f = lambda v, spec=".0f": "-" if v is None else format(v, spec)  # noqa: E731
    head = (f"{'server':13s} {'conc':>4s} {'done':>5s} {'fail':>4s} {'tok/s':>7s} {'TTFT p50':>9s} {'TPOT p50':>9s}"
            f" {'ITL p50':>8s} {'accept':>6s} {'cached':>6s}")
    lines = [head + "   (ms; cached: share of prompt tokens read from the prefix cache)", "-" * len(head)]
    for server, by_c in runs.items():
        for c, r in sorted(by_c.items()):
            lines.append(f"{server:13s} {c:4d} {r['completed']:5d} {r['failed']:4d} {f(r['tok_s'], '.1f'):>7s} "
                         f"{f(r['ttft_p50_ms']):>9s} {f(r.get('tpot_p50_ms'), '.1f'):>9s} {f(r.get('itl_p50_ms'), '.1f'):>8s} "
                         f"{f(r.get('spec_acceptance_rate'), '.2f'):>6s} "
                         f"{f((r.get('prefix_cache') or {}).get('hit_rate'), '.0%'):>6s}")
    lines += ["", "targets (issue 16):"]
    for t in targets:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        lines.append(f"  {t['target'] + ' @' + str(t['concurrency']):50s} {ratio:>7s}  "
                     f"(want {t['op']} {t['threshold']:g}, vs {t['denominator']})  {t['status']}"
                     + (f"  [{t['note']}]" if t.get("note") else ""))
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({c for by_c in runs.values() for c in by_c})
    servers = list(runs)
    width = 0.8 / max(1, len(servers))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "tok_s", "output tokens/s"), (axes[1], "ttft_p50_ms", "TTFT p50 (ms)")):
        for i, server in enumerate(servers):
            xs = [j + i * width for j, c in enumerate(levels) if c in runs[server]]
            ys = [runs[server][c][metric] or 0.0 for c in levels if c in runs[server]]
            ax.bar(xs, ys, width, label=server)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(levels))],
                      [f"{c} stream{'s' * (c > 1)}" for c in levels])
        ax.set(title=title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("specserve vs vLLM, vllm bench serve (greedy, ignore_eos)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
