"""The gateway in worker processes of its own, apart from the API and the control loop.

``specpilot serve`` (and ``specpilot gateway --workers N``) binds the gateway's port,
then starts ``workers`` processes with :mod:`multiprocessing`'s *spawn* method (a fresh
interpreter: nothing of the parent's threads, locks or event loop is inherited). Every
worker accepts on the same listening socket (the kernel hands each connection to one
of them) and runs the native front end (:mod:`controller.gateway.server`) on its own
uvloop, so no request waits on the API, the loop or the database, and a slow request
in one worker holds up none in another.

What a worker knows and says:

- *routing*: the table the loop publishes (:mod:`controller.gateway.table`, a file the
  worker checks a few times a second), each context's arm and the shares it explores,
  sampled per request in the worker; with no table yet, the last run's, else off;
- *observations*: every finished request, and in routing mode every routed request, is
  buffered and sent every ``FLUSH_S`` as one message on the worker's own bounded
  :class:`multiprocessing.Queue`. A full queue (the parent not reading) drops the batch
  and counts it (``specpilot_gateway_observations_dropped_total``): the worker never
  waits on the parent. What the parent drops from its own bounded queue to the loop
  (the loop stalled) is counted in the same total (``GatewayWorkers(dropped=...)``);
- *metrics*: the worker counts on a registry of its own; a copy of its samples rides on
  the batches (when they changed, as often as ``METRICS_EVERY_S`` allows), and the
  parent's :class:`WorkerMetrics` sums the workers' for the API's ``/metrics``, keeping a
  dead worker's counts so that totals never go down. Aggregating in the parent rather
  than ``prometheus_client``'s multiprocess mode: that mode is switched on by an
  environment variable for every metric of the process, gauges need a mode each and its
  files outlive crashes; here each figure keeps its meaning and the registry is the one
  passed in.

A worker that dies is started again (its slot's counts kept). SIGTERM stops a worker
gracefully (streams in progress get ``grace_s``); a worker whose parent dies gets
SIGTERM from the kernel (``PR_SET_PDEATHSIG``), so none outlives ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import math
import multiprocessing
import os
import queue
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from collectors.observations import RequestObservation
from controller.gateway.app import Gateway
from controller.gateway.classify import BUILTIN_CLASSIFIER, Classifier, ModelClassifier, RequestKeys
from controller.gateway.routing import Fleet, Pool, RouteKey, RoutingTable, StaticRoutingTable
from controller.gateway.server import GatewayLimits, GatewayServer
from controller.gateway.table import (
    POLL_S,
    OnRouted,
    Route,
    RoutingSnapshot,
    SampledRouting,
    SnapshotFile,
    apply_pools,
)
from controller.gateway.upstream import UpstreamPool, UpstreamTimeouts
from policies.arms import ConcurrencyBuckets

logger = logging.getLogger(__name__)

FLUSH_S = 0.25
"""A worker sends what it buffered this often: an observation reaches the loop within it
(the loop decides over seconds). Each batch wakes a thread in the worker and one in the
parent. ``python -m bench.gateway --upstream replay --levels 1`` (two runs each, 2
workers): CPU per request 3.40–3.75 ms at 20 batches a second, 2.46–2.67 ms at 4."""
METRICS_EVERY_S = (0.5, 5.0)
"""A worker's metrics go with its batches at most this often when they changed, and
every so often when they did not (reading a registry costs milliseconds)."""
QUEUE_BATCHES = 64
"""Batches a worker's queue holds (about ``QUEUE_BATCHES × FLUSH_S`` of its traffic)."""
START_TIMEOUT_S = 120.0
RESTART_BACKOFF_S = (0.5, 30.0)

