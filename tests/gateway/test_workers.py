"""The gateway in worker processes: the routing table they sample, the observations and
routed requests they send back on bounded queues, their summed metrics, and a worker
that dies being started again. Real processes (spawn) in front of replayed vLLM streams.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from collectors.observations import RequestObservation
from controller.contexts import Context
from controller.gateway.routing import RouteKey
from controller.gateway.table import Route, RoutingSnapshot, SampledRouting, SnapshotFile
from controller.gateway.workers import (
    GatewayWorkers,
    RoutedEvent,
    TablePublisher,
    WorkerMetrics,
    WorkerSpec,
    _Outbox,
    metrics_samples,
)
from controller.ports import Routed
from controller.wiring import QueuedObservations
from tests.gateway.conftest import LoopThread
from tests.gateway.test_gateway_fakes import start_replay

MODEL = "tiny-llama"


def test_a_route_is_sampled_at_its_shares_and_every_pick_is_reported() -> None:
    picks: list[tuple[str, str]] = []
    routing = SampledRouting(
        {"off": "plain", "ngram:4": "fast", "ngram:2": "short"},
        default_model=MODEL,
        rng=random.Random(5),
        on_routed=lambda model, cls, bucket, arm, reason: picks.append((arm, reason)),
    )
    assert routing.pool_for(None, "code", "1") == "plain"  # nothing published: off
    assert picks == [("off", "learning")]
    explore = (("ngram:2", 0.1, "explore"), ("off", 0.05, "probe"))
    routing.replace({RouteKey(MODEL, "code", "1"): Route("ngram:4", "best", explore)})
    picks.clear()
    pools = Counter(routing.pool_for(None, "code", "1") for _ in range(20_000))
    shares = {pool: count / 20_000 for pool, count in pools.items()}
    assert shares["short"] == pytest.approx(0.1, abs=0.01)
    assert shares["plain"] == pytest.approx(0.05, abs=0.01)
    assert Counter(picks)[("ngram:4", "best")] == pools["fast"]
    assert Counter(picks)[("ngram:2", "explore")] == pools["short"]
    # An arm no pool runs goes to the off pool.
    routing.replace({RouteKey(MODEL, "code", "1"): Route("eagle:3", "best")})
    assert routing.pool_for(MODEL, "code", "1") == "plain"


def test_the_table_file_is_replaced_whole_and_read_back(tmp_path: Path) -> None:
    file = SnapshotFile(tmp_path / "routing.json")
    assert file.read() is None and not file.changed()
    routes = {RouteKey(MODEL, "code", "1"): Route("ngram:4", "best", (("off", 0.08, "explore"),))}
    snapshot = RoutingSnapshot({"plain": ("off", ("http://127.0.0.1:1",))}, routes, 3)
    file.write(snapshot)
    assert file.changed() and not file.changed()
    assert file.read() == snapshot
    assert [p.name for p in tmp_path.iterdir()] == ["routing.json"]  # no temporary left
    (tmp_path / "routing.json").write_text('{"format": 99}')
    assert file.read() is None  # logged, ignored: the worker keeps what it had


def test_a_new_start_keeps_the_last_runs_routes_with_the_pools_the_settings_name(
    tmp_path: Path,
) -> None:
    file = SnapshotFile(tmp_path / "routing.json")
    pools = [("plain", "off", ("http://127.0.0.1:1",)), ("fast", "ngram:4", ("http://h:2",))]
    first = TablePublisher(file, pools, table=True)
    routes = {RouteKey(MODEL, "code", "1"): Route("ngram:4", "best")}
    first.publish(routes)
    version = first.set_pool("fast", ["http://h:3"], "ngram:4")
    second = TablePublisher(file, pools, table=True)
    read = file.read()
    assert read is not None and read.routes == routes and read.version > version
    assert read.pools["fast"] == ("ngram:4", ("http://h:2",))  # the settings', not the old run's
    assert second.routes == routes


def test_a_full_queue_drops_the_batch_and_counts_it() -> None:
    channel: queue.Queue[Any] = queue.Queue(maxsize=1)
    registry = CollectorRegistry()
    outbox = _Outbox(0, channel, registry)
    outbox.routed(MODEL, "code", "1", "off", "learning")
    outbox.flush((1, 0))
    for _ in range(3):
        outbox.routed(MODEL, "code", "1", "off", "learning")
    outbox.flush((2, 0))  # the parent has not read the first batch
    assert channel.qsize() == 1 and outbox.events == []
    assert registry.get_sample_value("specpilot_gateway_observations_dropped_total") == 3


def test_what_the_parent_drops_counts_in_the_same_total_as_the_workers_drops() -> None:
    """The parent's own queue to the loop is bounded too: what it drops when the loop
    stalls is counted with what the workers dropped, one total."""
    parent = QueuedObservations(limit=2)
    summed = WorkerMetrics(dropped=lambda: parent.dropped)
    registry = CollectorRegistry()
    registry.register(summed)
    total = "specpilot_gateway_observations_dropped_total"
    assert registry.get_sample_value(total) == 0  # reported before any worker did
    for _ in range(5):  # the loop took none of them
        parent.put_routed(Routed(Context(MODEL, "code", "1"), "off", "learning", 0.0))
    assert registry.get_sample_value(total) == 3
    worker = CollectorRegistry()
    outbox = _Outbox(0, queue.Queue(maxsize=1), worker)
    outbox.dropped.inc(4)
    summed.update(0, metrics_samples(worker))
    assert registry.get_sample_value(total) == 7


def routing_spec(urls: dict[str, str], table: Path, **extra: Any) -> WorkerSpec:
    return WorkerSpec(
        (("plain", "off", (urls["off"],)), ("fast", "ngram:4", (urls["ngram"],))),
        routing="table",
        classes=("code", "chat"),
        default_class="chat",
        models=(MODEL,),
        buckets=(1, 4),
        table_path=str(table),
        **extra,
    )


class Workers:
    """``GatewayWorkers`` started in an event loop of its own thread."""

    def __init__(self, spec: WorkerSpec, count: int) -> None:
        self.thread = LoopThread()
        self.events: list[RequestObservation | RoutedEvent] = []
        self.workers = GatewayWorkers(spec, count, self.events.append)
        self.registry = CollectorRegistry()
        self.workers.count_on(self.registry)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.thread.run(self.workers.start(sock))
        self.url = f"http://127.0.0.1:{self.workers.port}"

    def stop(self) -> None:
        self.thread.run(self.workers.stop(grace_s=5.0))
        self.thread.stop()

    def until(self, condition: Any, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def requests_counted(self) -> float:
        total = 0.0
        for family in self.registry.collect():
            if family.name == "specpilot_gateway_requests":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return total


@pytest.fixture
def upstreams(loop_thread: LoopThread) -> dict[str, Any]:
    return {arm: start_replay(loop_thread) for arm in ("off", "ngram")}


@pytest.fixture
def two_workers(upstreams: dict[str, Any], tmp_path: Path) -> Iterator[tuple[Workers, Path]]:
    table = tmp_path / "routing.json"
    running = Workers(routing_spec({a: url for a, (_, url) in upstreams.items()}, table), 2)
    yield running, table
    running.stop()


def post(client: httpx.Client, url: str, cls: str = "code") -> None:
    response = client.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": "def f(x):", "stream": True},
        headers={"X-Workload-Class": cls},
    )
    assert response.status_code == 200, response.text


def test_workers_route_by_the_published_table_and_send_everything_back(
    two_workers: tuple[Workers, Path], upstreams: dict[str, Any]
) -> None:
    running, table = two_workers
    assert len(set(running.workers.pids())) == 2 and os.getpid() not in running.workers.pids()
    publisher = TablePublisher(SnapshotFile(table), running.workers.spec.pools, table=True)
    publisher.publish({RouteKey(MODEL, "code", "1-3"): Route("ngram:4", "best")})
    assert running.thread.run(running.workers.routing_by(publisher.version))
    with httpx.Client(timeout=30) as client:
        for _ in range(40):
            post(client, running.url)
        post(client, running.url, "chat")  # no route for it: off
    assert upstreams["ngram"][0].requests == 40 and upstreams["off"][0].requests == 1
    running.until(lambda: len(running.events) >= 82, "40 + 1 observations and routed requests")
    observations = [e for e in running.events if isinstance(e, RequestObservation)]
    routed = [e for e in running.events if not isinstance(e, RequestObservation)]
    assert Counter(o.arm for o in observations) == {"ngram:4": 40, "off": 1}
    assert Counter((r[1], r[3], r[4]) for r in routed) == {
        ("code", "ngram:4", "best"): 40,
        ("chat", "off", "learning"): 1,
    }
    # Both workers' counts, summed in this process.
    running.until(lambda: running.requests_counted() == 41, "the workers' metrics")
    assert running.registry.get_sample_value("specpilot_gateway_workers") == 2


def test_a_worker_that_dies_is_started_again_and_its_counts_stay(
    two_workers: tuple[Workers, Path],
) -> None:
    running, _ = two_workers
    with httpx.Client(timeout=30) as client:
        for _ in range(20):
            post(client, running.url)
    running.until(lambda: running.requests_counted() == 20, "the workers' metrics")
    victim = running.workers.pids()[0]
    os.kill(victim, signal.SIGKILL)
    running.until(
        lambda: (
            victim not in running.workers.pids()
            and running.registry.get_sample_value("specpilot_gateway_workers") == 2
        ),
        "the worker started again",
    )
    assert running.registry.get_sample_value("specpilot_gateway_worker_restarts_total") == 1
    assert running.requests_counted() == 20  # what the dead one counted is kept
    with httpx.Client(timeout=30) as client:
        for _ in range(10):
            post(client, running.url)
    running.until(lambda: running.requests_counted() == 30, "the counts going on")


def test_workers_keep_serving_while_the_parents_event_loop_is_stalled(
    two_workers: tuple[Workers, Path],
) -> None:
    running, _ = two_workers

    stalling, released = threading.Event(), threading.Event()

    async def stall() -> None:
        stalling.set()
        released.wait(120)  # blocks the parent's event loop (the API's and the loop's)

    stalled = asyncio.run_coroutine_threadsafe(stall(), running.thread.loop)
    assert stalling.wait(30)
    with httpx.Client(timeout=30) as client:
        for _ in range(10):
            post(client, running.url)
    assert not stalled.done()  # all ten were served while the parent could do nothing
    released.set()
    stalled.result(30)
    running.until(
        lambda: sum(isinstance(e, RequestObservation) for e in running.events) >= 10,
        "the observations after the stall",
    )
