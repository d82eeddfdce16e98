"""The per-pod topology on real parts: two ``specpilot serve`` processes, each supervising
one real vLLM of the testbed on its own fixed port (its "pod"), sharing the real
PostgreSQL. Decisions come from an operator's override (the policy holds otherwise), so
each rollout has a known start.

What is asserted comes from outside specpilot where it can: each vLLM's process (its
pid, start time and ``--speculative-config``, read from ``/proc``), its ``/health``, each
replica's ``/readyz``, and the lease log in PostgreSQL. Never more than two vLLM servers
run: each replica restarts its one in place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controller.exactness import config_text
from controller.store.db import Store
from controller.store.records import LeaseRecord
from testbed.server import SERVED_MODEL, free_port
from tests.conftest import VllmServers
from tests.controller.conftest import PgDatabase, private_pg
from tests.controller.test_serve import AUTH, Serve

pytestmark = pytest.mark.vllm

POOL = "code"
TUNING = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
NGRAM_3 = {"method": "ngram", "num_speculative_tokens": 3, **TUNING}
# vLLM 0.32 on CPU starts healthy with this, then its engine dies at the first request.
SYNTHETIC = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.8] * 4}
REFUSED = {"method": "ngram", "num_speculative_tokens": 4, **TUNING, **SYNTHETIC}
MARKER = "SPECPILOT_TEST_POD"
"""In each replica's environment, so inherited by its vLLM: finds what a SIGKILL orphans."""
START_S = 900.0
"""A vLLM start on a loaded 2-core machine (50-120 s alone)."""


def settings_file(tmp_path: Path, store_url: str) -> Path:
    """One file for both pods, as one ConfigMap; each pod's own keys come from its
    environment (``Pod``)."""
    data = {
        "store": {"url": store_url},
        "classes": ["code"],
        "buckets": [1],
        "scrape_interval_s": 1.0,
        "collect": "scrape",
        "leader": {"check_interval_s": 0.5},
        "policy": {"min_dwell_s": 0.0},
        "wiring": {"policy": "controller.builtin:hold_policy"},
        "actuators": {
            "file": False,
            "managed": {
                "mode": "in_place",
                "start_timeout_s": START_S,
                "switch_grace_s": 1.0,
                "lease_ttl_s": 15.0,
                "pod": {},
                "pools": {POOL: {"launcher": "testbed.launcher:launcher"}},
            },
        },
        "fleet": {
            "pools": {
                POOL: {
                    "model": SERVED_MODEL,
                    "proposers": {
                        "ngram": {"method": "ngram", "gamma": [1, 3], "tuning": TUNING},
                        "synthetic": {
                            "method": "ngram",
                            "gamma": [4, 4],
                            "tuning": {**TUNING, **SYNTHETIC},
                        },
                    },
                }
            }
        },
    }
    path = tmp_path / "specpilot.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass(frozen=True)
class VllmProcess:
    pid: int
    started_at: float
    """Wall clock, from ``/proc`` (to 10 ms)."""
    config: dict[str, Any] | None


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise AssertionError("no btime in /proc/stat")