RoutingKind = Literal["table", "classes", "default"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build its gateway, as plain values (a worker imports
    the gateway, not the settings, the policy or the store)."""

    pools: tuple[tuple[str, str, tuple[str, ...]], ...]
    """(name, arm, instance URLs); no URLs: a managed pool not started yet."""
    pool_models: tuple[tuple[str, str], ...] = ()
    """(pool name, the model it serves), where known: a request its pool cannot serve
    may go to another pool of its model (``Fleet.pick``)."""
    routing: RoutingKind = "default"
    """``table``: the published routes (routing mode); ``classes``: ``class_routes``
    (push mode); ``default``: everything to the default pool."""
    default_pool: str | None = None
    class_routes: tuple[tuple[str, str, str], ...] = ()
    """(model, class, pool) for ``classes``."""
    classes: tuple[str, ...] | None = None
    default_class: str | None = None
    models: tuple[str, ...] | None = None
    classifier: str | None = None
    """``gateway.classifier``: a model file, ``builtin``, or None."""
    buckets: tuple[int, ...] | None = None
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    table_path: str | None = None
    observe: bool = True
    """Send observations (a bare ``specpilot gateway`` without ``--observations`` does not)."""
    grace_s: float = 30.0
    log_level: int = logging.INFO

    @property
    def default_model(self) -> str | None:
        return self.models[0] if self.models else None


def request_keys(spec: WorkerSpec) -> RequestKeys:
    """The classes and models requests are keyed by, with the classifier
    ``gateway.classifier`` names (trained here: about a second for ``builtin``)."""
    classifier: Classifier | None = None
    if spec.classifier is not None:
        from policies.classifier import default_classifier, loads_recipe, train_classifier

        if spec.classifier == BUILTIN_CLASSIFIER:
            model = default_classifier()
        else:
            with open(spec.classifier, encoding="utf-8") as file:
                model = train_classifier(loads_recipe(file.read(), spec.classifier))
        classifier = ModelClassifier(model)
    return RequestKeys(spec.classes, spec.default_class, classifier, models=spec.models)


def build_gateway(
    spec: WorkerSpec,
    sink: Callable[[RequestObservation], None] | None = None,
    *,
    on_routed: OnRouted | None = None,
    rng: random.Random | None = None,
) -> Gateway:
    """The gateway a worker runs (tests build it in-process the same way)."""
    models = dict(spec.pool_models)
    pools = [
        Pool(n, a, urls, model=models.get(n)) if urls else Pool.empty(n, a, model=models.get(n))
        for n, a, urls in spec.pools
    ]
    default = spec.default_pool or next((p.name for p in pools if p.instances), pools[0].name)
    fleet = Fleet(pools, default_pool=default, clock=time.monotonic)
    buckets = ConcurrencyBuckets(spec.buckets) if spec.buckets else ConcurrencyBuckets()
    routing: RoutingTable
    if spec.routing == "table":
        routing = SampledRouting(
            _pool_by_arm(fleet), default_model=spec.default_model, rng=rng, on_routed=on_routed
        )
    elif spec.routing == "classes":
        routing = StaticRoutingTable(
            default,
            {
                RouteKey(name, cls, label): pool
                for model, cls, pool in spec.class_routes
                # A request naming no model is the first model's.
                for name in ((model, None) if model == spec.default_model else (model,))
                for label in buckets.labels
            },
        )
    else:
        routing = StaticRoutingTable(default)
    return Gateway(
        fleet,
        routing=routing,
        classifier=request_keys(spec),
        sink=sink,
        buckets=buckets,
        upstreams=UpstreamPool(spec.timeouts),
    )


def _pool_by_arm(fleet: Fleet) -> dict[str, str]:
    return {pool.arm: name for name, pool in fleet.pools.items()}


def shared_keys(spec: WorkerSpec) -> tuple[str, ...]:
    """The in-flight counts the workers share (``Fleet.shared``): per model (and for
    requests naming none), which place a request in its concurrency bucket."""
    return tuple(f"model:{m}" for m in [*(spec.models or ()), None])


class SharedInFlight:
    """:class:`~controller.gateway.routing.InFlightShare` over one shared array: a row
    per worker, a column per key. Each worker writes only its own row, so no lock is
    needed; a total read while another worker writes is at most one request off."""

    def __init__(self, array: Any, keys: Sequence[str], workers: int, slot: int) -> None:
        self._view = memoryview(array).cast("B").cast("q")
        self._columns = {key: i for i, key in enumerate(keys)}
        self._width = len(keys)
        self._rows = range(0, workers * self._width, self._width)
        self._own = slot * self._width
        for column in range(self._width):
            self._view[self._own + column] = 0  # what a worker before in this slot left

    def count(self, key: str, local: int) -> int:
        column = self._columns.get(key)
        if column is None:  # a model only a bare gateway passes through
            return local
        view = self._view
        view[self._own + column] = local
        return sum(view[row + column] for row in self._rows)


def load_table(gateway: Gateway, snapshot: RoutingSnapshot) -> None:
    """Route by ``snapshot`` from now on: its pools' arms and instances, and its routes
    where the gateway routes by the table."""
    changed = apply_pools(gateway.fleet, snapshot.pools)
    routing = gateway.routing
    if isinstance(routing, SampledRouting):
        if changed:
            routing.set_pools(_pool_by_arm(gateway.fleet))
        if snapshot.routes is not None:
            routing.replace(snapshot.routes)


# --- the worker process --------------------------------------------------------------------


_DROPPED = (
    "specpilot_gateway_observations_dropped",
    "counter",
    "Observations and routed requests dropped on their way to the control loop: by a "
    "gateway worker whose queue to the parent was full, or by the parent whose own "
    "queue to the loop was.",
)
_DROPPED_SAMPLE = ("specpilot_gateway_observations_dropped_total", ())


class _Outbox:
    """What a worker has to tell its parent, sent in batches on its bounded queue."""

    def __init__(self, slot: int, channel: Any, registry: CollectorRegistry) -> None:
        self.slot = slot
        self.pid = os.getpid()
        self.channel = channel
        self.registry = registry
        self.events: list[RequestObservation | RoutedEvent] = []
        self.dropped = Counter(_DROPPED[0], _DROPPED[2], registry=registry)
        self.version: tuple[int, int] | None = None
        self.metrics_at = -math.inf
        self.table_version = 0
        """The routing table's version the worker routes by (told to the parent)."""

    def observation(self, observation: RequestObservation) -> None:
        self.events.append(observation)

    def routed(self, model: str | None, cls: str, bucket: str, arm: str, reason: str) -> None:
        self.events.append((model, cls, bucket, arm, reason, time.time()))

    def flush(self, version: tuple[int, int], *, force: bool = False) -> None:
        """Send the buffered events (and the metrics, if they changed or are due); on a
        full queue drop them, counted."""
        now = time.monotonic()
        metrics = None
        since = now - self.metrics_at
        fresh, due = METRICS_EVERY_S
        if force or (version != self.version and since >= fresh) or since >= due:
            metrics = metrics_samples(self.registry)
            self.version, self.metrics_at = version, now
        if not self.events and metrics is None:
            return
        events, self.events = self.events, []
        try:
            message = (self.slot, self.pid, "batch", events, metrics, self.table_version)
            self.channel.put_nowait(message)
        except queue.Full:
            self.dropped.inc(len(events))
            self.version = None  # the samples did not go either


def metrics_samples(registry: CollectorRegistry) -> list[tuple[str, str, str, list[Any]]]:
    """A registry's families as plain values: (name, type, help, samples)."""
    out = []
    for family in registry.collect():
        samples = [
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for s in family.samples
            if not s.name.endswith("_created")
        ]
        out.append((family.name, family.type, family.documentation, samples))
    return out


def _die_with_parent() -> None:
    """SIGTERM when the parent dies (Linux), so that no worker outlives ``serve``; and a
    process group of its own, so that a signal to ``serve``'s group (Ctrl-C in a
    terminal, ``timeout``) reaches the parent alone, which drains the workers in order
    instead of seeing them exit and starting them again."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(
    spec: WorkerSpec,
    slot: int,
    sock: socket.socket,
    channel: Any,
    parent: int,
    shared: tuple[Any, int] | None = None,
) -> None:
    """A worker process's entry point: serve until SIGTERM (or the parent's death)."""
    _die_with_parent()
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[gateway-{slot}]: %(message)s",
    )
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_serve(spec, slot, sock, channel, parent, shared))


async def _serve(
    spec: WorkerSpec,
    slot: int,
    sock: socket.socket,
    channel: Any,
    parent: int,
    shared: tuple[Any, int] | None,
) -> None:
    from controller.tracing import Tracing

    registry = CollectorRegistry()
    outbox = _Outbox(slot, channel, registry)
    gateway = build_gateway(
        spec,
        outbox.observation if spec.observe else None,
        on_routed=outbox.routed if spec.observe else None,
    )
    if shared is not None:
        array, workers = shared
        gateway.fleet.shared = SharedInFlight(array, shared_keys(spec), workers, slot)
    metrics = gateway.count_on(registry)
    tracing = Tracing.from_env()
    gateway.tracer = tracing.tracer if tracing is not None else None
    table = SnapshotFile(Path(spec.table_path)) if spec.table_path else None
    if table is not None and table.changed() and (snapshot := table.read()) is not None:
        load_table(gateway, snapshot)
        outbox.table_version = snapshot.version
    server = await GatewayServer.start(gateway, sock=sock, limits=spec.limits)
    channel.put((slot, os.getpid(), "ready", [], None, outbox.table_version))
    # What is allocated by now lives as long as the process: out of the collector's
    # sight, a full collection (tens of ms, a stall for every stream) never walks it.
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    flushed = [loop.time()]
    pools = tuple(gateway.fleet.pools.values())

    def activity() -> tuple[int, int]:
        """What changes the metrics: requests counted, and attempts in flight."""
        return metrics.version, sum(pool.in_flight for pool in pools)

    def tick() -> None:
        loaded = False
        if table is not None and table.changed() and (snapshot := table.read()) is not None:
            load_table(gateway, snapshot)
            outbox.table_version, loaded = snapshot.version, True
        now = loop.time()
        # A new table is told at once: the parent waits on it (GatewayWorkers.routing_by).
        if loaded or now - flushed[0] >= FLUSH_S:
            outbox.flush(activity(), force=loaded)
            flushed[0] = now
        if os.getppid() != parent:
            stop.set()  # the parent died before PR_SET_PDEATHSIG was armed
        if not stop.is_set():
            handles[0] = loop.call_later(POLL_S, tick)

    handles = [loop.call_later(POLL_S, tick)]
    try:
        await stop.wait()
    finally:
        handles[0].cancel()
        with contextlib.suppress(Exception):
            await server.close(grace_s=spec.grace_s)
        outbox.flush(activity(), force=True)
        if tracing is not None:
            tracing.shutdown()
        channel.close()
        channel.join_thread()


# --- the parent's side ---------------------------------------------------------------------


class WorkerMetrics(Collector):
    """The workers' gateway metrics summed, for the registry the API serves.

    Counters and histograms add up over the workers alive and the counts of those that
    died (kept, so a total never goes down); gauges (in flight) over the live ones.
    ``dropped``, when given, counts what the parent itself dropped on the way to the loop:
    it is added to the workers' drops, one total wherever the queue was full."""

    def __init__(self, dropped: Callable[[], int] | None = None) -> None:
        self.live: dict[int, list[tuple[str, str, str, list[Any]]]] = {}
        self.kept: dict[tuple[str, str, str], dict[tuple[str, tuple[Any, ...]], float]] = {}
        self.workers = 0
        self.restarts = 0
        self.dropped = dropped

    def update(self, slot: int, samples: list[tuple[str, str, str, list[Any]]]) -> None:
        self.live[slot] = samples

    def retire(self, slot: int) -> None:
        """A worker died: what it counted stays counted."""
        for name, kind, doc, samples in self.live.pop(slot, []):
            if kind == "gauge":
                continue
            kept = self.kept.setdefault((name, kind, doc), {})
            for sample, labels, value in samples:
                kept[(sample, labels)] = kept.get((sample, labels), 0.0) + value

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        totals: dict[tuple[str, str, str], dict[tuple[str, tuple[Any, ...]], float]] = {
            family: dict(samples) for family, samples in self.kept.items()
        }
        for families in self.live.values():
            for name, kind, doc, samples in families:
                family = totals.setdefault((name, kind, doc), {})
                for sample, labels, value in samples:
                    family[(sample, labels)] = family.get((sample, labels), 0.0) + value
        if self.dropped is not None:
            # Keyed by name alone: a worker of an older build may describe it otherwise.
            key = next((f for f in totals if f[0] == _DROPPED[0]), _DROPPED)
            family = totals.setdefault(key, {})
            family[_DROPPED_SAMPLE] = family.get(_DROPPED_SAMPLE, 0.0) + self.dropped()
        for (name, kind, doc), summed in sorted(totals.items()):
            metric = Metric(name, doc, kind)
            for (sample, labels), value in sorted(summed.items(), key=_sample_order):
                metric.add_sample(sample, dict(labels), value)
            yield metric
        workers = Metric("specpilot_gateway_workers", "Gateway worker processes serving.", "gauge")
        workers.add_sample("specpilot_gateway_workers", {}, self.workers)
        yield workers
        restarts = Metric(
            "specpilot_gateway_worker_restarts",
            "Gateway worker processes started again after they died.",
            "counter",
        )
        restarts.add_sample("specpilot_gateway_worker_restarts_total", {}, self.restarts)
        yield restarts


