"""The shipped alert rules and Grafana dashboard, checked by the real Prometheus tools.

``promtool`` validates and unit-tests the rules (dashboards/alerts.test.yaml feeds series
in which acceptance drifts from 0.8 to 0.4). A real Prometheus then scrapes a real
``ServiceMetrics`` registry and a recorded vLLM 0.32 page with the rules loaded, and
every dashboard query must run and every metric it names must exist there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from controller.telemetry import ServiceMetrics
from testbed.server import free_port
from tests.helpers.prometheus import prometheus_binary, running_prometheus

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
VLLM_PAGE = ROOT / "tests" / "fixtures" / "vllm-0.32" / "metrics-ngram-after.txt"

pytestmark = pytest.mark.prometheus


def promtool() -> str:
    prometheus_binary()  # skips, or fails when required, exactly as for the server
    found = shutil.which("promtool")
    assert found is not None, "promtool ships with the prometheus package"
    return found


def test_alert_rules_are_valid_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        result = subprocess.run(
            [promtool(), *args], cwd=DASHBOARDS, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries() -> list[str]:
    dashboard = json.loads((DASHBOARDS / "specpilot.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.fixture
def vllm_page() -> Iterator[str]:
    page = VLLM_PAGE.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_dashboard_query_runs_on_real_series(vllm_page: str, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    # Labelled series exist once a child does.
    context = {"model": "m", "workload_class": "code", "bucket": "1"}
    metrics.predicted_speedup.labels(**context).set(1.4)
    metrics.estimated_acceptance.labels(**context).set(0.8)
    metrics.decisions.labels(actor="policy").inc()
    metrics.guard_rail_rejections.labels(rule="dwell").inc()
    metrics.actuations.labels(actuator="file", outcome="ok").inc()
    metrics.loop_duration.observe(0.01)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with running_prometheus(
            [f"127.0.0.1:{port}", vllm_page],
            tmp_path,
            rule_files=[DASHBOARDS / "alerts.yaml"],
        ) as prometheus:
            names = set()
            for expr in dashboard_queries():
                names |= set(re.findall(r"\b(specpilot_[a-z_]+|vllm:[a-z_]+)\b", expr))
            for name in sorted(names):
                prometheus.wait_for(f'count({{__name__="{name}"}})', budget_s=30)
            # The recording rule the dashboard and the drift alert share is evaluated.
            prometheus.wait_for("specpilot:vllm_acceptance:ratio_rate10m", budget_s=30)
            for expr in dashboard_queries():
                prometheus.query(expr)  # a query Prometheus cannot run fails here
    finally:
        server.shutdown()
        thread.join(timeout=5)
