"""``specpilot serve`` as a real process: restart after kill -9, SIGTERM, bad starts,
and two replicas sharing PostgreSQL.

The policy and collector are wired through ``settings.wiring`` to the fakes of
``fakes.py`` (the real ones live on other branches); everything else is the real
service: uvicorn, the loop, the store, the file actuator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controller.store.db import Store
from tests.controller.conftest import PgDatabase, free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "serve-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def write_config(tmp_path: Path, port: int, store_url: str | None = None) -> Path:
    config: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "scrape_interval_s": 0.2 if store_url is None else 5,
        "classes": ["code", "chat"],
        "buckets": [1, 4],
        "api": {"host": "127.0.0.1", "port": port},
        "policy": {"min_dwell_s": 0},
        "leader": {"check_interval_s": 0.2},
        "wiring": {
            "policy": "tests.controller.fakes:make_policy",
            "collector": "tests.controller.fakes:make_source",
        },
        "fleet": {
            "pools": {
                "p": {
                    "model": "m",
                    "instances": ["http://127.0.0.1:9"],
                    "proposers": {"ngram": {"method": "ngram", "gamma": [1, 4]}},
                }
            }
        },
    }
    if store_url:
        config["store"] = {"url": store_url}
    path = tmp_path / f"specpilot-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Serve:
    """``specpilot serve --config FILE`` in its own process."""

    def __init__(
        self,
        config: Path,
        port: int,
        environ: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
    ) -> None:
        """``environ``: added to the process's environment (``SPECPILOT_*`` overrides);
        ``args``: more of ``serve``'s options (``--log-format json``)."""
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), SPECPILOT_API_TOKEN=TOKEN, **(environ or {}))
        self.log = config.with_suffix(f".{time.monotonic_ns()}.log")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "serve", "--config", str(config), *args],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.client = httpx.Client(base_url=self.url, timeout=5)

    def until(self, probe: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"serve exited:\n{self.log.read_text()}"
            try:
                if value := probe():
                    return value
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"condition not reached:\n{self.log.read_text()}"
            time.sleep(0.1)

    def readyz(self) -> dict[str, Any]:
        response = self.client.get("/readyz")
        return dict(response.json()) if response.status_code == 200 else {}

    def get(self, path: str, **params: Any) -> Any:
        response = self.client.get(path, params=params)
        response.raise_for_status()
        return response.json()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout=30)
        self.client.close()
        return code


@pytest.fixture
def started() -> Iterator[list[Serve]]:
    processes: list[Serve] = []
    yield processes
    for process in processes:
        process.kill()


def decisions(serve: Serve) -> list[dict[str, Any]]:
    return list(serve.get("/v1/decisions", limit=100)["decisions"])


def test_restart_after_kill_keeps_overrides_decisions_and_learning(
    tmp_path: Path, started: list[Serve]
) -> None:
    port = free_port()
    config = write_config(tmp_path, port)
    first = Serve(config, port)
    started.append(first)
    first.until(first.readyz)
    override = {
        "scope": {"model": "*", "class": "chat", "bucket": "*"},
        "config": {"method": "ngram", "num_speculative_tokens": 2},
        "ttl_s": 600,
        "reason": "incident 42",
    }
    created = first.client.post("/v1/overrides", json=override, headers=AUTH)
    assert created.status_code == 201
    # The fake policy learns that ngram:3 is faster for code; the override pins chat.
    first.until(
        lambda: (
            {(d["class"], d["actor"]) for d in decisions(first)}
            >= {("code", "policy"), ("chat", "operator")}
        )
    )
    before = decisions(first)
    learned = first.until(
        lambda: [
            c["estimate"]["observations"]
            for c in first.get("/v1/policy")["contexts"]
            if c["class"] == "code" and c["bucket"] == "1-3" and c["estimate"]
        ]
    )[0]
    assert first.kill() == -signal.SIGKILL

    second = Serve(config, port)
    started.append(second)
    policy = second.until(lambda: second.readyz() and second.get("/v1/policy"))
    code_low = next(c for c in policy["contexts"] if (c["class"], c["bucket"]) == ("code", "1-3"))
    assert code_low["decided_arm"] == "ngram:3"
    assert code_low["estimate"]["observations"] >= learned  # learning came back
    assert [o["id"] for o in second.get("/v1/overrides")["overrides"]] == [created.json()["id"]]
    after = decisions(second)
    assert [d["id"] for d in after[-len(before) :]] == [d["id"] for d in before]
    assert not [d for d in after if d["id"] > before[0]["id"] and d["actor"] == "operator"]
    chat = [c for c in policy["contexts"] if c["class"] == "chat"]
    assert all(c["decided_arm"] == "ngram:2" and c["override_id"] for c in chat)
    pushed = json.loads((tmp_path / "data" / "speculative-configs" / "p.json").read_text())
    assert pushed["method"] == "ngram"


def test_sigterm_shuts_down_cleanly_and_saves_state(tmp_path: Path, started: list[Serve]) -> None:
    port = free_port()
    serve = Serve(write_config(tmp_path, port), port)
    started.append(serve)
    serve.until(serve.readyz)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit says why.
    assert serve.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
    log = serve.log.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log
    store = Store.open(f"sqlite:///{tmp_path / 'data' / 'specpilot.db'}")
    try:
        snapshot = store.latest_snapshot()
        assert snapshot is not None and snapshot[1]["tpot"]  # what it learned was saved
        assert store.count_observations() > 0
    finally:
        store.close()


def test_unreachable_store_at_start_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    url = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/x"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "serve",
            "--config",
            str(write_config(tmp_path, port, url)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot reach the store at postgresql+psycopg://nobody@")


def test_bad_config_is_refused_before_starting(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("fleet: {pools: {p: {model: m, instances: []}}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "controller.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 2
    assert "error: fleet.pools.p.instances:" in result.stderr


def test_two_replicas_one_leader_and_takeover(
    tmp_path: Path, pg: PgDatabase, started: list[Serve]
) -> None:
    ports = free_port(), free_port()
    first = Serve(write_config(tmp_path, ports[0], pg.url), ports[0])
    started.append(first)
    assert first.until(first.readyz)["checks"]["role"] == "leader"
    second = Serve(write_config(tmp_path, ports[1], pg.url), ports[1])
    started.append(second)
    assert second.until(second.readyz)["checks"]["role"] == "follower"
    # The follower serves reads from the shared store.
    first.until(lambda: decisions(first))
    assert second.until(lambda: decisions(second))
    first.kill()
    took = time.monotonic()
    second.until(lambda: second.readyz()["checks"]["role"] == "leader", timeout_s=10)
    assert time.monotonic() - took < 10
