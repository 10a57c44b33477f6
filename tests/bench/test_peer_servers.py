"""bench/peer_servers.py: how `serve run` is started, and a server's start-up times (against a fake server)."""

import subprocess
import sys
import textwrap

from bench.peer_servers import ROOT, SERVE_CLI_CODE, ManagedServer, port_free, serve_run_argv


def test_serve_run_starts_from_the_script_or_through_python():
    script = serve_run_argv("c.yaml", python_cli=False)
    assert script[0].endswith("/serve") and script[1:] == ["run", "c.yaml", "--address", "local"]
    python = serve_run_argv("c.yaml", python_cli=True)
    assert python[:3] == [sys.executable, "-c", SERVE_CLI_CODE] and python[3:] == script[1:]


FAKE_SERVER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    calls = []
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass
        def _answer(self, status, body):
            calls.append(self.path + " " + str(status))
            open(sys.argv[2], "w").write("\\n".join(calls))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):  # /health: 503 three times, then 200
            self._answer(503 if sum(c.startswith("/health") for c in calls) < 3 else 200, {})
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer(200, {"choices": [{"text": "hi"}]})
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
''')


def test_ready_waits_for_health_200_then_a_completion_and_records_both(tmp_path):
    port = next(p for p in range(8931, 8999) if port_free(p))
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    calls = tmp_path / "calls.txt"
    server = ManagedServer("fake", [sys.executable, str(tmp_path / "fake.py"), str(port), str(calls)],
                           f"http://127.0.0.1:{port}", "m", tmp_path / "fake.log")
    server.start()
    try:
        server.wait_ready(30)
    finally:
        assert server.stop() == []
    # no completion before /health said 200 (our /health is 200 once a completion can lease its replicas)
    assert calls.read_text().splitlines() == ["/health 503"] * 3 + ["/health 200", "/v1/completions 200"]
    assert 0 < server.timings["health_s"] <= server.timings["ready_s"]


CHILD_SIGINT = textwrap.dedent("""
    import signal, subprocess, sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a non-interactive shell starts
    if sys.argv[1] == "restore":
        from bench.peer_servers import sigint_reaches_children
        sigint_reaches_children()
    child = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    sys.exit(subprocess.call([sys.executable, "-c", child]))
""")


def test_servers_started_from_a_process_that_ignores_sigint_still_stop_on_it():
    def child_ignores(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", CHILD_SIGINT, mode], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()

    assert child_ignores("inherit") == "True"  # what stop() met: each SIGINT ignored, the whole grace waited
    assert child_ignores("restore") == "False"
