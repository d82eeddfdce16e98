"""The gateway's own Prometheus metrics, on the registry passed in (the API's, so that
``specpilot serve`` exposes them on the API's ``/metrics``; the gateway's own port
serves only the proxied paths).

Kept off the hot path: one counter increment and one histogram observation per
request, none per streamed chunk. In-flight counts and ejections are read from the
gateway's fleet when Prometheus scrapes (the fleet keeps them anyway). Labels are the
pool and arm names and the workload classes of the settings, and status codes: a class
the settings do not list (a gateway without settings) is counted as ``other``, so no
client-chosen value ever becomes a label.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.gateway.routing import Fleet

OTHER_CLASS = "other"
NO_CLASS = ""
"""The class label of requests the gateway passes through unclassified (``/v1/models``,
``/health``, a body that is not a JSON object) or refuses before routing."""
NO_POOL = ""
"""The pool and arm labels of requests answered before a pool was chosen."""
DISCONNECTED = "disconnected"
"""Status label: the client left before its response was complete."""
ABORTED = "aborted"
"""Status label: the upstream failed after the response had started (sent unfinished)."""
ADDED_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class GatewayMetrics:
    def __init__(
        self, registry: CollectorRegistry, fleet: Fleet, classes: Collection[str] | None
    ) -> None:
        self.requests = Counter(
            "specpilot_gateway_requests_total",
            "Requests the gateway answered, by pool, arm, workload class and status (the "
            "HTTP status sent, 'aborted' when the upstream failed mid-response, "
            "'disconnected' when the client left first).",
            ["pool", "arm", "workload_class", "status"],
            registry=registry,
        )
        self.retries = Counter(
            "specpilot_gateway_retries_total",
            "Attempts made on another instance after one failed before the client saw a byte.",
            ["pool"],
            registry=registry,
        )
        self.failovers = Counter(
            "specpilot_gateway_failovers_total",
            "Requests the routing table sent to a pool with no instance able to take them, "
            "served by another pool of the model (pool: the table's, served_pool: the one "
            "that answered): a failover, not an exploration.",
            ["pool", "served_pool"],
            registry=registry,
        )
        self.added_latency = Histogram(
            "specpilot_gateway_added_latency_seconds",
            "Time the gateway itself added to a completed inference request: from having "
            "the whole request to sending it upstream (routing, classifying, connecting, "
            "failed attempts), plus from the upstream's last byte to the client's.",
            buckets=ADDED_LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(_FleetCollector(fleet))
        self._classes = frozenset(classes) if classes is not None else frozenset()
        self._children: dict[tuple[str, str, str, str], Counter] = {}
        self._retries: dict[str, Counter] = {}
        self._failovers: dict[tuple[str, str], Counter] = {}
        for pool in fleet.pools.values():  # at 0, so that Prometheus' increase() sees the first
            self._retries[pool.name] = self.retries.labels(pool.name)
            for other in fleet.pools.values():
                if other.name != pool.name and other.model == pool.model:
                    key = (pool.name, other.name)
                    self._failovers[key] = self.failovers.labels(*key)
        self.version = 0
        """Counts the requests and retries counted: whether anything changed since."""

    def request(self, pool: str, arm: str, workload_class: str, status: int | str) -> None:
        """Count one answered request (once per request)."""
        key = (pool, arm, workload_class, str(status))
        child = self._children.get(key)
        if child is None:
            cls = workload_class
            if cls != NO_CLASS and cls not in self._classes:
                cls = OTHER_CLASS
            child = self._children[key] = self.requests.labels(pool, arm, cls, key[3])
        child.inc()
        self.version += 1

    def retry(self, pool: str) -> None:
        child = self._retries.get(pool)
        if child is None:
            child = self._retries[pool] = self.retries.labels(pool)
        child.inc()
        self.version += 1

    def failover(self, pool: str, served_pool: str) -> None:
        """One request routed to ``pool`` and served by ``served_pool`` instead."""
        key = (pool, served_pool)
        child = self._failovers.get(key)
        if child is None:
            child = self._failovers[key] = self.failovers.labels(*key)
        child.inc()
        self.version += 1


class _FleetCollector(Collector):
    """In-flight requests and ejections per pool, read from the fleet at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        in_flight, ejections = self._families()
        for pool in self.fleet.pools.values():
            in_flight.add_metric([pool.name, pool.arm], pool.in_flight)
            ejections.add_metric([pool.name], pool.ejections)
        yield in_flight
        yield ejections

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (
            GaugeMetricFamily(
                "specpilot_gateway_in_flight_requests",
                "Attempts in progress on the pool's instances.",
                labels=["pool", "arm"],
            ),
            CounterMetricFamily(
                "specpilot_gateway_ejections",
                "Times an instance of the pool was ejected after failing.",
                labels=["pool"],
            ),
        )
