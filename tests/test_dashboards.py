"""The shipped alert rules and Grafana dashboard, checked by the real Prometheus tools.

``promtool`` validates and unit-tests the rules (dashboards/alerts.test.yaml feeds series
in which acceptance falls from 0.8 to 0.4 gradually and abruptly, recovers, tokens per
verify step and time per output token move, and no replica reports). A real Prometheus
then scrapes a real ``ServiceMetrics`` registry and a recorded vLLM 0.32 page with the
rules loaded: every dashboard query must run and every vLLM metric it names must be on
that page. Last, the whole thing for real: specpilot serving a managed pool whose vLLM
it started, through its gateway, scraped with that vLLM by one Prometheus; after a
little traffic every panel, annotation and variable is asked as Grafana asks it and
must return series (bar those listed in ``EMPTY_WHEN``, each with the fact that makes it
empty, checked), and every metric it names must be in the scraped targets' metadata.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from bench.sidecar import sidecar_settings
from controller.runtime import Runtime, assemble
from controller.settings import Settings
from controller.telemetry import ServiceMetrics
from testbed.server import free_port
from testbed.traffic import run_streams
from tests.helpers.prometheus import PrometheusServer, promtool, running_prometheus

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
DASHBOARD = DASHBOARDS / "specpilot.json"
RULES = DASHBOARDS / "alerts.yaml"
VLLM_PAGE = ROOT / "tests" / "fixtures" / "vllm-0.32" / "metrics-ngram-after.txt"

RECORDED = (
    "specpilot:vllm_acceptance:ratio_rate10m",
    "specpilot:vllm_tokens_per_verify:rate10m",
    "specpilot:vllm_time_per_output_token_seconds:mean10m",
)
VARIABLES = ("job", "model_name", "instance", "engine")
"""vLLM's own speculative-decoding dashboard's variables (uid ``vllm-spec-decode``)."""
METRIC = re.compile(r"\b(vllm:[a-z_]+|specpilot_[a-z_]+|specpilot:[a-z0-9_:]+)")
SELECTOR = re.compile(r"\b((?:vllm:|specpilot_)[a-z_]+)(\{[^}]*\})?(\[[^\]]*\])?")
SCRAPE_S = 1.0
STEP_S = 2.0
"""Range-query step: Grafana's ``$__interval`` (what it takes for a range of minutes)."""

pytestmark = pytest.mark.prometheus


# -- the dashboard as Grafana reads it --------------------------------------------------


