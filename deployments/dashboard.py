"""The Grafana dashboard, built as plain JSON in code, and a command that provisions it through Grafana's HTTP API.

    specserve-dashboard write --out dashboard.json
    specserve-dashboard push --url https://grafana.example --token "$GRAFANA_TOKEN"   # or GRAFANA_URL / GRAFANA_TOKEN

`push` uses `grafana-client` and POSTs /api/dashboards/db with a fixed uid and `overwrite: true`, so a second push
updates the same dashboard instead of adding one. The same JSON ships as a ConfigMap for Grafana's sidecar on
Kubernetes (k8s/). Every panel's PromQL is run against a real Prometheus in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from deployments.metrics import EXPORTED_PREFIX as P

UID = "specserve-overview"
TITLE = "specserve: speculative decoding"
SEL = '{model_name=~"$model_name"}'
RATE = "[$__rate_interval]"


def _rate(metric: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group}(rate({P}{metric}{SEL}{RATE}))"


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le)(rate({P}{histogram}_bucket{SEL}{RATE})))"


def _panel(title: str, targets: list[tuple[str, str]], unit: str, description: str = "") -> dict:
    return {
        "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }


def panels() -> list[dict]:
    accepted, drafted = _rate("spec_decode_num_accepted_tokens_total"), _rate("spec_decode_num_draft_tokens_total")
    drafts = _rate("spec_decode_num_drafts_total")
    specs = [
        _panel("Acceptance rate", [(f"{accepted} / {drafted}", "accepted / drafted")], "percentunit",
               "Draft tokens the target accepted, over draft tokens proposed (vLLM's definition)."),
        _panel("Mean acceptance length", [(f"1 + {accepted} / {drafts}", "tokens per round")], "none",
               "Tokens a sequence gains per round it drafted in, counting the bonus token (vLLM's convention)."),
        _panel("Acceptance by draft position",
               [(f"{_rate('spec_decode_num_accepted_tokens_per_pos_total', 'position')} "
                 f"/ ignoring(position) group_left {drafts}", "position {{position}}")], "percentunit"),
        _panel("Tokens/s", [(_rate("generation_tokens_total"), "output"), (_rate("prompt_tokens_total"), "prompt")],
               "short"),
        _panel("Prefix cache hits", [(f"({_rate('prompt_tokens_cached_total')} or vector(0)) / "
                                      f"{_rate('prompt_tokens_total')}", "prompt tokens read from the cache")],
               "percentunit", "Prompt tokens the Target workers copied from their prefix cache instead of computing, "
                              "over all prompt tokens (0 where the cache is off: runner.prefix_caching)."),
        _panel("Time to first token", [(_quantile(0.5, "time_to_first_token_seconds"), "p50"),
                                       (_quantile(0.99, "time_to_first_token_seconds"), "p99")], "s"),
        _panel("Inter-token latency", [(_quantile(0.5, "inter_token_latency_seconds"), "p50"),
                                       (_quantile(0.99, "inter_token_latency_seconds"), "p99")], "s"),
        _panel("End-to-end request latency", [(_quantile(0.5, "e2e_request_latency_seconds"), "p50"),
                                              (_quantile(0.99, "e2e_request_latency_seconds"), "p99")], "s"),
        _panel("Round phases (p50)", [(_quantile(0.5, "spec_decode_draft_seconds"), "draft"),
                                      (_quantile(0.5, "spec_decode_verify_seconds"), "verify"),
                                      (_quantile(0.5, "spec_decode_orchestration_seconds"), "orchestration (RPC)")],
               "s", "Per round, from the router: draft and verify include their RPC; orchestration is the round's "
                    "wall time minus the workers' own compute."),
        _panel("Requests by status", [(_rate("http_requests_total", "status"), "{{status}}")], "reqps"),
        _panel("Finished requests by reason", [(_rate("request_success_total", "finished_reason"),
                                                "{{finished_reason}}")], "reqps"),
        _panel("Running and waiting sequences", [(f"sum({P}num_requests_running{SEL})", "running"),
                                                 (f"sum({P}num_requests_waiting{SEL})", "waiting")], "short"),
        _panel("Speculation: K and on/off", [(f"max({P}spec_decode_k{SEL})", "mean K per round (max over routers)"),
                                             (f"min({P}spec_decode_enabled{SEL})", "on (min over routers)")],
               "short", "The K plan's choice: per request from its acceptance, and 0 where drafting stops paying at "
                        "the batch's measured costs (engine/spec/plan.py)."),
        _panel("Replicas per deployment",
               [('count by (deployment)(ray_serve_replica_processing_queries{application=~"$application"})',
                 "{{deployment}} running"),
                ('max by (deployment)(ray_serve_autoscaling_target_replicas{application=~"$application"})',
                 "{{deployment}} autoscaler target")], "short",
               "Ray Serve's own metrics: one processing-queries series per live replica, and the autoscaler's "
               "target."),
    ]
    for i, panel in enumerate(specs):
        panel["id"] = i + 1
        panel["gridPos"] = {"h": 8, "w": 8, "x": 8 * (i % 3), "y": 8 * (i // 3)}
    return specs


def build_dashboard() -> dict:
    """The dashboard JSON (Grafana's dashboard model), with datasource/model/application variables."""
    return {
        "uid": UID, "title": TITLE, "tags": ["specserve", "ray-serve", "llm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model_name", "type": "query", "label": "Model", "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": f"label_values({P}generation_tokens_total, model_name)", "refId": "model"},
             "refresh": 2},
            {"name": "application", "type": "custom", "label": "Serve application", "query": "specserve",
             "current": {"text": "specserve", "value": "specserve"}},
        ]},
        "panels": panels(),
    }


def concrete_queries(dashboard: dict, rate_interval: str = "1m", application: str = "specserve") -> list[str]:
    """Every panel query with the template variables filled in as Grafana would (for checking against Prometheus)."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            out.append(target["expr"].replace("$__rate_interval", rate_interval).replace('"$model_name"', '".*"')
                       .replace('"$application"', f'"{application}"'))
    return out


def push(url: str, token: str, folder_uid: str | None = None, timeout: float = 10.0) -> dict:
    """Create or update the dashboard in the Grafana at `url` (idempotent: fixed uid, overwrite)."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url=url, credential=token, timeout=timeout)
    payload = {"dashboard": {**build_dashboard(), "id": None}, "overwrite": True,
               "message": "provisioned by specserve-dashboard"}
    if folder_uid:
        payload["folderUid"] = folder_uid
    return api.dashboard.update_dashboard(payload)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve-dashboard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the dashboard JSON")
    w.add_argument("--out", default="-", help="file, or - for stdout")
    p = sub.add_parser("push", help="create or update the dashboard in a Grafana")
    p.add_argument("--url", default=os.environ.get("GRAFANA_URL"), help="Grafana base URL (env GRAFANA_URL)")
    p.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                   help="service-account token (env GRAFANA_TOKEN)")
    p.add_argument("--folder-uid", default=None)
    args = ap.parse_args(argv)
    if args.command == "write":
        text = json.dumps(build_dashboard(), indent=2) + "\n"
        if args.out == "-":
            sys.stdout.write(text)
        else:
            with open(args.out, "w") as f:
                f.write(text)
        return 0
    if not args.url or not args.token:
        ap.error("push needs --url and --token (or GRAFANA_URL and GRAFANA_TOKEN)")
    result = push(args.url, args.token, args.folder_uid)
    print(f"dashboard {result.get('uid', UID)} {result.get('status', 'ok')} at {result.get('url', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
