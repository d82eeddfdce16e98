"""``specpilot serve`` in routing mode and with the managed actuator, as real processes
against simulated vLLM pools (``simulator.server``): a request through the gateway port
reaches a pool, becomes an observation the API shows, and a restart keeps what was
learned; a managed pool is started, moved to a new config and stopped by serve itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from simulator.instance import SpecConfig
from simulator.scenario import load_scenario
from simulator.server import FleetThread, PoolSpec
from testbed.server import free_port
from tests.actuators.sim_launcher import SCENARIO, SPEED
from tests.controller.conftest import PgDatabase
from tests.controller.test_serve import AUTH, ROOT, Serve

MODEL = load_scenario(SCENARIO).model.name


@pytest.fixture(scope="module")
def sim_pools() -> Iterator[FleetThread]:
    """Two simulated pools: ``off`` and ``ngram`` (γ 4), one instance each."""
    pools = [PoolSpec("off", SpecConfig(None)), PoolSpec("ngram", SpecConfig("ngram", 4))]
    with FleetThread(load_scenario(SCENARIO), pools, speed=SPEED) as fleet:
        yield fleet


def base_config(tmp_path: Path, api_port: int, gateway_port: int) -> dict[str, Any]:
    return {
        "data_dir": str(tmp_path / "data"),
        "scrape_interval_s": 0.2,
        "classes": ["code", "chat"],
        "buckets": [1, 4],
        "api": {"host": "127.0.0.1", "port": api_port},
        "gateway": {"host": "127.0.0.1", "port": gateway_port},
        "policy": {"min_dwell_s": 0, "measure_after_s": 0},
        "leader": {"check_interval_s": 0.2},
    }


def routing_fleet(sim_pools: FleetThread) -> dict[str, Any]:
    """The two simulated pools as a routing fleet: off, and n-gram γ=4."""
    return {
        "pools": {
            "off": {"model": MODEL, "instances": sim_pools.urls("off")},
            "ngram": {
                "model": MODEL,
                "instances": sim_pools.urls("ngram"),
                "proposers": {"ngram": {"method": "ngram", "gamma": [4, 4]}},
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
            },
        }
    }


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "specpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def complete(gateway: str, workload_class: str = "code") -> dict[str, Any]:
    response = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 8},
        headers={"X-Workload-Class": workload_class},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def stats(serve: Serve) -> dict[str, int]:
    """Stored observations per arm for (code, bucket 1)."""
    rows = serve.get("/v1/stats", window_s=3600)["rows"]
    return {r["arm"]: r["requests"] for r in rows if (r["class"], r["bucket"]) == ("code", "1-3")}


def served(fleet: FleetThread, pool: str) -> float:
    """Requests the pool's simulated vLLM instances finished (their own counter)."""
    total = 0.0
    for url in fleet.urls(pool):
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def selected(data_dir: Path) -> int:
    """How many requests the policy had routed when it last saved its state."""
    with sqlite3.connect(data_dir / "specpilot.db") as db:
        (state,) = db.execute(
            "SELECT state FROM policy_snapshots ORDER BY id DESC LIMIT 1"
        ).fetchone()
    count = json.loads(state)["exploration"]["selected"]
    assert isinstance(count, int)
    return count


