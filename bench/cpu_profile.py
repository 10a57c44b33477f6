"""Where a served run's CPU time goes, from `perf record -a` samples over the whole machine (issue 50): per process
role (the model's worker, the router or API server, the proxy, Ray's daemons, the benchmark client, idle) and, in
the model's worker, per kind of work (matrix products, attention, elementwise operators, threads waiting for work,
Python, torch's dispatch, the kernel). The same rules sort our server's and vLLM's processes, so the two read side by
side. Used by bench/peer_serve.py (`--perf-at C`); not a timed test.

Processes are named while the block runs (every second), so a client that has ended is still the client. Sorting
is by names only (a process's command line, a sample's shared object and symbol), so it is approximate:
code generated at run time has no symbol (vLLM's oneDNN products run such code: "JIT code"), and a symbol that
matches no rule is "other".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

FREQUENCY_HZ = 499
TOP_SYMBOLS = 15  # busiest symbols (and processes) kept in the breakdown, to check the sorting by
KIND_ROLES = ("model worker", "scheduler")  # the roles whose samples are sorted by kind of work

# (role, pattern over "comm | cmdline"), first match wins. vLLM: the API server, the engine core (its scheduler, a
# process of its own) and the worker (the model's forward); ours: the router (scheduler and HTTP ingress), the Target
# worker (the model's forward) and the Serve replicas that lease it
ROLES = (
    ("idle", r"^swapper"),
    ("client", r"vllm\.benchmarks|bench serve|benchmarks\.serve"),
    ("model worker", r"TargetWork|DraftWork|VLLM::Worker"),
    ("scheduler", r"EngineCor|ServeReplica:[^ ]*:Router"),
    ("Serve's model replicas (leases)", r"TargetServer|DraftServer"),
    ("HTTP server / proxy", r"api_server|APIServer|vllm_cli\.py serve|vllm serve|haproxy|ProxyActor|HAProxyMan"),
    ("Ray's daemons", r"raylet|gcs_server|dashboard|Dashboard|log_monitor|ServeController|monitor\.py|ray::IDLE|"
                      r"runtime_env|serve run|ray/_private"),
)

# (kind, pattern over "dso symbol"), first match wins
KINDS = (
    ("attention", r"attention|attend|score_keys|weigh_values|paged|flash|sdpa|softmax"),
    ("matrix products", r"gemm|\btile<|Tiles::|panel|dpbf16|brgemm|dnnl|mkl|onednn|matmul|\bmm\b|linear|to_bf16_pairs"),
    ("elementwise", r"rms_norm|rmsnorm|silu|rope|rotary|act_and_mul|layer_norm|add_rms"),
    ("threads waiting", r"libgomp|libiomp|Pool::|spin|futex|sched_yield|omp_"),
    ("JIT code", r"^\[unknown\]|^\[JIT\]"),
    ("Python", r"python3|libpython"),
    ("torch dispatch", r"libtorch|libc10"),
    ("kernel", r"\[kernel\.kallsyms\]"),
)


def role_of(name: str) -> str:
    """A process's role from "comm | cmdline"."""
    for role, pattern in ROLES:
        if re.search(pattern, name):
            return role
    return "other"


def kind_of(dso: str, symbol: str) -> str:
    """A sample's kind of work from its shared object and symbol."""
    text = f"{dso} {symbol}"
    for kind, pattern in KINDS:
        if re.search(pattern, text):
            return kind
    return "other"


# `perf report --stdio -n --sort pid,dso,sym`: "  <percent>%  <samples>  <pid>:<comm>  <dso>  [.] <symbol>"
REPORT_LINE = re.compile(r"^\s*(?:[\d.]+%\s+)?(\d+)\s+(\d+):(.+?)\s{2,}(\S+)\s+\[[.kgHu]\]\s+(.*)$")


def parse_report(text: str) -> list[tuple[int, int, str, str, str]]:
    """(samples, pid, comm, dso, symbol) per line of `perf report --stdio -n --sort pid,dso,sym` (pid 0: idle)."""
    rows = []
    for line in text.splitlines():
        match = REPORT_LINE.match(line)
        if match:
            samples, pid, comm, dso, symbol = match.groups()
            rows.append((int(samples), int(pid), comm.strip(), dso, symbol.strip()))
    return rows


