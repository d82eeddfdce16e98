"""A real Prometheus for tests: started on a free loopback port, scraping given targets.

Uses the Debian package's ``prometheus`` binary. Without it the tests that need it are
skipped, unless ``SPECPILOT_REQUIRE_PROMETHEUS=1`` (set by ``scripts/test-all``), in
which case they fail. Reuse from any test module::

    from tests.helpers.prometheus import prometheus_factory  # noqa: F401  (the fixture)

    def test_something(prometheus_factory):
        prometheus = prometheus_factory(["127.0.0.1:8000"])
        prometheus.wait_for('count_over_time(up[1h]) >= 3')
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.server import free_port


def prometheus_binary() -> str:
    """Path of ``prometheus``; skips the test when missing, or fails it when required."""
    found = shutil.which("prometheus")
    if found is None:
        message = "the prometheus binary is not installed (Debian package 'prometheus')"
        if os.environ.get("SPECPILOT_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{message}, and SPECPILOT_REQUIRE_PROMETHEUS=1")
        pytest.skip(message)
    return found


def promtool() -> str:
    """Path of ``promtool`` (the same package): skipped or failed as ``prometheus_binary``."""
    prometheus_binary()
    found = shutil.which("promtool")
    assert found is not None, "promtool ships with the prometheus package"
    return found


@dataclass(frozen=True)
class PrometheusServer:
    url: str
    """Base URL, e.g. ``http://127.0.0.1:41234``."""
    data_dir: Path
    process: subprocess.Popen[bytes]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, object]]:
        """Instant query; the ``result`` list of the API answer."""
        params = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
        result: list[dict[str, object]] = self.api("query", **params)["result"]
        return result

    def api(self, path: str, **params: str | float) -> Any:
        """The ``data`` of a successful answer of ``/api/v1/<path>``; an error fails,
        with what Prometheus said."""
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query_range(
        self, promql: str, start: float, end: float, step_s: float
    ) -> list[dict[str, object]]:
        """Range query, as a Grafana panel asks it; the ``result`` list."""
        data = self.api("query_range", query=promql, start=start, end=end, step=step_s)
        result: list[dict[str, object]] = data["result"]
        return result

    def wait_for(self, promql: str, budget_s: float = 60.0) -> None:
        """Wait until ``promql`` returns a non-empty result (e.g. enough samples)."""
        deadline = time.monotonic() + budget_s
        while not self.query(promql):
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus never answered {promql!r}")
            time.sleep(0.2)


@contextmanager
def running_prometheus(
    targets: Sequence[str] | Mapping[str, Sequence[str]],
    work_dir: Path,
    *,
    metrics_path: str = "/metrics",
    scrape_interval_s: float = 1.0,
    job: str = "vllm",
    rule_files: Sequence[Path] = (),
) -> Iterator[PrometheusServer]:
    """Start Prometheus scraping ``targets`` (``host:port``; as job ``job``, or a mapping
    job name → its targets), evaluating ``rule_files``, and stop it afterwards."""
    binary = prometheus_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    interval = f"{round(scrape_interval_s * 1000)}ms"
    jobs = dict(targets) if isinstance(targets, Mapping) else {job: targets}
    config = work_dir / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  scrape_timeout: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        + (f"rule_files: {json.dumps([str(f) for f in rule_files])}\n" if rule_files else "")
        + "scrape_configs:\n"
        + "".join(
            f"  - job_name: {name}\n"
            f"    metrics_path: {metrics_path}\n"
            f"    static_configs:\n      - targets: {json.dumps(list(hosts))}\n"
            for name, hosts in jobs.items()
        )
    )
    port = free_port()
    data_dir = work_dir / "data"
    log = (work_dir / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=work_dir,
    )
    server = PrometheusServer(f"http://127.0.0.1:{port}", data_dir, process)
    try:
        _wait_ready(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def prometheus_factory(
    tmp_path: Path,
) -> Iterator[Callable[[Sequence[str]], PrometheusServer]]:
    """Start real Prometheus servers scraping the given ``host:port`` targets every
    0.5 s; all are stopped at the end of the test."""
    with ExitStack() as stack:
        count = 0

        def start(targets: Sequence[str]) -> PrometheusServer:
            nonlocal count
            count += 1
            work_dir = tmp_path / f"prometheus-{count}"
            return stack.enter_context(running_prometheus(targets, work_dir, scrape_interval_s=0.5))

        yield start


def _wait_ready(server: PrometheusServer, budget_s: float = 60.0) -> None:
    deadline = time.monotonic() + budget_s
    while True:
        if server.process.poll() is not None:
            log = (server.data_dir.parent / "prometheus.log").read_text(errors="replace")
            raise RuntimeError(f"prometheus exited at start: {log[-500:]}")
        try:
            if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("prometheus did not become ready")
        time.sleep(0.1)
