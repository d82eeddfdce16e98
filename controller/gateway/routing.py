"""Where a request goes: pools, instances, the routing table, balancing and ejection.

Pure bookkeeping, no I/O: the gateway asks :class:`Fleet` for an instance, reports how
the attempt went, and the fleet keeps in-flight counts and ejections on an injected
clock, so all of it is unit-testable with fakes.

A *pool* is a set of vLLM instances that all run one speculative config (its *arm*,
e.g. ``"ngram:4"`` or ``"off"``). The policy picks a pool per (model, workload class,
concurrency bucket); that choice lives in a :class:`RoutingTable` the control loop
replaces atomically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from controller.urls import host_header, instance_url_problem, redact_url

Clock = Callable[[], float]
"""Seconds, monotonic; injected so ejection cool-downs are testable."""


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What the policy decides on: a model (None = any), a workload class and a bucket."""

    model: str | None
    workload_class: str
    bucket: str


class RoutingTable(Protocol):
    """Picks the pool name for a request; the control loop swaps its contents atomically."""

    def pool_for(self, model: str | None, workload_class: str, bucket: str) -> str: ...


class StaticRoutingTable:
    """Explicit routes with a default pool; :meth:`replace` swaps all routes at once.

    A lookup tries (model, class, bucket), then the same with model None (routes that hold
    for every model), then the default. Replacing rebinds one attribute to a new immutable
    snapshot, so a reader in the event loop never sees a half-applied decision, even when
    the control loop runs in another thread.
    """

    def __init__(self, default_pool: str, routes: Mapping[RouteKey, str] | None = None) -> None:
        self._snapshot: tuple[str, dict[RouteKey, str]] = (default_pool, dict(routes or {}))

    @property
    def default_pool(self) -> str:
        return self._snapshot[0]

    @property
    def routes(self) -> Mapping[RouteKey, str]:
        return dict(self._snapshot[1])

    def replace(self, routes: Mapping[RouteKey, str], default_pool: str | None = None) -> None:
        self._snapshot = (default_pool or self._snapshot[0], dict(routes))

    def pool_for(self, model: str | None, workload_class: str, bucket: str) -> str:
        default, routes = self._snapshot
        if not routes:
            return default
        pool = routes.get(RouteKey(model, workload_class, bucket))
        if pool is None and model is not None:
            pool = routes.get(RouteKey(None, workload_class, bucket))
        return pool or default


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """When an instance leaves rotation and for how long.

    ``failures_to_eject`` consecutive failures eject it for ``cooldown_s``; each further
    ejection without a success in between doubles the cool-down up to ``max_cooldown_s``,
    so a dead instance costs one failed attempt per cool-down, not one per request.
    """

    failures_to_eject: int = 1
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0


class Instance:
    """One vLLM server: its base URL and the gateway's live counters for it.

    ``display_url`` is the URL as logs may show it (user info redacted); the ``Host``
    header never carries the user info."""

    __slots__ = (
        "base_url",
        "consecutive_failures",
        "display_url",
        "ejected_until",
        "ejections",
        "host",
        "host_header",
        "in_flight",
        "port",
    )

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.display_url = redact_url(self.base_url)
        problem = instance_url_problem(self.base_url)
        if problem is not None:
            raise ValueError(f"instance {self.display_url!r}: {problem}")
        parts = urlsplit(self.base_url)
        assert parts.hostname is not None
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = host_header(self.base_url)
        self.in_flight = 0
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self.ejections = 0

    def available(self, now: float) -> bool:
        return now >= self.ejected_until

    def __repr__(self) -> str:
        return f"Instance({self.display_url!r}, in_flight={self.in_flight})"


class Pool:
    """Instances that run one speculative config, the ``arm`` observations are tagged with.

    ``model``: the model its instances serve, where known (``serve`` knows it from the
    settings): a request its own pool cannot serve may go to another pool of the model."""

    __slots__ = ("arm", "ejections", "in_flight", "instances", "model", "name")

    def __init__(
        self, name: str, arm: str, base_urls: Sequence[str], *, model: str | None = None
    ) -> None:
        if not base_urls:
            raise ValueError(f"pool {name!r} has no instances")
        self.name = name
        self.arm = arm
        self.model = model
        self.instances = tuple(Instance(url) for url in base_urls)
        self.in_flight = 0
        self.ejections = 0
        """Times one of its instances was ejected (a running total, for metrics)."""

    @classmethod
    def empty(cls, name: str, arm: str, *, model: str | None = None) -> Pool:
        """A pool with no instance yet (a managed pool before its first start); its
        requests go to the fleet's default pool until :meth:`Fleet.set_instances`."""
        pool = cls(name, arm, ["http://placeholder"], model=model)
        pool.instances = ()
        return pool

    def __repr__(self) -> str:
        return f"Pool({self.name!r}, arm={self.arm!r}, instances={list(self.instances)})"


class InFlightShare(Protocol):
    """In-flight counts shared by the processes that serve one gateway: told this
    process's count of a key (``model:NAME``), answers the total."""

    def count(self, key: str, local: int) -> int: ...


class NoInstanceAvailable(RuntimeError):
    """Every instance of the pool (and of the fallback) is ejected or already tried."""


