"""A real Alertmanager for tests: the Debian package's ``prometheus-alertmanager``, started
on a free loopback port with a temporary config and storage path, clustering off.

Without the binary the tests that need it are skipped, unless
``SPECPILOT_REQUIRE_ALERTMANAGER=1`` (set by ``scripts/test-all``), in which case they fail.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.server import free_port
from tests.conftest import required

BINARIES = ("prometheus-alertmanager", "alertmanager")


def alertmanager_binary() -> str:
    """Path of Alertmanager; skips the test when missing, or fails it when required."""
    for name in BINARIES:
        found = shutil.which(name)
        if found is not None:
            return found
    message = "Alertmanager is not installed (Debian package 'prometheus-alertmanager')"
    if required("ALERTMANAGER"):
        pytest.fail(f"{message}, and SPECPILOT_REQUIRE_ALERTMANAGER=1")
    pytest.skip(message)


@dataclass(frozen=True)
class AlertmanagerServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts``: the alerts it holds that have not ended."""
        response = httpx.get(f"{self.url}/api/v2/alerts", params=filters, timeout=10)
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()
        return found

    def groups(self) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts/groups``: the alerts as its route grouped them."""
        response = httpx.get(f"{self.url}/api/v2/alerts/groups", timeout=10)
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()
        return found


@contextmanager
def running_alertmanager(work_dir: Path, config: str) -> Iterator[AlertmanagerServer]:
    """Start Alertmanager with ``config`` (YAML text), stop it afterwards."""
    binary = alertmanager_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    config_file = work_dir / "alertmanager.yml"
    config_file.write_text(config)
    port = free_port()
    log_path = work_dir / "alertmanager.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.path={work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no gossip port: one instance, loopback only
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=work_dir,
    )
    server = AlertmanagerServer(f"http://127.0.0.1:{port}", process, log_path)
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


def _wait_ready(server: AlertmanagerServer, budget_s: float = 60.0) -> None:
    deadline = time.monotonic() + budget_s
    while True:
        if server.process.poll() is not None:
            log = server.log_path.read_text(errors="replace")
            raise RuntimeError(f"alertmanager exited at start: {log[-800:]}")
        try:
            if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("alertmanager did not become ready")
        time.sleep(0.1)
