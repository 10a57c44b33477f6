"""`python -m tests.low_priority CMD...`: run CMD at a low CPU priority, in a session of its own.

`make test` runs the unit tests beside the Ray modules (Makefile). The Ray modules wait on clusters that start,
replicas that scale and health checks with deadlines; the unit tests only compute. At a low priority the unit tests
take the cycles the Ray modules leave idle and give them back at once when a cluster needs them.

Linux schedules by session first ("autogroups", on by default) and by nice value within a session only, and the
Ray processes these tests start live partly in sessions of their own (`serve run`, the clusters bench/gpu_serve.py
starts): CMD therefore gets a new session whose autogroup is lowered, besides its own nice value. SIGINT and
SIGTERM sent to this process are passed on to CMD's session, which no longer shares the terminal's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

NICE = 10  # CPU weight 110 against 1024 for a nice-0 session: ~10% of a core the others want, all of one they leave


def _lower_priority() -> None:
    """In the child, after its setsid(): lower the new session's autogroup (if the kernel has them) and the nice
    value (what counts where it does not)."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(NICE))
    except OSError:
        pass
    os.nice(NICE)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.low_priority CMD [ARGS...]", file=sys.stderr)
        return 2
    proc: subprocess.Popen | None = None

    def forward(signum, _frame):
        if proc is not None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass

    # handled (not ignored, as in a background job of a non-interactive shell) before CMD starts, so CMD starts
    # with both signals at their defaults
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_lower_priority)
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
