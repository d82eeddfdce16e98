"""`specpilot demo` as a user runs it: a real process, real HTTP, real SQLite.

The fleet is the built-in simulator (the demo's whole point is that no GPU or vLLM is
needed); everything else — gateway, control loop, bandit, store, API — is the real code.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.controller.conftest import free_port


def run_demo(data_dir: Path, port: int, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "demo", "--data-dir", str(data_dir),
         "--port", str(port), "--seconds", str(seconds), "--speed", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def latest_state(data_dir: Path) -> dict[str, object]:
    with sqlite3.connect(data_dir / "specpilot.db") as db:
        (state,) = db.execute(
            "SELECT state FROM policy_snapshots ORDER BY id DESC LIMIT 1"
        ).fetchone()
    loaded: dict[str, object] = json.loads(state)
    return loaded


def test_demo_runs_the_loop_and_a_second_start_continues(tmp_path: Path) -> None:
    data_dir, port = tmp_path / "data", free_port()
    first = run_demo(data_dir, port, seconds=12)
    # While it runs, the API answers like `specpilot serve`'s.
    deadline = time.monotonic() + 60
    policy = None
    while time.monotonic() < deadline and first.poll() is None:
        try:
            policy = httpx.get(f"http://127.0.0.1:{port}/v1/policy", timeout=2).json()
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output
    assert policy is not None, output
    assert "requests through the gateway" in output
    assert "class      bucket  arm" in output
    selected_first = latest_state(data_dir)["selected"]
    assert isinstance(selected_first, int) and selected_first > 50

    second = run_demo(data_dir, free_port(), seconds=3)
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 0, output
    selected_second = latest_state(data_dir)["selected"]
    # The second, shorter run started from the first run's learned state.
    assert isinstance(selected_second, int) and selected_second > selected_first