@dataclass(frozen=True)
class Query:
    where: str
    """``panel title/refId``, or ``annotation NAME``."""
    expr: str


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries() -> list[Query]:
    board = dashboard()
    found = [
        Query(f"{panel['title']}/{target['refId']}", target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", ())
    ]
    found += [
        Query(f"annotation {a['name']}", a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    return found


def variables() -> list[tuple[str, str]]:
    """(name, ``label_values(...)`` query) of the query variables, in order."""
    return [
        (v["name"], v["definition"])
        for v in dashboard()["templating"]["list"]
        if v["type"] == "query"
    ]


def grafana_regex(values: Sequence[str]) -> str:
    """What Grafana puts for ``$var`` of a multi-value Prometheus variable set to All:
    the values regex-escaped, as one alternation, escaped again for a PromQL string."""
    escaped = [re.sub(r"([\\$^*{}\[\]'+?.()|])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def interpolate(expr: str, values: Mapping[str, Sequence[str]]) -> str:
    """``expr`` with Grafana's variables put in: ``$__interval`` is the step, and
    ``$__rate_interval`` what Grafana makes of it and the scrape interval."""
    rate_interval = max(STEP_S + SCRAPE_S, 4 * SCRAPE_S)
    expr = expr.replace("$__rate_interval", f"{rate_interval:g}s")
    expr = expr.replace("$__interval", f"{STEP_S:g}s")
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${name}", grafana_regex(values[name]))
    assert "$" not in expr, expr
    return expr


def resolve_variables(
    prometheus: PrometheusServer, start: float, end: float
) -> dict[str, list[str]]:
    """Each variable's values as Grafana finds them (``label_values`` over the range),
    later ones filtered by the earlier ones."""
    values: dict[str, list[str]] = {}
    for name, definition in variables():
        call = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
        assert call is not None, definition
        selector, label = interpolate(call.group(1), values), call.group(2)
        found = prometheus.api(
            f"label/{label}/values", start=start, end=end, **{"match[]": selector}
        )
        assert found, f"variable {name}: {definition} finds no value"
        values[name] = sorted(found)
    return values


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


# -- without servers ------------------------------------------------------------------------


def test_alert_rules_are_valid_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        result = subprocess.run(
            [promtool(), *args], cwd=DASHBOARDS, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_selects_vllm_series_as_vllms_own_dashboard_does() -> None:
    """vLLM's variables, each vLLM selector filtered by them and every rate over
    ``$__rate_interval``; specpilot's per-model series follow ``$model_name`` (the label
    is vLLM's); the figures of vLLM's dashboard are there (per-position acceptance,
    token flow, inter-token latency quantiles)."""
    assert [name for name, _ in variables()] == list(VARIABLES)
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for query in queries():
        for name, matchers, window in SELECTOR.findall(query.expr):
            wanted: tuple[str, ...] = ()
            if name.startswith("vllm:"):
                wanted = VARIABLES
            elif name.startswith(("specpilot_context_", "specpilot_alert_firing")):
                wanted = ("model_name",)
            for variable in wanted:
                assert f'{variable}=~"${variable}"' in matchers, (query, name)
            if name.startswith("vllm:") and window:
                assert window == "[$__rate_interval]", (query, name)
    exprs = "\n".join(q.expr for q in queries())
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert f"sum by (model_name, position) (rate({per_position}" in exprs
    itl = "vllm:inter_token_latency_seconds_bucket"
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate({itl}" in exprs
    flow = [p for p in board["panels"] if p["title"].startswith("Draft tokens / s: ")]
    assert [t["legendFormat"] for t in flow[0]["targets"]] == ["proposed", "accepted", "rejected"]
    # The queries allowed to be empty are queries of the dashboard (a renamed panel
    # must not leave its exception behind).
    assert set(EMPTY_WHEN) <= {q.where for q in queries()}


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
    context = {"model_name": "m", "workload_class": "code", "bucket": "1"}
    metrics.predicted_speedup.labels(**context).set(1.4)
    metrics.context_acceptance.labels(**context).set(0.8)
    metrics.decisions.labels(actor="policy").inc()
    metrics.loop_duration.observe(0.01)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with running_prometheus(
            [f"127.0.0.1:{port}", vllm_page], tmp_path, rule_files=[RULES]
        ) as prometheus:
            # Every vLLM metric the dashboard names is on vLLM 0.32's own page.
            page = VLLM_PAGE.read_text()
            for query in queries():
                for name in METRIC.findall(query.expr):
                    if name.startswith("vllm:"):
                        assert re.search(rf"^{re.escape(name)}[{{ ]", page, re.M), (query, name)
            # The recording rules the dashboard and the alerts use are evaluated on the
            # real series (vLLM's names and labels).
            for recorded in RECORDED:
                prometheus.wait_for(recorded, budget_s=30)
            now = time.time()
            values = resolve_variables(prometheus, now - 60, now)
            for query in queries():
                # a query Prometheus cannot run fails here
                prometheus.query_range(interpolate(query.expr, values), now - 60, now, STEP_S)
    finally:
        server.shutdown()
        thread.join(timeout=5)


# -- for real: vLLM, specpilot, Prometheus ------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What happened in the run, from the real services."""

    settings: Settings
    specpilot_alerts: list[Any]
    """``GET /v1/alerts``: every alert specpilot raised."""
    prometheus_alerts: list[Any]
    """Prometheus' pending and firing alerts (``/api/v1/alerts``)."""


EMPTY_WHEN: dict[str, tuple[str, Callable[[Run], bool]]] = {
    "Prometheus alerts (these rules), pending and firing/A": (
        "no rule of alerts.yaml is pending or firing",
        lambda run: not run.prometheus_alerts,
    ),
    "annotation Prometheus alerts": (
        "no rule of alerts.yaml fires",
        lambda run: not run.prometheus_alerts,
    ),
    "specpilot's alerts firing/A": (
        "specpilot raised no alert (the gauge is born when AcceptanceDrift or "
        "SpeculationLosing fires)",
        lambda run: not run.specpilot_alerts,
    ),
    "annotation specpilot alerts": (
        "specpilot raised no alert",
        lambda run: not run.specpilot_alerts,
    ),
    "Alert deliveries per hour, by sink and outcome/A": (
        "no Alertmanager and no webhook is configured",
        lambda run: (
            run.settings.alerting.alertmanager_url is None
            and run.settings.alerting.webhook_url is None
        ),
    ),
    "Failovers (gateway)/A": (
        "one pool: there is no other pool to fail over to",
        lambda run: len(run.settings.fleet.pools) < 2,
    ),
    "Failovers (gateway)/B": (
        "push mode: failovers per context are counted in routing mode",
        lambda run: run.settings.actuators.mode != "routing",
    ),
    "Explored share per context (routing mode)/A": (
        "push mode: only the routing mode's gateway explores",
        lambda run: run.settings.actuators.mode != "routing",
    ),
}
"""Queries that may return nothing, each with the fact of the run that makes it so; an
empty answer without that fact fails."""


def gateway_settings(data_dir: Path) -> Settings:
    """bench sidecar's managed pool (specpilot starts its vLLM), with specpilot's
    gateway in front of it: a managed push-mode fleet learning from both the requests
    it relays and vLLM's own counters."""
    base = sidecar_settings(data_dir).model_dump(mode="json", exclude_unset=True)
    added = {
        "gateway": {"enabled": True, "port": 0},
        "collect": ["gateway", "scrape"],
        # Whatever the policy comes to prefer, the pool keeps the vLLM it started: one
        # vLLM for the whole test (a move would start a second one beside it).
        "policy": {"min_dwell_s": 3600.0},
    }
    return Settings.model_validate(base | added)


def family(name: str) -> str:
    """A metric family's name from one of its series' names (as text or OpenMetrics
    exposition name it, ``_total`` on a counter or not)."""
    return re.sub(r"_(total|bucket|sum|count)$", "", name)


def bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def host_port(url: str) -> str:
    return str(urlsplit(url).netloc)


def series(registry: CollectorRegistry, name: str) -> bool:
    return any(s.name == name for family in registry.collect() for s in family.samples)


@pytest.mark.vllm
def test_every_panel_annotation_and_rule_answers_on_real_vllm_and_specpilot(
    testbed: object, tmp_path: Path
) -> None:
    settings = gateway_settings(tmp_path / "data")
    runtime = assemble(settings)
    try:
        asyncio.run(run_and_check(runtime, settings, tmp_path))
    finally:
        runtime.close()


async def run_and_check(runtime: Runtime, settings: Settings, tmp_path: Path) -> None:
    managed = runtime.placements.managed
    assert managed is not None
    api_socket = bound_socket()
    api = f"127.0.0.1:{api_socket.getsockname()[1]}"
    await runtime.start(api_socket, bound_socket(), log_level="warning")
    try:
        deadline = time.monotonic() + 900  # a vLLM start on a loaded 2-core machine
        while not managed.urls("code"):  # the first push starts the pool's vLLM
            assert time.monotonic() < deadline, "the managed pool's vLLM never started"
            await asyncio.sleep(1.0)
        vllm = host_port(str(managed.urls("code")[0]))
        gateway = f"http://127.0.0.1:{runtime.gateway_port}"
        registry = runtime.service.registry
        with running_prometheus(
            {"vllm": [vllm], "specpilot": [api]},
            tmp_path / "prometheus",
            scrape_interval_s=SCRAPE_S,
            rule_files=[RULES],
        ) as prometheus:
            start = time.time()
            for job in ("vllm", "specpilot"):  # the traffic must fall inside what it saw
                await asyncio.to_thread(prometheus.wait_for, f'up{{job="{job}"}} == 1', 60.0)
            # Greedy code through the gateway, at least once and until the policy has
            # evidence enough to estimate and predict for the arm in force (the managed
            # pool's start canary may have given it that already).
            deadline = time.monotonic() + 900
            while True:
                await run_streams(gateway, count=2, requests_each=6)
                if series(registry, "specpilot_context_predicted_speedup") and series(
                    registry, "specpilot_context_acceptance_ratio"
                ):
                    break
                assert time.monotonic() < deadline, "specpilot never estimated its arm"
            for seen in (
                "specpilot_context_predicted_speedup",
                "increase(vllm:spec_decode_num_draft_tokens_total[1h]) > 0",
                "specpilot_gateway_requests_total",
            ):
                await asyncio.to_thread(prometheus.wait_for, seen, 60.0)
            await asyncio.sleep(4 * SCRAPE_S)  # every rule evaluated on the last scrapes
            # Prometheus' HTTP API is asked from a thread: specpilot's API, on this event
            # loop, must go on answering Prometheus' scrapes meanwhile.
            async with httpx.AsyncClient(base_url=f"http://{api}") as client:
                alerts = (await client.get("/v1/alerts")).json()["alerts"]
            await asyncio.to_thread(check_everything, prometheus, settings, alerts, start)
    finally:
        await runtime.stop(grace_s=10.0)


def check_everything(
    prometheus: PrometheusServer, settings: Settings, specpilot_alerts: list[Any], start: float
) -> None:
    end = time.time()
    run = Run(settings, specpilot_alerts, prometheus.api("alerts")["alerts"])
    values = resolve_variables(prometheus, start, end)

    empty: list[str] = []
    for query in queries():
        result = prometheus.query_range(interpolate(query.expr, values), start, end, STEP_S)
        if result:
            continue
        reason = EMPTY_WHEN.get(query.where)
        if reason is None or not reason[1](run):
            empty.append(f"{query.where}: {query.expr}")
    assert not empty, "queries that returned no series:\n" + "\n".join(empty)

    # Every metric a query names is one the scraped targets describe: vLLM's from the
    # vLLM job, specpilot's from specpilot's, recorded ones from the rules.
    described: dict[str, set[str]] = {}
    for entry in prometheus.api("targets/metadata"):
        described.setdefault(entry["target"]["job"], set()).add(family(entry["metric"]))
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    named: set[str] = set()
    for query in queries():
        for name in METRIC.findall(query.expr):
            if name.startswith("specpilot:"):
                assert name in recorded, (query, name)
                continue
            job = "vllm" if name.startswith("vllm:") else "specpilot"
            assert family(name) in described[job], (query, name, job)
            named.add(family(name))
    # And every metric specpilot exports, and every spec-decode metric of vLLM, is on
    # some panel (creation timestamps are not figures to show).
    shown = described["specpilot"] | {
        m for m in described["vllm"] if m.startswith("vllm:spec_decode_")
    }
    shown = {m for m in shown if not m.endswith("_created")}
    assert shown <= named, sorted(shown - named)

    # Every rule's expression runs; the recorded series have data; Prometheus evaluated
    # every rule without an error.
    for rule in rules():
        answer = prometheus.query_range(rule["expr"], start, end, STEP_S)
        if "record" in rule:
            assert answer, rule["record"]
    groups = prometheus.api("rules")["groups"]
    evaluated = [r for group in groups for r in group["rules"]]
    assert len(evaluated) == len(rules())
    assert all(r["health"] == "ok" for r in evaluated), [
        (r["name"], r["health"], r.get("lastError")) for r in evaluated if r["health"] != "ok"
    ]
