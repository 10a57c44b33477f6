"""The dashboard JSON and its provisioning through Grafana's HTTP API (against a local stand-in for Grafana)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments import dashboard
from deployments.metrics import EXPORTED_PREFIX

TOKEN = "glsa_test_token"


class FakeGrafana(BaseHTTPRequestHandler):
    """POST /api/dashboards/db as Grafana documents it: Bearer auth, {"dashboard": {...}, "overwrite": ...}."""

    dashboards: dict = {}
    requests: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.command, self.path, self.headers.get("Authorization"),
                              self.headers.get("Content-Type"), body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(401, {"message": "Unauthorized"})
        if self.path != "/api/dashboards/db":
            return self._reply(404, {"message": "Not found"})
        dash = body.get("dashboard") or {}
        if not dash.get("title") or not isinstance(dash.get("panels"), list):
            return self._reply(400, {"message": "bad dashboard"})
        uid = dash.get("uid")
        if uid in self.dashboards and not body.get("overwrite"):
            return self._reply(412, {"status": "name-exists", "message": "exists"})
        version = self.dashboards.get(uid, {}).get("version", 0) + 1
        self.dashboards[uid] = {"dashboard": dash, "version": version}
        return self._reply(200, {"id": 1, "uid": uid, "url": f"/d/{uid}/x", "status": "success",
                                 "version": version, "slug": "x"})


@pytest.fixture()
def grafana():
    FakeGrafana.dashboards, FakeGrafana.requests = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_push_is_idempotent_and_speaks_grafanas_api(grafana, capsys):
    assert dashboard.main(["push", "--url", grafana, "--token", TOKEN]) == 0
    assert dashboard.main(["push", "--url", grafana, "--token", TOKEN]) == 0
    assert list(FakeGrafana.dashboards) == [dashboard.UID], "a second push updates, it does not duplicate"
    assert FakeGrafana.dashboards[dashboard.UID]["version"] == 2
    method, path, auth, ctype, body = FakeGrafana.requests[-1]
    assert (method, path, auth) == ("POST", "/api/dashboards/db", f"Bearer {TOKEN}")
    assert ctype.startswith("application/json") and body["overwrite"] is True
    assert body["dashboard"]["id"] is None and body["dashboard"]["uid"] == dashboard.UID
    assert "success" in capsys.readouterr().out


def test_push_with_a_wrong_token_fails_loudly(grafana):
    with pytest.raises(Exception, match="401|Unauthorized"):
        dashboard.push(grafana, "wrong")
    assert FakeGrafana.dashboards == {}


def test_push_needs_url_and_token(monkeypatch):
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        dashboard.main(["push"])


def test_dashboard_covers_what_operators_need(tmp_path):
    out = tmp_path / "d.json"
    assert dashboard.main(["write", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    titles = {p["title"] for p in d["panels"]}
    for needed in ["Acceptance rate", "Mean acceptance length", "Tokens/s", "Time to first token",
                   "Inter-token latency", "Requests by status", "Running and waiting sequences",
                   "Speculation: K and on/off", "Replicas per deployment"]:
        assert needed in titles
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    queries = dashboard.concrete_queries(d)
    assert all("$" not in q for q in queries), "every template variable is filled in"
    assert all(EXPORTED_PREFIX in q or "ray_serve_" in q for q in queries)
