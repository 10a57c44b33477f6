"""tests/low_priority.py, which `make test` runs the unit tests under: CMD gets a session of its own, a higher nice
value and (where the kernel groups by session) a lowered autogroup; its exit status and the stop signals pass
through."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import low_priority

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = [sys.executable, "-m", "tests.low_priority"]

REPORT = """import json, os, sys
auto = open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else None
print(json.dumps({"nice": os.nice(0), "sid": os.getsid(0), "autogroup": auto}))
sys.exit(3)"""


def test_the_command_runs_at_a_lower_priority_in_its_own_session_and_its_status_comes_back():
    done = subprocess.run([*WRAPPER, sys.executable, "-c", REPORT], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    got = json.loads(done.stdout)
    assert got["nice"] == min(os.nice(0) + low_priority.NICE, 19)
    assert got["sid"] != os.getsid(0)
    if got["autogroup"] is not None:
        assert got["autogroup"].split()[-2:] == ["nice", str(low_priority.NICE)], got["autogroup"]


def test_sigterm_and_sigint_reach_the_command_s_session():
    for signum in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([*WRAPPER, sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                                 "time.sleep(600)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        command = int(proc.stdout.readline())  # up, in a session (and process group) of its own
        proc.send_signal(signum)
        try:
            code = proc.wait(timeout=120)  # the command sleeps for 10 minutes: only the signal ends it sooner
        except subprocess.TimeoutExpired:
            os.killpg(command, signal.SIGKILL)  # the signal missed it
            raise
        # the command died of the signal (an unhandled KeyboardInterrupt ends Python by SIGINT), as a shell reports it
        assert code == 128 + signum, (signum, code)


def test_no_command_is_a_usage_error():
    done = subprocess.run(WRAPPER, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr
