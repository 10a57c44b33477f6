"""The current summary at the top of bench/RESULTS.md, generated from the benchmark runs it cites.

    .venv/bin/python -m bench.results_summary           # print the summary (markdown)
    .venv/bin/python -m bench.results_summary --write   # replace the block between the markers in bench/RESULTS.md
    .venv/bin/python -m bench.results_summary --check   # exit 1 if that block is not what the runs give

Every figure comes from a run file in bench/plots/ named in CITED below; nothing is typed in by hand. The run files
of bench/peer_serve.py record their commit, date, machine, models and client; they do not record the command line,
so each cited run states it here (as bench/RESULTS.md's journal gives it). To bring the summary up to date, commit
the new run's JSON under bench/plots/, point CITED at it, and run `--write`; tests/bench/test_results_summary.py
fails while the block and the runs disagree. The dated journal below the block is never touched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("bench/RESULTS.md")
BEGIN = "<!-- summary:begin -->"
END = "<!-- summary:end -->"
BASELINE = "vllm-plain"  # every ratio is against this server at the same concurrency
WIDTH = 116  # bench/RESULTS.md's line width


@dataclass(frozen=True)
class CitedRun:
    workload: str  # the heading of its table
    path: str  # relative to the repository root
    command: str  # the command that wrote it, as bench/RESULTS.md records it (the JSON does not hold it)


# The runs the summary (and the README's performance table) quote: the latest served comparison with vLLM's CPU
# backend on both prompt sets, bench/RESULTS.md "Register tiles in the attention kernel; both served comparisons
# again (issue 16)".
CITED: tuple[CitedRun, ...] = (
    CitedRun("Short prompts (bench/prompts.jsonl: 12 chat, summarization and code prompts)",
             "bench/plots/peer_serve_s22_run1.json",
             "python -m bench.peer_serve"),
    CitedRun("Long prompts (bench/prompts_long.jsonl: 12 summarization prompts of ~830-990 tokens)",
             "bench/plots/peer_serve_s22_long.json",
             "python -m bench.peer_serve --concurrency 1 8 --prompts bench/prompts_long.jsonl"),
)


class MissingRun(FileNotFoundError):
    """A cited run file is absent or unreadable."""


def load(run: CitedRun, root: Path) -> dict:
    path = root / run.path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise MissingRun(f"{run.path}: cited by bench/results_summary.py ({run.workload!r}) but not found; restore "
                         "it or change CITED") from None
    except (OSError, ValueError) as exc:
        raise MissingRun(f"{run.path}: cited by bench/results_summary.py but not readable as JSON: {exc}") from exc


def server_label(name: str, server: dict, params: dict) -> str:
    if server.get("kind") == "ours":
        config = server.get("config", {})
        draft = config.get("model", {}).get("draft", "?")
        adaptive = ", adaptive K" if draft != "none" and config.get("speculation", {}).get("adaptive") else ""
        config_file = params.get("ours_config", "serve_config.yaml")
        return f"{name.replace('-', ' ')} (`{config_file}`, `draft: {draft}`{adaptive})"
    spec = server.get("speculative_config")
    vllm = f"vLLM {params.get('vllm_version', '')}".rstrip()
    if not spec:
        return f"{vllm}, plain"
    return f"{vllm}, {spec.get('method', '?')} K={spec.get('num_speculative_tokens', '?')}"


def fill(text: str) -> str:
    """`text` wrapped at WIDTH, never inside a `code span` (a command stays on one line, greppable)."""
    pieces = text.split("`")
    joined = "`".join(p.replace(" ", "\0") if i % 2 else p for i, p in enumerate(pieces))
    return textwrap.fill(joined, WIDTH, break_long_words=False, break_on_hyphens=False).replace("\0", " ")


def when(iso: str | None) -> str:
    if not iso:
        return "date not recorded"
    return datetime.datetime.fromisoformat(iso).astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def provenance(run: CitedRun, data: dict) -> str:
    p = data.get("params", {})
    commit = p.get("commit")
    commit = f"Commit {commit[:7]}" + (" (uncommitted changes)" if p.get("dirty_tree") else "") if commit \
        else "Commit not recorded"
    flags = ", ".join(p.get("cpu_flags", []))
    machine = f"{p.get('machine') or 'machine not recorded'}, {p.get('cpus', '?')} CPUs" + (f" ({flags})" if flags
                                                                                              else "")
    conc = p.get("concurrency", [])
    prompts = p.get("num_prompts", {})
    requests = "/".join(str(prompts.get(str(c), "?")) for c in conc)
    dtypes = f"ours {p.get('target_dtype_ours', '?')}, vLLM {p.get('dtype_vllm', '?')}"
    temperature = p.get("temperature")
    sampling = "greedy" if temperature == 0 else f"temperature {temperature}"
    model = p.get("served_model_name", "?")
    return fill(f"File: `{run.path}`. Command: `{run.command}` (as bench/RESULTS.md gives it; the file does not "
                f"store it). {commit}, started {when(p.get('date'))}; {machine}; model `{model}` "
                f"({dtypes}); {p.get('max_tokens', '?')} {sampling} tokens per request"
                f"{' (ignore_eos)' if p.get('ignore_eos') else ''}, {requests} requests at "
                f"{'/'.join(map(str, conc))} streams; client: {p.get('client', 'not recorded')}.")


def table(data: dict) -> list[str]:
    params, servers, runs = data.get("params", {}), data.get("servers", {}), data.get("runs", {})
    conc = [str(c) for c in params.get("concurrency", [])]
    base = runs.get(BASELINE, {})
    head = ["server"] + [f"{c} stream{'s' * (c != '1')}" for c in conc] + [f"TTFT p50 @{conc[0]}" if conc else "TTFT"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, by_conc in runs.items():
        cells = [server_label(name, servers.get(name, {}), params)]
        for c in conc:
            r = by_conc.get(c)
            if r is None:
                cells.append("-")
                continue
            ratio = ""
            if name != BASELINE and base.get(c, {}).get("tok_s"):
                ratio = f" ({r['tok_s'] / base[c]['tok_s']:.2f}x)"
            cells.append(f"{r['tok_s']:.1f}{ratio}")
        first = by_conc.get(conc[0], {}) if conc else {}
        cells.append(f"{first['ttft_p50_ms']:.0f} ms" if first.get("ttft_p50_ms") is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cache_line(data: dict) -> str:
    conc = [str(c) for c in data.get("params", {}).get("concurrency", [])]
    parts = []
    for name, by_conc in data.get("runs", {}).items():
        if name.endswith("-plain"):
            rates = [by_conc.get(c, {}).get("prefix_cache", {}).get("hit_rate") for c in conc]
            parts.append(f"{name} " + " / ".join("-" if r is None else f"{100 * r:.0f}%" for r in rates))
    return fill("- Prompt tokens read from the prefix cache at " + "/".join(conc) + " streams: " + "; ".join(parts)
                + ".") if parts else ""


def targets_line(data: dict) -> str:
    targets = data.get("targets", [])
    if not targets:
        return ""
    checked = [t for t in targets if t.get("status") in ("PASS", "FAIL")]
    failed = [f"{t['target']} @{t['concurrency']}: {t['ratio']:.2f} (needs {t['op']} {t['threshold']})"
              for t in checked if t["status"] == "FAIL"]
    return fill(f"- Targets the run checked (`targets` in the file): {len(checked) - len(failed)} of {len(checked)} "
                "pass" + (f"; failed: {'; '.join(failed)}" if failed else "") + ".")


def summary(root: Path = ROOT, cited: tuple[CitedRun, ...] | None = None) -> str:
    """The markdown block, markers included; raises MissingRun naming any cited file that is absent."""
    cited = CITED if cited is None else cited
    out = [BEGIN,
           "<!-- Generated by `python -m bench.results_summary --write` from the run files named below; edit",
           "     bench/results_summary.py, not this block. -->",
           "## Current summary", "",
           fill("Served output tokens/s of specserve against vLLM's CPU backend, both driven by vLLM's own benchmark "
                "client, one server at a time on the same machine; in parentheses the ratio to vLLM plain at the "
                "same concurrency. The dated journal below this block has how each figure came about and "
                "everything measured before."), ""]
    for run in cited:
        data = load(run, root)
        out += [f"### {run.workload}", "", provenance(run, data), "", *table(data), ""]
        out += [line for line in (cache_line(data), targets_line(data)) if line]
        out.append("")
    out.append(END)
    return "\n".join(out) + "\n"


def current_block(text: str) -> str | None:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)] + "\n"


def replace_block(text: str, block: str) -> str:
    """`text` with its marked block replaced by `block`; without markers, `block` goes right after the title."""
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        rest = text[end + len(END):]
        return text[:start] + block + rest.removeprefix("\n")
    title, sep, body = text.partition("\n")
    return title + sep + "\n" + block + "\n" + body.lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the summary block in bench/RESULTS.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md's block is stale")
    args = ap.parse_args(argv)
    try:
        block = summary()
    except MissingRun as exc:
        print(f"results_summary: {exc}", file=sys.stderr)
        return 2
    path = ROOT / RESULTS
    if args.write:
        path.write_text(replace_block(path.read_text(), block))
        print(f"results_summary: wrote the summary block of {RESULTS}")
    elif args.check:
        if current_block(path.read_text()) != block:
            print(f"results_summary: {RESULTS}'s summary block is stale; run "
                  "`python -m bench.results_summary --write`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