def test_routing_mode_serves_the_gateway_and_keeps_learning_across_restarts(
    tmp_path: Path, sim_pools: FleetThread
) -> None:
    api_port, gateway_port = free_port(), free_port()
    config = base_config(tmp_path, api_port, gateway_port)
    config["actuators"] = {"mode": "routing"}
    # Learned state is saved at the first iteration, then only on shutdown: what the
    # second process continues from is what SIGTERM saved.
    config["store"] = {"snapshot_interval_s": 3600}
    config["fleet"] = routing_fleet(sim_pools)
    path = write(tmp_path, config)
    gateway = f"http://127.0.0.1:{gateway_port}"

    first = Serve(path, api_port)
    try:
        first.until(first.readyz)
        for _ in range(20):
            complete(gateway)
        # Every request reached a pool and came back to the loop as an observation.
        by_arm = first.until(lambda: (s := stats(first)) and sum(s.values()) >= 20 and s)
        assert set(by_arm) <= {"off", "ngram:4"}
        assert sum(by_arm.values()) == 20
        contexts = first.get("/v1/policy")["contexts"]
        assert {(c["class"], c["bucket"]) for c in contexts} >= {("code", "1-3"), ("chat", "4+")}
        assert first.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
    finally:
        first.kill()
    assert "Traceback" not in first.log.read_text()
    learned = selected(tmp_path / "data")
    assert learned >= 20

    second = Serve(path, api_port)
    try:
        second.until(second.readyz)
        assert sum(stats(second).values()) == 20  # what the first one stored
        complete(gateway, "chat")
        assert second.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
    finally:
        second.kill()
    # The second process continued from the first one's learned state.
    assert selected(tmp_path / "data") == learned + 1


def test_managed_pool_is_started_moved_and_stopped_by_serve(tmp_path: Path) -> None:
    api_port, gateway_port = free_port(), free_port()
    config = base_config(tmp_path, api_port, gateway_port)
    config["classes"] = ["code"]
    config["gateway"]["enabled"] = True
    config["actuators"] = {
        "managed": {
            "switch_grace_s": 0,
            "drain_poll_s": 0.05,
            "canary": {"requests": 1, "max_slowdown": None},
            "pools": {"code": {"launcher": "tests.actuators.sim_launcher:make"}},
        }
    }
    config["fleet"] = {
        "pools": {
            "code": {
                "model": MODEL,
                "proposers": {"ngram": {"method": "ngram", "gamma": [2, 4]}},
            }
        }
    }
    path = write(tmp_path, config)
    gateway = f"http://127.0.0.1:{gateway_port}"

    journal = tmp_path / "data" / "sim-launches.jsonl"

    def events() -> list[dict[str, Any]]:
        lines = journal.read_text().splitlines() if journal.exists() else []
        return [json.loads(line) for line in lines]

    def serving() -> dict[str, Any]:
        # The newest instance the launcher started, asked directly: the gateway passes
        # only the paths specpilot serves, not the simulator's own.
        launches = [e for e in events() if e["event"] == "launch"]
        if not launches:
            return {}
        response = httpx.get(f"{launches[-1]['url']}/sim/info", timeout=5)
        return dict(response.json()) if response.status_code == 200 else {}

    serve = Serve(path, api_port)
    try:
        serve.until(serve.readyz)
        started = serve.until(serving)
        assert started["config"] == "off"  # the config the settings say the pool runs
        complete(gateway)
        assert serve.until(lambda: stats(serve).get("off") == 1)
        pin = {
            "scope": {"model": "*", "class": "code", "bucket": "*"},
            "config": {"method": "ngram", "num_speculative_tokens": 4},
            "ttl_s": 600,
            "reason": "test",
        }
        assert serve.client.post("/v1/overrides", json=pin, headers=AUTH).status_code == 201
        # The new instance answers from its launch on, while its canary runs; the switch
        # is done once the old one is stopped: the gateway routes to the new one by then.
        serve.until(lambda: any((e["event"], e["config"]) == ("stop", "off") for e in events()))
        moved = serving()
        assert moved["config"] == "ngram:4"
        # Blue/green: a new instance took over.
        assert moved["process_start_time_seconds"] != started["process_start_time_seconds"]
        complete(gateway)
        assert serve.until(lambda: stats(serve).get("ngram:4") == 1)
        pushed = json.loads((tmp_path / "data" / "speculative-configs" / "code.json").read_text())
        assert pushed["num_speculative_tokens"] == 4  # the file actuator runs beside it
        assert serve.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
    finally:
        serve.kill()
    log = serve.log.read_text()
    assert "Traceback" not in log, log
    # The old instance was stopped after the switch, the new one when serve stopped.
    assert [(e["event"], e["config"]) for e in events()] == [
        ("launch", "off"),
        ("launch", "ngram:4"),
        ("stop", "off"),
        ("stop", "ngram:4"),
    ]


