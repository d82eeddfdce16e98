"""The observation sources ``collect`` names, each an ``ObservationSource`` of the loop.

- ``scrape``: every pool instance's ``/metrics`` (``collectors.scraper``), once per loop
  interval; each instance's window (``collectors.window``) becomes a stored
  ``WindowStatRecord`` and, when usable, the policy's ``WindowObservation``.
- ``prometheus``: the same figures by PromQL (``collectors.promql``) from the Prometheus
  that already scrapes the fleet, matched to pool instances by the ``instance`` label.
- ``gateway``: the requests the gateway relays (``QueuedObservations``).

Attribution: a worker's window is evidence for its pool's primary class (the first of
its ``classes``, or of the settings' ``classes``): the class whose decisions set the
pool's config, so the config it ran is that class's arm. Other classes a pool serves
learn from the gateway's per-request observations only, where the gateway is served.

The arm a window ran is what vLLM shows, never what was pushed: no spec-decode series
is off, the number of per-position series is its γ, and the method is the one the pool
is believed to run (``controller.running``: the actuator's read-back where it has one,
else what the evidence confirmed). Where the config sets γ by batch size
(``num_speculative_tokens_per_batch_size``), the window's mean running requests pick
the range, and γ = 0 there is off. Every scrape also reports each instance's shape
(``InstanceSeen``), from which a push is confirmed or found not applied.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from collectors.evidence import unusable, window_observation
from collectors.observations import WindowObservation
from collectors.promql import PrometheusReader
from collectors.scraper import Scraper, ScraperSettings, ScrapeTarget
from collectors.window import WindowStats, WorkerWindow
from controller.contexts import bucket_of
from controller.fleet import Fleet
from controller.ports import Collected, InstanceSeen, ObservationSource
from controller.running import RunningConfigs
from controller.settings import Settings
from controller.specconfig import OFF, SpecConfigError, parse_arm, resolve_on_pool
from controller.store.records import WindowStatRecord

Clock = Callable[[], float]
UNKNOWN_ARM = "unknown"
"""A window that drafted under a config nobody knows the method of."""


@dataclass(frozen=True, slots=True)
class Placement:
    """One instance of a pool and the config it was told to run."""

    pool: str
    url: str
    """Base URL, e.g. ``http://10.0.0.7:8000``."""
    config: Mapping[str, Any] | None
    """The config it is believed to run (None: no speculation)."""
    replica: str | None = None
    """Per-pod topology: the replica whose pod runs it (every pod's vLLM is on its own
    localhost, so the URL alone names no instance of the fleet)."""

    @property
    def instance(self) -> str:
        """The instance's name in window stats: its URL, with the pod's replica as the
        fragment in the per-pod topology (``http://127.0.0.1:8000#pod-a``)."""
        return self.url if self.replica is None else f"{self.url}#{self.replica}"

    speculative: Mapping[str, Any] | None = None
    """Where ``config`` is off: the method an instance seen speculating runs anyway
    (the push that turned it off did not take); see ``RunningConfigs.speculative``."""


class FleetPlacements:
    """Where each pool runs and with which config, as the evidence shows it: a managed
    pool's instance and config from the managed actuator (which started it), any other
    pool's instances from the settings with the config ``running`` believes it runs.

    ``running`` is the loop's ``RunningConfigs`` (set once the loop exists); until then,
    and in routing mode, a pool runs what the settings say.
    """

    def __init__(self, settings: Settings, fleet: Fleet) -> None:
        self.settings, self.fleet = settings, fleet
        self.running: RunningConfigs | None = None
        self.managed: Any = None
        """The ``ManagedActuator``, where pools are managed (``urls``, ``config``)."""
        managed = settings.actuators.managed
        self.replica = managed.replica if managed is not None and managed.pod else None
        """Per-pod topology: this replica, whose pod's vLLM is the one placement here."""

    def __call__(self) -> list[Placement]:
        placements = []
        for name, pool in sorted(self.fleet.pools.items()):
            settings_config = pool.speculative_config
            config: Mapping[str, Any] | None = settings_config
            if settings_config.get("method") == OFF:
                config = None
            speculative = config
            if self.managed is not None and not pool.instances:
                config = self.managed.config(name)
                placements += [
                    Placement(name, url, config, self.replica, config)
                    for url in self.managed.urls(name)
                ]
                continue
            if not self.fleet.routing and self.running is not None:
                config = self.running.believed(name)
                speculative = self.running.speculative(name)
            placements += [
                Placement(name, url.rstrip("/"), config, speculative=speculative)
                for url in pool.instances
            ]
        return placements


@dataclass(slots=True)
class Attribution:
    """Turns one instance's window into a stored record and the policy's evidence."""

    settings: Settings
    fleet: Fleet
    clock: Clock

    def of(
        self,
        placement: Placement,
        window: WorkerWindow | None,
        *,
        healthy: bool,
        status: str | None,
    ) -> tuple[list[WindowStatRecord], list[WindowObservation]]:
        """What the window stores and teaches (see ``seen`` for what it shows runs)."""
        now = self.clock()
        pool = self.fleet.pools[placement.pool]
        cls = self.fleet.primary_class(pool)
        records: list[WindowStatRecord] = []
        evidence: list[WindowObservation] = []
        if window is None or not window.models:
            records.append(
                WindowStatRecord(
                    ts=now,
                    pool=placement.pool,
                    instance=placement.instance,
                    model=pool.model,
                    window_s=0.0,
                    healthy=healthy,
                    workload_class=cls,
                    status=status or "no vLLM series on the page yet",
                )
            )
            return records, evidence
        for model_name, model in sorted(window.models.items()):
            stats = model.total
            arm = self._arm(placement, stats)
            why = status or unusable(stats)
            observation = (
                None
                if status is not None
                else window_observation(model_name, stats, finished_at=now)
            )
            bucket = None
            if stats.running.mean is not None:
                bucket = bucket_of(max(1, round(stats.running.mean)), self.settings.buckets)
            tpot = stats.time_per_output_token
            records.append(
                WindowStatRecord(
                    ts=now,
                    pool=placement.pool,
                    instance=placement.instance,
                    model=model_name,
                    window_s=float(stats.duration_s or 0.0),
                    acceptance_rate=stats.spec.acceptance_rate if stats.spec else None,
                    mean_acceptance_length=stats.spec.mean_acceptance_length
                    if stats.spec
                    else None,
                    tpot_p50_s=tpot.p50_s if tpot else None,
                    requests_running=stats.running.mean,
                    healthy=healthy,
                    workload_class=cls,
                    bucket=bucket,
                    arm=arm,
                    requests=observation.requests if observation else None,
                    generation_tokens=stats.generation_tokens,
                    tpot_mean_s=tpot.mean_s if tpot else None,
                    status=why,
                )
            )
            if observation is not None and model_name == pool.model:
                evidence.append(
                    _attributed(observation, placement.pool, placement.instance, arm, cls)
                )
        return records, evidence

    def seen(self, placement: Placement, window: WorkerWindow | None) -> InstanceSeen | None:
        """The shape one scrape of an instance showed (None: nothing on its page yet)."""
        if window is None or not window.models:
            return None
        pool = self.fleet.pools[placement.pool]
        model = window.models.get(pool.model)
        stats = model.total if model is not None else window.total
        positions = len(stats.spec.accepted_per_position) if stats.spec is not None else 0
        return InstanceSeen(
            placement.pool, placement.instance, positions, window.reset, self.clock()
        )

    def _arm(self, placement: Placement, stats: WindowStats) -> str:
        """The arm vLLM shows: off without spec-decode series, else the believed method
        at the γ its per-position series count."""
        if stats.spec is None:
            return OFF
        pool = self.fleet.pools[placement.pool]
        config = placement.config if placement.config is not None else placement.speculative
        if config is None:
            return UNKNOWN_ARM
        try:
            arm = resolve_on_pool(
                dict(config), placement.pool, pool.proposer_list(), pinnable=False
            )
        except SpecConfigError:
            return UNKNOWN_ARM
        parsed = parse_arm(arm)
        if parsed is None:
            return arm
        table = config.get("num_speculative_tokens_per_batch_size")
        if table and stats.running.mean is not None:
            # γ by batch size: the window's mean batch says which range it ran in.
            batch = max(1, round(stats.running.mean))
            for start, end, gamma in table:
                if start <= batch <= end:
                    return OFF if gamma == 0 else f"{parsed[0]}:{gamma}"
        positions = len(stats.spec.accepted_per_position)
        return f"{parsed[0]}:{positions}" if positions else arm


def _attributed(
    observation: WindowObservation, pool: str, instance: str, arm: str, cls: str
) -> WindowObservation:
    return replace(observation, pool=pool, instance=instance, arm=arm, workload_class=cls)


class ScrapeSource:
    """``collect: scrape``: each loop iteration scrapes every instance once, concurrently
    (a failing or slow instance only delays itself, up to the timeout), and closes each
    instance's window at that scrape. In the per-pod topology the one instance is the
    pod's own vLLM, which only this replica sees (``exclusive``)."""

    def __init__(
        self,
        settings: Settings,
        placements: Callable[[], Sequence[Placement]],
        *,
        fleet: Fleet | None = None,
        clock: Clock = time.time,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        options = settings.collect.scrape
        managed = settings.actuators.managed
        self.exclusive = managed is not None and managed.pod is not None
        self._placements = placements
        self._attribution = Attribution(settings, fleet or Fleet(settings), clock)
        self._client = client or httpx.AsyncClient(
            timeout=options.timeout_s, limits=httpx.Limits(max_connections=64)
        )
        self._owns_client = client is None
        stale = options.stale_after_s or 3 * settings.scrape_interval_s
        self.scraper = Scraper(
            [],
            self._client,
            clock=clock,
            rng=random.Random(),
            settings=ScraperSettings(
                interval_s=settings.scrape_interval_s,
                timeout_s=options.timeout_s,
                stale_after_s=stale,
                max_page_bytes=options.max_page_bytes,
            ),
        )
        self._where: dict[str, Placement] = {}

    async def collect(self) -> Collected:
        placements = list(self._placements())
        self._where = {f"{p.pool}/{p.url}": p for p in placements}
        self.scraper.set_targets(
            [ScrapeTarget(name, f"{p.url}/metrics") for name, p in self._where.items()]
        )
        await self.scraper.scrape_all()
        records: list[WindowStatRecord] = []
        evidence: list[WindowObservation] = []
        shapes: list[InstanceSeen] = []
        for name, placement in self._where.items():
            taken = self.scraper.take_window(name)
            status = taken.status
            if status.consecutive_failures == 0:
                shape = self._attribution.seen(placement, taken.window)
                if shape is not None:
                    shapes.append(shape)
            healthy = not status.stale and status.consecutive_failures == 0
            line = None
            if status.last_error is not None:
                line = f"scrape failed: {status.last_error}"
                if status.stale:
                    line += " (stale)"
            stored, learned = self._attribution.of(
                placement, taken.window, healthy=healthy, status=line
            )
            records += stored
            evidence += learned
        return Collected(windows=records, window_observations=evidence, instances=shapes)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class PrometheusSource:
    """``collect: prometheus``: every ``window_s`` seconds, one round of PromQL over the
    window since the last one (consecutive windows, so no evidence counts twice);
    windows of workers that are no pool's instance are ignored."""

    exclusive = False

    def __init__(
        self,
        settings: Settings,
        placements: Callable[[], Sequence[Placement]],
        *,
        fleet: Fleet | None = None,
        clock: Clock = time.time,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        options = settings.collect.prometheus
        if options is None:
            raise ValueError("collect.prometheus is not configured")
        self._placements = placements
        self._attribution = Attribution(settings, fleet or Fleet(settings), clock)
        self._client = client or httpx.AsyncClient(timeout=options.timeout_s)
        self._owns_client = client is None
        self.reader = PrometheusReader(
            base_url=options.url.rstrip("/"),
            client=self._client,
            selector=options.selector,
            worker_label=options.instance_label,
            timeout_s=options.timeout_s,
        )
        self._clock = clock
        self._window_s = max(settings.scrape_interval_s, 1.0)
        self._last_at: float | None = None

    async def collect(self) -> Collected:
        now = self._clock()
        if self._last_at is None:
            self._last_at = now - self._window_s
        range_s = now - self._last_at
        if range_s < self._window_s * 0.5:
            return Collected()
        placements = {_host_port(p.url): p for p in self._placements()}
        records: list[WindowStatRecord] = []
        evidence: list[WindowObservation] = []
        try:
            windows = await self.reader.windows(range_s, at=now)
        except Exception as exc:  # an unreachable or failing Prometheus: say so, go on
            line = f"prometheus query failed: {' '.join(str(exc).split()) or type(exc).__name__}"
            for placement in placements.values():
                stored, _ = self._attribution.of(placement, None, healthy=False, status=line)
                records += stored
            return Collected(windows=records)
        self._last_at = now
        shapes: list[InstanceSeen] = []
        for key, placement in placements.items():
            window = windows.get(key)
            if window is None:
                stored, _ = self._attribution.of(
                    placement, None, healthy=False, status="no series for it in Prometheus"
                )
                records += stored
                continue
            shape = self._attribution.seen(placement, window)
            if shape is not None:
                shapes.append(shape)
            stored, learned = self._attribution.of(placement, window, healthy=True, status=None)
            records += stored
            evidence += learned
        return Collected(windows=records, window_observations=evidence, instances=shapes)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


@dataclass(slots=True)
class CombinedSource:
    """Several sources as one: everything each collected, in order."""

    sources: Sequence[ObservationSource] = field(default_factory=tuple)

    @property
    def exclusive(self) -> bool:
        return any(getattr(s, "exclusive", False) for s in self.sources)

    async def collect(self) -> Collected:
        parts = await asyncio.gather(*(s.collect() for s in self.sources))
        return _merged(parts)

    async def collect_exclusive(self) -> Collected:
        """What only this replica sees (a follower hands it to the leader)."""
        mine = [s for s in self.sources if getattr(s, "exclusive", False)]
        return _merged(await asyncio.gather(*(s.collect() for s in mine)))

    async def aclose(self) -> None:
        for source in self.sources:
            await source.aclose()


def _merged(parts: Sequence[Collected]) -> Collected:
    return Collected(
        observations=tuple(o for p in parts for o in p.observations),
        windows=tuple(w for p in parts for w in p.windows),
        window_observations=tuple(w for p in parts for w in p.window_observations),
        routed=tuple(r for p in parts for r in p.routed),
        instances=tuple(i for p in parts for i in p.instances),
    )