def vllm_on(port: int) -> VllmProcess | None:
    """The vLLM API server listening on ``port``, from its command line."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" not in argv or "--port" not in argv:
            continue
        if argv[argv.index("--port") + 1] != str(port):
            continue
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        config = None
        if "--speculative-config" in argv:
            config = json.loads(argv[argv.index("--speculative-config") + 1])
        return VllmProcess(int(proc.name), _boot_time() + ticks / os.sysconf("SC_CLK_TCK"), config)
    return None


def processes_marked(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if f"{MARKER}={marker}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
    return found


class Pod:
    """One pod: a ``serve`` replica and the vLLM it launches on ``vllm_port``."""

    def __init__(self, name: str, config: Path, data_dir: Path) -> None:
        self.name = name
        self.api_port, self.vllm_port = free_port(), free_port()
        self.marker = f"{uuid.uuid4().hex[:8]}-{name}"
        self.serve = Serve(
            config,
            self.api_port,
            {
                "SPECPILOT_ACTUATORS__MANAGED__POD__REPLICA": name,
                "SPECPILOT_ACTUATORS__MANAGED__POOLS__CODE__PORT": str(self.vllm_port),
                "SPECPILOT_API__PORT": str(self.api_port),
                "SPECPILOT_DATA_DIR": str(data_dir / name),
                MARKER: self.marker,
            },
        )

    def ready(self) -> tuple[int, dict[str, str]]:
        response = self.serve.client.get("/readyz")
        return response.status_code, dict(response.json()["checks"])

    def vllm(self) -> VllmProcess | None:
        return vllm_on(self.vllm_port)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.vllm_port}/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL, grace_s: float = 0.0) -> None:
        """Signal the replica; past ``grace_s`` SIGKILL it and what it left running (a
        pod's containers die with it; here its vLLM would outlive it)."""
        process = self.serve.process
        if process.poll() is None:
            process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
        process.kill()
        process.wait(timeout=30)
        for pid in processes_marked(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        until(lambda: not processes_marked(self.marker), 60, "the killed pod's vLLM to go")

    def stop(self) -> None:
        self.kill(signal.SIGTERM, grace_s=60.0)  # serve stops its vLLM before it exits
        self.serve.client.close()


def until(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            if value := probe():
                return value
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)


@dataclass
class Samples:
    """Every half second: per pod, its vLLM's ``/health`` and its ``/readyz``."""

    pods: list[Pod]
    rows: list[tuple[float, dict[str, bool], dict[str, str]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Samples:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            health = {pod.name: pod.healthy() for pod in self.pods}
            ready = {}
            for pod in self.pods:
                try:
                    status, checks = pod.ready()
                    ready[pod.name] = "ok" if status == 200 else checks.get("vllm", "?")
                except httpx.HTTPError:
                    ready[pod.name] = "down"
            self.rows.append((time.time(), health, ready))


@pytest.fixture
def pg() -> Iterator[PgDatabase]:
    with private_pg() as database:
        yield database


@pytest.fixture
def pods(vllm_servers: VllmServers, pg: PgDatabase, tmp_path: Path) -> Iterator[list[Pod]]:
    vllm_servers.stop_all()  # other tests' servers: only these pods' two run meanwhile
    config = settings_file(tmp_path, pg.url)
    started = [Pod(name, config, tmp_path) for name in ("a", "b")]
    try:
        yield started
    finally:
        for pod in started:
            pod.stop()


def rollout_log(pods: list[Pod]) -> dict[str, list[str]]:
    """Per pod, what its replica logged about leases and restarts: why a lease log
    differs from the one expected."""
    logged = ("controller.actuators.rolling", "controller.actuators.managed")
    return {
        pod.name: [
            line
            for line in pod.serve.log.read_text(errors="replace").splitlines()
            if any(name in line for name in logged)
        ]
        for pod in pods
    }


def all_ready(pods: list[Pod]) -> bool:
    return all(pod.ready()[0] == 200 for pod in pods)


def leader(pods: list[Pod]) -> Pod:
    (leading,) = [pod for pod in pods if pod.ready()[1]["role"] == "leader"]
    return leading


def override(pod: Pod, config: dict[str, Any]) -> None:
    body = {
        "scope": {"model": "*", "class": "*", "bucket": "*"},
        "config": {k: config[k] for k in ("method", "num_speculative_tokens")},
        "ttl_s": 3600,
        "reason": "e2e rollout",
    }
    response = pod.serve.client.post("/v1/overrides", json=body, headers=AUTH)
    assert response.status_code == 201, response.text


def lease_log(url: str) -> list[LeaseRecord]:
    store = Store.open(url, migrate=False)
    try:
        return list(reversed(store.leases(POOL)))
    finally:
        store.close()


def lease_end(lease: LeaseRecord) -> float:
    return lease.released_at if lease.released_at is not None else lease.expires_at


def assert_no_overlap(leases: list[LeaseRecord]) -> None:
    for earlier, later in itertools.pairwise(leases):
        assert lease_end(earlier) <= later.acquired_at, (earlier, later)


def started_inside(process: VllmProcess, leases: list[LeaseRecord], replica: str) -> bool:
    return any(
        lease.replica == replica and lease.acquired_at <= process.started_at <= lease_end(lease)
        for lease in leases
    )


def test_the_leaders_decision_reaches_both_vllms_one_restart_at_a_time_and_a_refused_config_stops(
    pods: list[Pod], pg: PgDatabase
) -> None:
    until(lambda: all_ready(pods), START_S, "two ready pods")
    first = {pod.name: pod.vllm() for pod in pods}
    assert all(p is not None and p.config is None for p in first.values()), first
    assert lease_log(pg.url) == []  # first starts take no lease
    with Samples(pods) as samples:
        override(pods[0], NGRAM_3)
        until(
            lambda: (
                all_ready(pods)
                and all((p := pod.vllm()) is not None and p.config == NGRAM_3 for pod in pods)
            ),
            2 * START_S,
            "both vLLMs on n-gram γ=3",
        )
    leases = lease_log(pg.url)
    assert [(lease.outcome, lease.config) for lease in leases] == [
        ("done", config_text(NGRAM_3))
    ] * 2, (leases, rollout_log(pods))
    assert sorted(lease.replica for lease in leases) == ["a", "b"]
    assert_no_overlap(leases)
    moved = {pod.name: pod.vllm() for pod in pods}
    for name, process in moved.items():
        assert process is not None and process.pid != first[name].pid  # type: ignore[union-attr]
        assert started_inside(process, leases, name), (process, leases)
    assert all(any(health.values()) for _, health, _ in samples.rows), "both vLLMs down at once"
    for pod in pods:  # each was out of its Service while it restarted, and only then
        seen = {ready[pod.name] for _, _, ready in samples.rows}
        assert "restarting" in seen and seen <= {"ok", "draining", "restarting"}, seen
    assert all("ok" in ready.values() for _, _, ready in samples.rows)

    def pods_in_fleet() -> list[str]:
        [pool] = leader(pods).serve.get("/v1/fleet")["pools"]
        return sorted(instance["url"].rsplit("#", 1)[1] for instance in pool["instances"])

    until(lambda: pods_in_fleet() == ["a", "b"], 60, "both pods' windows in the leader's fleet")

    # A config vLLM refuses: the first replica to try it rolls back, the other never tries.
    before = lease_log(pg.url)
    override(pods[0], REFUSED)
    failed = until(
        lambda: [lease for lease in lease_log(pg.url)[len(before) :] if lease.outcome == "failed"],
        2 * START_S,
        "a failed restart",
    )
    [failure] = failed
    tried = next(pod for pod in pods if pod.name == failure.replica)
    other = next(pod for pod in pods if pod is not tried)
    until(lambda: tried.ready()[0] == 200, START_S, "the rolled-back pod ready")
    time.sleep(10.0)  # the other replica's turn would have come by now
    after = lease_log(pg.url)[len(before) :]
    assert [(lease.replica, lease.outcome) for lease in after] == [(tried.name, "failed")], (
        after,
        rollout_log(pods),
    )
    assert after[0].holds and after[0].config == config_text(REFUSED)
    assert (rolled_back := tried.vllm()) is not None and rolled_back.config == NGRAM_3
    assert other.vllm() == moved[other.name]  # the same process, never restarted
    assert other.ready()[0] == 200
    alerts = tried.serve.get("/v1/alerts", limit=100)["alerts"]
    assert any(a["name"] == "ActuatorFailed" and "canary" in a["message"] for a in alerts), alerts


def test_killing_the_leader_mid_rollout_leaves_the_rollout_to_the_other_replica(
    pods: list[Pod], pg: PgDatabase
) -> None:
    until(lambda: all_ready(pods), START_S, "two ready pods")
    old = leader(pods)
    survivor = next(pod for pod in pods if pod is not old)
    override(old, NGRAM_3)

    def old_restarting() -> bool:
        status, checks = old.ready()
        return status == 503 and checks.get("vllm") == "restarting"

    # The leader restarts first as a rule (it pushes in the iteration it decides); if the
    # other replica won the race, the leader's turn comes after it.
    until(old_restarting, 2 * START_S, "the leader restarting its vLLM")
    killed_at = time.time()
    old.kill()
    until(lambda: survivor.ready()[1]["role"] == "leader", 60, "a new leader")
    until(
        lambda: (
            survivor.ready()[0] == 200
            and (p := survivor.vllm()) is not None
            and p.config == NGRAM_3
        ),
        2 * START_S,
        "the survivor's vLLM on n-gram γ=3",
    )
    leases = lease_log(pg.url)
    assert_no_overlap(leases)
    [dead] = [lease for lease in leases if lease.replica == old.name]
    assert dead.config == config_text(NGRAM_3)
    [mine] = [lease for lease in leases if lease.replica == survivor.name]
    assert mine.outcome == "done" and mine.config == config_text(NGRAM_3)
    process = survivor.vllm()
    assert process is not None and started_inside(process, leases, survivor.name)
    if mine.acquired_at > killed_at:  # it took over the rollout: after the dead one's expiry
        assert dead.outcome == "expired" and dead.released_at == dead.expires_at
        assert dead.expires_at <= mine.acquired_at
        assert dead.expires_at > killed_at  # it was held, renewed, while the leader lived