class Fleet:
    """Pools, in-flight accounting, least-in-flight choice and ejection.

    The gateway calls :meth:`acquire` before an attempt and exactly one of
    :meth:`release` (with ``ok``) after it. In-flight counts are kept per instance, per
    pool and per model (the concurrency the routing bucket is computed from). With
    ``shared`` (a gateway in several worker processes) the counts of a model and of a
    pool that :meth:`begin` and :meth:`acquire` return are every worker's together;
    balancing and ejection stay each worker's own.
    """

    def __init__(
        self,
        pools: Sequence[Pool],
        *,
        default_pool: str | None = None,
        ejection: EjectionPolicy | None = None,
        clock: Clock,
    ) -> None:
        if not pools:
            raise ValueError("a fleet needs at least one pool")
        self.pools: dict[str, Pool] = {pool.name: pool for pool in pools}
        if len(self.pools) != len(pools):
            raise ValueError("pool names must be unique")
        self.default_pool = default_pool or pools[0].name
        if self.default_pool not in self.pools:
            raise ValueError(f"unknown default pool {self.default_pool!r}")
        self.ejection = ejection or EjectionPolicy()
        self._clock = clock
        self._model_in_flight: dict[str | None, int] = {}
        self.shared: InFlightShare | None = None

    def set_instances(self, pool_name: str, base_urls: Sequence[str], arm: str) -> None:
        """Swap a pool's instances and arm at once (a managed pool moved to a new
        process). An instance that stays keeps its counters; requests still on a removed
        one finish and release it as usual. No instance: the pool's requests go to the
        default pool."""
        pool = self.pools[pool_name]
        kept = {instance.base_url: instance for instance in pool.instances}
        pool.instances = tuple(kept.get(url.rstrip("/")) or Instance(url) for url in base_urls)
        pool.arm = arm

    def model_in_flight(self, model: str | None) -> int:
        return self._model_in_flight.get(model, 0)

    def begin(self, model: str | None) -> int:
        """Count a request for ``model`` as in flight; returns the count, itself included."""
        count = self._model_in_flight.get(model, 0) + 1
        self._model_in_flight[model] = count
        shared = self.shared
        return count if shared is None else shared.count(f"model:{model}", count)

    def end(self, model: str | None) -> None:
        count = self._model_in_flight.get(model, 0) - 1
        if count > 0:
            self._model_in_flight[model] = count
        else:
            self._model_in_flight.pop(model, None)
        if self.shared is not None:
            self.shared.count(f"model:{model}", max(count, 0))

    def pick(self, pool_name: str, exclude: Sequence[Instance] = ()) -> tuple[Pool, Instance]:
        """The least-loaded available instance of ``pool_name`` not in ``exclude``.

        An unknown pool name, or a pool with no usable instance, falls back to the default
        pool, then to the other pools of the same model (where pools know their model),
        in configuration order: a stale routing decision or a pool of one instance that
        is slow for a moment must degrade service (another speculative config serves the
        same model, with the same output), not break it. Ties go to the first instance
        in configuration order, which keeps the choice deterministic.

        When every instance of both is ejected (a pool of one instance that failed once,
        say), the one whose cool-down ends first is tried anyway, as Envoy's panic
        threshold does: a certain 503 is worse than retrying an instance that failed a
        moment ago. Only ``exclude`` (this request's failed attempts) is never retried.
        """
        now = self._clock()
        pool = self.pools.get(pool_name) or self.pools[self.default_pool]
        candidates = [pool]
        if pool.name != self.default_pool:
            candidates.append(self.pools[self.default_pool])
        if pool.model is not None:
            candidates += [
                other
                for other in self.pools.values()
                if other.model == pool.model and other not in candidates
            ]
        for candidate in candidates:
            best = self._least_loaded(candidate, now, exclude)
            if best is not None:
                return candidate, best
        for candidate in candidates:
            remaining = [i for i in candidate.instances if i not in exclude]
            if remaining:
                return candidate, min(remaining, key=lambda i: i.ejected_until)
        raise NoInstanceAvailable(f"no available instance in pool {pool_name!r}")

    @staticmethod
    def _least_loaded(pool: Pool, now: float, exclude: Sequence[Instance]) -> Instance | None:
        best: Instance | None = None
        for instance in pool.instances:
            if instance.ejected_until > now or instance in exclude:
                continue
            if best is None or instance.in_flight < best.in_flight:
                best = instance
        return best

    def acquire(self, pool: Pool, instance: Instance) -> None:
        """Count an attempt as in flight (its instance's count sets the least-loaded pick)."""
        instance.in_flight += 1
        pool.in_flight += 1

    def release(self, pool: Pool, instance: Instance, *, ok: bool | None) -> None:
        """End an attempt; a failure counts toward ejecting the instance, a success
        clears its record, and None (the client left first) does neither."""
        instance.in_flight -= 1
        pool.in_flight -= 1
        if ok is None:
            return
        if ok:
            instance.consecutive_failures = 0
            instance.ejections = 0
            return
        instance.consecutive_failures += 1
        if instance.consecutive_failures >= self.ejection.failures_to_eject:
            policy = self.ejection
            cooldown = min(policy.cooldown_s * 2**instance.ejections, policy.max_cooldown_s)
            instance.ejected_until = self._clock() + cooldown
            instance.ejections += 1
            instance.consecutive_failures = 0
            pool.ejections += 1
