"""`specpilot demo` as a user runs it: a real process, real HTTP, real SQLite.

The fleet is the built-in simulator (the demo's whole point is that no GPU or vLLM is
needed); everything else — gateway, control loop, bandit, store, API — is the real code.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from controller.contexts import Context, bucket_labels
from controller.demo import DEMO_SCENARIO, render
from controller.settings import TOKEN_ENV
from policies.arms import Arm
from policies.bandit import SpecPilotPolicy
from simulator.scenario import load_scenario
from tests.controller.conftest import free_port


def run_demo(
    data_dir: Path, port: int, seconds: float, token: str | None = None
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token is not None:
        env[TOKEN_ENV] = token
    return subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "demo", "--data-dir", str(data_dir),
         "--port", str(port), "--seconds", str(seconds), "--speed", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def table_buckets(output: str) -> list[list[str]]:
    """The bucket column of each printed table's rows of one class, in the order
    printed: one list per table and class."""
    tables: list[dict[str, list[str]]] = []
    in_table = False
    for line in output.splitlines():
        if line.startswith("class      bucket  arm"):
            tables.append({})
            in_table = True
        elif in_table and line.strip():
            cls, bucket = line.split()[:2]
            tables[-1].setdefault(cls, []).append(bucket)
        else:
            in_table = False  # a table ends at its blank line
    return [buckets for table in tables for buckets in table.values()]


def selected(data_dir: Path) -> object:
    """How many requests the policy had routed when it last saved its state."""
    exploration = latest_state(data_dir)["exploration"]
    assert isinstance(exploration, dict)
    return exploration["selected"]


def latest_state(data_dir: Path) -> dict[str, object]:
    with sqlite3.connect(data_dir / "specpilot.db") as db:
        (state,) = db.execute(
            "SELECT state FROM policy_snapshots ORDER BY id DESC LIMIT 1"
        ).fetchone()
    loaded: dict[str, object] = json.loads(state)
    return loaded


def test_demo_runs_the_loop_and_a_second_start_continues(tmp_path: Path) -> None:
    data_dir, port = tmp_path / "data", free_port()
    first = run_demo(data_dir, port, seconds=12, token="demo-secret")
    # While it runs, the API answers like `specpilot serve`'s, and the token the
    # environment sets allows writes (a no-op one here), as the demo says it does.
    deadline = time.monotonic() + 60
    policy = None
    while time.monotonic() < deadline and first.poll() is None:
        try:
            policy = httpx.get(f"http://127.0.0.1:{port}/v1/policy", timeout=2).json()
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    unfreeze = f"http://127.0.0.1:{port}/v1/policy/unfreeze"
    refused = httpx.post(unfreeze, timeout=5)
    allowed = httpx.post(unfreeze, headers={"Authorization": "Bearer demo-secret"}, timeout=5)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output
    assert policy is not None, output
    assert (refused.status_code, allowed.status_code) == (401, 200), allowed.text
    assert TOKEN_ENV not in output  # no "set it to allow writes" with it set
    assert "requests through the gateway" in output
    # Buckets listed by concurrency, as the settings define them. At two streams a
    # class reaches both buckets only where one of its requests found the other stream
    # idle: some class does so in twelve seconds, not always the same one.
    order = bucket_labels([1, 2, 4, 8, 16, 32])
    tables = table_buckets(output)
    assert tables and any(len(t) > 1 for t in tables), output
    for buckets in tables:
        assert buckets == sorted(buckets, key=order.index), output
    selected_first = selected(data_dir)
    # Twelve seconds at 2 streams of answers a few hundred tokens long: a few dozen.
    assert isinstance(selected_first, int) and selected_first > 20

    second = run_demo(data_dir, free_port(), seconds=3)
    output, _ = second.communicate(timeout=120)
    assert second.returncode == 0, output
    assert f"set {TOKEN_ENV} to allow writes" in output
    selected_second = selected(data_dir)
    # The second, shorter run started from the first run's learned state.
    assert isinstance(selected_second, int) and selected_second > selected_first


def test_the_table_lists_buckets_by_concurrency() -> None:
    scenario = load_scenario(DEMO_SCENARIO)
    policy = SpecPilotPolicy([Arm("ngram", 2)], clock=lambda: 0.0, rng=np.random.default_rng(0))
    labels = bucket_labels([1, 2, 4, 8, 16, 32])
    contexts = {Context("m", cls, label) for cls in ("code", "chat") for label in labels}
    lines = render(policy, contexts, scenario, elapsed_s=1.0, speed=10.0).splitlines()[2:]
    shown = [(line.split()[0], line.split()[1]) for line in lines]
    assert shown == [(cls, label) for cls in ("chat", "code") for label in labels]