def _sample_order(item: tuple[tuple[str, tuple[Any, ...]], float]) -> tuple[str, str]:
    (sample, labels), _ = item
    return sample, repr(labels)


RoutedEvent = tuple[str | None, str, str, str, str, float]
"""(model, class, bucket, arm, reason, wall-clock time) of a request routed by the table."""
Delivery = Callable[[RequestObservation | RoutedEvent], None]


class _Slot:
    """One worker: its process, its queue and the thread that empties the queue."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.channel: Any = None
        self.reader: threading.Thread | None = None
        self.ready = threading.Event()
        self.started_at = 0.0
        self.backoff_s = RESTART_BACKOFF_S[0]
        self.table_version = 0


class GatewayWorkers:
    """The gateway's worker processes, seen from the parent: start, restart, stop, the
    observations they send (``deliver``, called in the parent's event loop, bounded:
    a reader thread hands over at most a few batches the loop has not taken yet) and
    their summed metrics (:meth:`count_on`). ``dropped`` counts what ``deliver``'s side
    dropped (its bounded queue full), reported with the workers' drops."""

    def __init__(
        self,
        spec: WorkerSpec,
        count: int,
        deliver: Delivery | None = None,
        dropped: Callable[[], int] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("the gateway needs at least one worker")
        self.spec = spec
        self.count = count
        self.deliver = deliver
        self.metrics = WorkerMetrics(dropped)
        self._context = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i) for i in range(count)]
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed = threading.BoundedSemaphore(4)
        self._shared = self._context.RawArray("q", count * len(shared_keys(spec)))
        self._stopping = False
        self._watcher: asyncio.Task[None] | None = None

    def count_on(self, registry: CollectorRegistry) -> None:
        registry.register(self.metrics)

    @property
    def started(self) -> bool:
        return self._sock is not None

    @property
    def port(self) -> int | None:
        return int(self._sock.getsockname()[1]) if self._sock is not None else None

    async def start(self, sock: socket.socket, backlog: int = 2048) -> None:
        """Listen on ``sock`` (bound) and start every worker; returns once all serve.
        Raises ``RuntimeError`` if one cannot start (the others are stopped again)."""
        self._loop = asyncio.get_running_loop()
        sock.listen(backlog)
        self._sock = sock
        for slot in self._slots:
            self._spawn(slot)
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in self._slots:
            while not slot.ready.is_set():
                if not slot.process.is_alive() or time.monotonic() > deadline:
                    code = slot.process.exitcode
                    await self.stop(grace_s=1.0)
                    raise RuntimeError(f"gateway worker {slot.index} failed to start (exit {code})")
                await asyncio.sleep(0.02)
        self.metrics.workers = self.count
        self._watcher = asyncio.create_task(self._watch())

    def _spawn(self, slot: _Slot) -> None:
        spec = self.spec
        if spec.limits.max_connections > 1 and self.count > 1:
            # The connection limit is the gateway's, shared by its workers.
            share = -(-spec.limits.max_connections // self.count)
            spec = _with_limits(spec, share)
        slot.channel = self._context.Queue(QUEUE_BATCHES)
        slot.ready.clear()
        slot.process = self._context.Process(
            target=worker_main,
            args=(
                spec,
                slot.index,
                self._sock,
                slot.channel,
                os.getpid(),
                (self._shared, self.count),
            ),
            name=f"specpilot-gateway-{slot.index}",
            daemon=True,
        )
        slot.process.start()
        slot.started_at = time.monotonic()
        slot.reader = threading.Thread(
            target=self._read, args=(slot, slot.channel, slot.process), daemon=True
        )
        slot.reader.start()

    def _read(self, slot: _Slot, channel: Any, process: Any) -> None:
        """Empty one worker's queue into the event loop until the worker is gone."""
        while True:
            try:
                message = channel.get(timeout=0.2)
            except queue.Empty:
                if not process.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            _, _, kind, events, samples, slot.table_version = message
            if kind == "ready":
                slot.ready.set()
                continue
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            self._handed.acquire()
            try:
                loop.call_soon_threadsafe(self._take, slot.index, events, samples)
            except RuntimeError:  # the event loop closed meanwhile
                self._handed.release()
                return

    def _take(self, index: int, events: list[Any], samples: Any) -> None:
        self._handed.release()
        if samples is not None:
            self.metrics.update(index, samples)
        deliver = self.deliver
        if deliver is not None:
            for event in events:
                deliver(event)

    async def _watch(self) -> None:
        """Start a worker that died again (with a growing pause if it keeps dying)."""
        while not self._stopping:
            await asyncio.sleep(0.5)
            for slot in self._slots:
                if self._stopping or slot.process.is_alive():
                    continue
                code = slot.process.exitcode
                self.metrics.retire(slot.index)
                width = len(self._shared) // self.count
                self._shared[slot.index * width : (slot.index + 1) * width] = [0] * width
                self.metrics.workers = sum(s.process.is_alive() for s in self._slots)
                if time.monotonic() - slot.started_at < slot.backoff_s:
                    continue
                logger.error("gateway worker %d exited (%s); starting it again", slot.index, code)
                if time.monotonic() - slot.started_at < 60.0:
                    slot.backoff_s = min(2 * slot.backoff_s, RESTART_BACKOFF_S[1])
                else:
                    slot.backoff_s = RESTART_BACKOFF_S[0]
                self._spawn(slot)
                self.metrics.restarts += 1
                self.metrics.workers = sum(s.process.is_alive() for s in self._slots)

    async def routing_by(self, version: int, timeout_s: float = 10.0) -> bool:
        """Wait until every live worker routes by table ``version`` or a later one;
        False if one did not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            behind = [
                s
                for s in self._slots
                if s.process is not None and s.process.is_alive() and s.table_version < version
            ]
            if not behind:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self._slots if s.process is not None]

    async def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every worker (streams in progress get ``grace_s``), then SIGKILL what
        is left; what they sent last is delivered."""
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        processes = [s.process for s in self._slots if s.process is not None]
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5.0
        for process in processes:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5)
        for slot in self._slots:
            if slot.reader is not None:
                await asyncio.to_thread(slot.reader.join, 5)
            await asyncio.sleep(0)  # what the readers handed over last
        self.metrics.workers = 0
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _with_limits(spec: WorkerSpec, max_connections: int) -> WorkerSpec:
    from dataclasses import replace

    return replace(spec, limits=replace(spec.limits, max_connections=max_connections))