def breakdown(rows: list[tuple[int, int, str, str, str]], names: dict[int, str]) -> dict:
    """Shares of all samples (every CPU, idle included), in percent: by role, by process, and per server role (the
    model worker, the scheduler) by kind of work with its busiest symbols; `names`: thread id -> "comm | cmdline"
    (threads not in it go by their comm)."""
    total = sum(samples for samples, *_ in rows) or 1
    roles, processes = Counter(), Counter()
    kinds: dict[str, Counter] = {role: Counter() for role in KIND_ROLES}
    symbols: dict[str, Counter] = {role: Counter() for role in KIND_ROLES}
    for samples, pid, comm, dso, symbol in rows:
        name = names.get(pid, comm)
        role = "idle" if pid == 0 else role_of(name)
        roles[role] += samples
        processes[f"{role}: {name[:90]}"] += samples
        if role in kinds:
            kind = kind_of(dso, symbol)
            kinds[role][kind] += samples
            symbols[role][f"{kind}: {dso} {symbol[:100]}"] += samples
    percent = lambda counter, n=None: {k: round(100 * v / total, 1) for k, v in counter.most_common(n)}  # noqa: E731
    return {"samples": total, "roles": percent(roles), "processes": percent(processes, TOP_SYMBOLS),
            "kinds": {role: percent(kinds[role]) for role in KIND_ROLES},
            "top": {role: percent(symbols[role], TOP_SYMBOLS) for role in KIND_ROLES}}


@dataclass(frozen=True)
class Process:
    name: str  # "comm | cmdline"
    seconds: float  # user + system CPU seconds so far, its threads' included
    threads: tuple[int, ...]  # its thread ids


def processes() -> dict[int, Process]:
    """Every process now, by pid, in one walk of /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                comm = (entry / "comm").read_text().strip()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
                threads = tuple(int(t.name) for t in (entry / "task").iterdir())
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry.name)] = Process(f"{comm} | {cmd}", (int(fields[11]) + int(fields[12])) / tick, threads)
    return out


def thread_names(now: dict[int, Process]) -> dict[int, str]:
    """thread id -> its process's "comm | cmdline" (perf's "pid" is the thread: a worker's compute threads carry their
    own names, their process's command line says what they work for)."""
    return {tid: process.name for process in now.values() for tid in process.threads}


def seconds_by_role(before: dict[int, tuple[str, float]], last: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two readings of pid -> (name, CPU seconds) (`last`: each process's last reading, so one
    that ended inside counts up to then; one that started inside counts from 0): a check on the sampled shares that
    does not depend on perf."""
    out: Counter = Counter()
    for pid, (name, seconds) in last.items():
        out[role_of(name)] += seconds - before.get(pid, (name, 0.0))[1]
    return {role: round(value, 2) for role, value in out.most_common() if value > 0.005}


@contextmanager
def recorded(data: Path):
    """`perf record -a` over the block into `data`; yields a dict that holds the breakdown after the block (or
    {"error": ...} where perf is missing or refused)."""
    result: dict = {}
    try:
        proc = subprocess.Popen(["perf", "record", "-a", "-F", str(FREQUENCY_HZ), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as error:
        result["error"] = f"perf: {error}"
        yield result
        return
    names: dict[int, str] = {}
    done = threading.Event()
    first = processes()
    before = {pid: (process.name, process.seconds) for pid, process in first.items()}
    last: dict[int, tuple[str, float]] = dict(before)

    def read() -> None:  # the fullest name a thread or process had (an exited process loses its cmdline)
        now = processes()
        for tid, name in thread_names(now).items():
            if len(name) > len(names.get(tid, "")):
                names[tid] = name
        for pid, process in now.items():
            name = process.name if len(process.name) >= len(last.get(pid, ("", 0.0))[0]) else last[pid][0]
            last[pid] = (name, process.seconds)

    def watch() -> None:  # processes that end inside the block (the client) are named while they run
        while True:
            read()
            if done.wait(1.0):
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield result
    finally:
        done.set()
        watcher.join()
        read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    if proc.returncode not in (0, -signal.SIGINT) or not data.is_file():
        result["error"] = f"perf record failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}"
        return
    report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "-n", "--sort", "pid,dso,sym"],
                            capture_output=True, text=True, env={**os.environ, "PAGER": "cat"})
    result.update(breakdown(parse_report(report.stdout), names))
    result["cpu_seconds_by_role"] = seconds_by_role(before, last)
    data.unlink(missing_ok=True)  # large; the breakdown is the record
