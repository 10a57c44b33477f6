"""bench/gpu_serve.py's figures: a level's summary from its records and the router's /stats, the roofline and the
ratios to it, greedy equality with plain, and the markdown table (pure: tests/bench/test_gpu_serve.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.server_counters import round_timings
from bench.synthetic_pair import Shape, param_counts

BYTES_PER_PARAM = 2  # bf16

@dataclass
class Record:
    """One streamed completion: its prompt, when it was sent, when each chunk with text came, its text."""

    prompt_index: int
    sent: float
    arrivals: list[float]
    text: str
    completion_tokens: int


def level_summary(records: list[Record], wall_s: float, before: dict, after: dict) -> dict:
    """A level's figures from its measured requests and the router's /stats before and after them."""
    tokens = sum(r.completion_tokens for r in records)
    ttft = [r.arrivals[0] - r.sent for r in records if r.arrivals]
    tpot = [(r.arrivals[-1] - r.arrivals[0]) / (r.completion_tokens - 1)
            for r in records if r.arrivals and r.completion_tokens > 1]
    spec0, spec1 = before.get("speculative") or {}, after.get("speculative") or {}
    d = {k: spec1.get(k, 0) - spec0.get(k, 0) for k in ("rounds", "num_drafts", "num_draft_tokens",
                                                         "num_accepted_tokens")}
    rounds = round_timings(before, after)
    out = {"requests": len(records), "output_tokens": tokens, "wall_s": round(wall_s, 3),
           "tok_s": tokens / wall_s if wall_s > 0 else None,
           "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None,
           "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else None, "spec": d, "rounds": rounds,
           "mean_accepted_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None,
           "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
           "draft_tokens_per_round": d["num_draft_tokens"] / d["rounds"] if d["rounds"] else 0.0}
    if rounds["rounds"]:
        out["host_ms_per_round"] = rounds["orchestration_ms_per_round"]
        out["device_ms_per_round"] = rounds["draft_compute_ms_per_round"] + rounds["verify_compute_ms_per_round"]
        # drafting's share of a round's device time: the Draft workers', or a drafter's inside the target's call
        drafting = rounds["draft_compute_ms_per_round"] + rounds.get("target_draft_compute_ms_per_round", 0.0)
        out["drafting_share"] = drafting / out["device_ms_per_round"] if out["device_ms_per_round"] else None
    return out


def roofline(shape: Shape, bandwidth: float) -> dict:
    """Weight bytes a decode step reads (bf16) and the time that takes at the measured bandwidth."""
    p = param_counts(shape)
    target, draft = p["target_read"] * BYTES_PER_PARAM, p["draft_read"] * BYTES_PER_PARAM
    return {"bandwidth_gb_s": bandwidth / 1e9, "target_read_gb": target / 1e9, "draft_read_gb": draft / 1e9,
            "target_step_ms": 1e3 * target / bandwidth, "draft_step_ms": 1e3 * draft / bandwidth}


def roofline_ratios(level: dict, streams: int, roof: dict) -> dict:
    """The level's figures as fractions of their rooflines: one target step per token of each stream (tok/s),
    one step to the first token (TTFT), and per round one target step plus a draft step per draft token; a
    speculative level also against its own bound, such rounds each emitting the mean accepted length."""
    step = roof["target_step_ms"]
    round_ms = step + level.get("draft_tokens_per_round", 0.0) * roof["draft_step_ms"]
    out = {"roofline_tok_s": streams * 1e3 / step, "roofline_round_ms": round_ms}
    out["tok_s_vs_roofline"] = level["tok_s"] / out["roofline_tok_s"] if level.get("tok_s") else None
    out["ttft_vs_roofline"] = step / level["ttft_p50_ms"] if level.get("ttft_p50_ms") else None
    if level.get("device_ms_per_round"):
        out["device_round_vs_roofline"] = round_ms / level["device_ms_per_round"]
    if level.get("mean_accepted_length") and level.get("tok_s"):
        out["speculative_roofline_tok_s"] = streams * level["mean_accepted_length"] * 1e3 / round_ms
        out["tok_s_vs_speculative_roofline"] = level["tok_s"] / out["speculative_roofline_tok_s"]
    return out


def greedy_equality(plain: dict[int, str], spec: dict[int, str]) -> dict:
    """Over the prompts both variants ran: how many gave the same greedy text, and where each pair that differs
    first differs, in words (the synthetic pair's tokenizer makes a word of each token): a rounding flip of a
    near-tie shows as a late divergence, a broken step as one at the start."""
    common = sorted(set(plain) & set(spec))
    same = sum(plain[i] == spec[i] for i in common)
    diverged = sorted(_first_difference(plain[i].split(), spec[i].split()) for i in common if plain[i] != spec[i])
    return {"prompts": len(common), "same": same, "fraction": same / len(common) if common else None,
            "diverged_at_words": diverged}


def _first_difference(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_with_plain(variants: dict, texts: dict, concurrency: list[int]) -> tuple[dict, dict]:
    """Per drafting variant and level: greedy equality of its texts with plain's, and its tok/s over plain's."""
    equal: dict = {}
    speedup: dict = {}
    plain = variants.get("plain", {}).get("levels", {})
    for name in variants:
        if name == "plain":
            continue
        for c in concurrency:
            if c in texts.get("plain", {}) and c in texts.get(name, {}):
                equal.setdefault(name, {})[c] = greedy_equality(texts["plain"][c], texts[name][c])
            a, b = plain.get(c), variants[name].get("levels", {}).get(c)
            if a and b and a.get("tok_s") and b.get("tok_s"):
                speedup.setdefault(name, {})[c] = b["tok_s"] / a["tok_s"]
    return equal, speedup


COLUMNS = ("variant", "streams", "tok/s", "of roofline", "TTFT p50 ms", "of roofline", "TPOT p50 ms",
           "accepted length", "acceptance", "host ms/round", "device ms/round", "of roofline", "drafting share",
           "same text")


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _header(report: dict) -> list[str]:
    pair, roof, params = report["pair"], report["roofline"], report["pair"]["params"]
    lines = [f"synthetic {pair['shape']} pair, noise {pair['noise']:g}: target {params['target'] / 1e9:.2f}B params, "
             f"draft {params['draft'] / 1e9:.2f}B; vocabulary {pair['vocab']}",
             f"{report['device_name']}: copy bandwidth {roof['bandwidth_gb_s']:.0f} GB/s; roofline step "
             f"{roof['target_step_ms']:.3f} ms target ({roof['target_read_gb']:.2f} GB), "
             f"{roof['draft_step_ms']:.3f} ms draft ({roof['draft_read_gb']:.2f} GB)"]
    for name, v in report["variants"].items():
        st, error = v.get("startup") or {}, v.get("error")
        lines.append(f"start-up {name}: {st.get('health_s', '-')} s to /health 200, {st.get('ready_s', '-')} s to "
                     "the first completion" + (f"; error: {error.splitlines()[0][:200]}" if error else ""))
    return lines


def _row(name: str, c: int, r: dict, same: dict) -> str:
    cells = [name, str(c), _fmt(r["tok_s"]), _fmt(r["tok_s_vs_roofline"], ".2f"), _fmt(r["ttft_p50_ms"]),
             _fmt(r["ttft_vs_roofline"], ".2f"), _fmt(r["tpot_p50_ms"], ".2f"), _fmt(r["mean_accepted_length"], ".2f"),
             _fmt(r["acceptance_rate"], ".2f"), _fmt(r.get("host_ms_per_round"), ".2f"),
             _fmt(r.get("device_ms_per_round"), ".2f"), _fmt(r.get("device_round_vs_roofline"), ".2f"),
             _fmt(r.get("drafting_share"), ".2f"),
             f"{same['same']}/{same['prompts']}" if same.get("prompts") else "-"]
    return "| " + " | ".join(cells) + " |"


def table(report: dict) -> str:
    """Markdown: the pair and roofline, one row per variant and concurrency, then the speed-ups."""
    lines = _header(report) + ["", "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for name, v in report["variants"].items():
        for c, r in v.get("levels", {}).items():
            lines.append(_row(name, c, r, report["greedy_equal"].get(name, {}).get(c, {})))
    lines.append("")
    for name, by_level in report["speedup"].items():
        speedups = ", ".join(f"{c} streams {x:.2f}x" for c, x in by_level.items()) or "-"
        lines.append(f"{name} / plain tok/s: {speedups}")
    for name, by_level in report["greedy_equal"].items():
        firsts = "; ".join(f"{c} streams {e['diverged_at_words']}" for c, e in by_level.items()
                           if e.get("diverged_at_words"))
        if firsts:
            lines.append(f"{name}: first word where a text differs from plain: {firsts}")
    return "\n".join(lines)