def default_workers() -> int:
    """The number of cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class TablePublisher:
    """The parent's side of the routing table: the pools' arms and instances and the
    routes, written (:class:`SnapshotFile`) whenever either changes.

    At start it keeps the routes the file already holds (the last run's: what the
    workers route by until the loop publishes) with the pools as the settings say."""

    def __init__(
        self,
        file: SnapshotFile,
        pools: Sequence[tuple[str, str, tuple[str, ...]]],
        *,
        table: bool,
    ) -> None:
        self.file = file
        self.pools = {name: (arm, urls) for name, arm, urls in pools}
        last = file.read()
        self.routes: dict[RouteKey, Route] | None = None
        if table:
            self.routes = dict(last.routes) if last is not None and last.routes else {}
        self.version = last.version if last is not None else 0
        self._failing = False
        self._write()

    def publish(self, routes: Mapping[RouteKey, Route]) -> None:
        if self.routes is not None and dict(routes) != self.routes:
            self.routes = dict(routes)
            self._write()

    def set_pool(self, name: str, urls: Sequence[str], arm: str) -> int:
        """Give pool ``name`` these instances and arm; returns the table's version."""
        entry = (arm, tuple(urls))
        if self.pools.get(name) != entry:
            self.pools[name] = entry
            self._write()
        return self.version

    def _write(self) -> None:
        self.version += 1
        try:
            self.file.write(RoutingSnapshot(dict(self.pools), self.routes, self.version))
        except OSError as exc:
            if not self._failing:
                logger.error("cannot write the routing table %s: %s", self.file.path, exc)
            self._failing = True
            return
        if self._failing:
            logger.info("routing table %s written again", self.file.path)
        self._failing = False