def test_gateway_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    api_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = base_config(tmp_path, api_port, taken.getsockname()[1])
        config["actuators"] = {"mode": "routing"}
        config["fleet"] = {
            "pools": {"plain": {"model": MODEL, "instances": ["http://127.0.0.1:9"]}}
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "controller.cli",
                "serve",
                "--config",
                str(write(tmp_path, config)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    assert result.returncode == 1
    port = config["gateway"]["port"]
    assert result.stderr.startswith(f"error: gateway: cannot listen on 127.0.0.1:{port}:")


def test_the_gateway_serves_the_last_routing_while_the_store_is_unreachable(
    tmp_path: Path, sim_pools: FleetThread
) -> None:
    api_port, gateway_port = free_port(), free_port()
    config = base_config(tmp_path, api_port, gateway_port)
    config["actuators"] = {"mode": "routing"}
    config["gateway"]["workers"] = 2
    config["fleet"] = routing_fleet(sim_pools)
    gateway = f"http://127.0.0.1:{gateway_port}"
    # A first run routes code to n-gram (an operator's pin) and publishes that.
    first = Serve(write(tmp_path, config), api_port)
    try:
        first.until(first.readyz)
        pin = {"scope": {"class": "code"}, "config": {"method": "ngram",
               "num_speculative_tokens": 4}, "ttl_s": 3600, "reason": "test"}  # fmt: skip
        assert first.client.post("/v1/overrides", json=pin, headers=AUTH).status_code == 201
        first.until(lambda: complete(gateway) and stats(first).get("ngram:4"))
        assert first.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
    finally:
        first.kill()

    # The database is down at the next start: the gateway serves by what it knew.
    config["store"] = {"url": f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/x"}
    second = Serve(write(tmp_path, config), api_port)
    try:
        second.until(lambda: "tried again" in second.log.read_text())
        before = served(sim_pools, "ngram")
        for _ in range(5):
            complete(gateway)
        assert served(sim_pools, "ngram") == before + 5
        # Alive (a liveness probe must not restart it), not ready, and why.
        assert second.client.get("/healthz").json() == {"status": "ok", "checks": {}}
        readyz = second.client.get("/readyz")
        assert readyz.status_code == 503, readyz.text
        assert readyz.json()["status"] == "not ready"
        assert readyz.json()["checks"]["store"].startswith("unreachable: cannot reach the store")
        decisions = second.client.get("/v1/decisions", headers=AUTH)
        assert decisions.status_code == 503 and "unreachable" in decisions.json()["detail"]
        assert second.kill(signal.SIGTERM) == 0
    finally:
        second.kill()
    assert "Traceback" not in second.log.read_text()


def test_the_api_takes_over_once_the_store_down_at_start_answers(
    tmp_path: Path, sim_pools: FleetThread, pg: PgDatabase
) -> None:
    api_port, gateway_port = free_port(), free_port()
    config = base_config(tmp_path, api_port, gateway_port)
    config["actuators"] = {"mode": "routing"}
    config["gateway"]["workers"] = 1
    config["fleet"] = routing_fleet(sim_pools)
    config["store"] = {"url": pg.url}
    pg.refuse_logins()  # PostgreSQL is there, this service's role may not log in: down
    serve = Serve(write(tmp_path, config), api_port)
    try:
        readyz = serve.until(lambda: serve.client.get("/readyz"), timeout_s=120)
        assert readyz.status_code == 503 and "unreachable" in readyz.json()["checks"]["store"]
        assert serve.client.get("/healthz").status_code == 200
        assert complete(f"http://127.0.0.1:{gateway_port}")["choices"]
        pg.allow_logins()
        # The waiting API hands its socket over to the real one, ready once the loop ran.
        ready = serve.until(serve.readyz, timeout_s=120)
        assert ready["checks"]["store"] == "ok"
        assert serve.client.get("/healthz").status_code == 200
        assert serve.client.get("/v1/decisions", headers=AUTH).status_code == 200
        assert serve.kill(signal.SIGTERM) == 0
    finally:
        serve.kill()
    assert "Traceback" not in serve.log.read_text()
