"""Scrape the ``/metrics`` pages of N vLLM workers and keep what window statistics need.

Each target runs in its own asyncio task on its own schedule: a per-target timeout
covers the whole request (connect, headers and a trickling body), failures back off
exponentially, and every delay is jittered so that a fleet does not get scraped in
lock-step. A failing, slow or garbage-serving target therefore only ever delays itself.

Memory is bounded per target whatever the fleet does: the snapshot that opened the
current window, the latest snapshot, and at most ``max_gauge_readings`` gauge readings
(the gauges are what the window's mean/max need in between); pages larger than
``max_page_bytes`` are refused. ``take_window`` hands the window out and opens the next.

Clock, sleep and RNG are injected; in the service they are ``time.time`` (Unix seconds:
snapshots are compared with the worker's ``process_start_time_seconds``),
``asyncio.sleep`` and a seeded ``random.Random``.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from collectors.exposition import WorkerSnapshot, parse_exposition
from collectors.window import (
    GaugeReading,
    WorkerWindow,
    counters_went_back,
    gauge_reading,
    worker_window,
)

# Ask for the classic text format; prometheus_client would otherwise negotiate OpenMetrics.
_ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    name: str
    """Stable name of the worker (e.g. ``pool-a/10.0.0.7:8000``)."""
    url: str
    """Its metrics URL, e.g. ``http://10.0.0.7:8000/metrics``."""


@dataclass(frozen=True, slots=True)
class ScraperSettings:
    interval_s: float = 15.0
    """Time between two scrapes of a healthy target."""
    timeout_s: float = 5.0
    """Whole-request budget per scrape, body included."""
    jitter: float = 0.1
    """Each delay is multiplied by a uniform factor in [1 - jitter, 1 + jitter]."""
    max_backoff_s: float = 300.0
    """Ceiling of the exponential back-off (interval × 2^(failures - 1))."""
    stale_after_s: float = 45.0
    """A target with no successful scrape for this long is stale; its figures are old."""
    max_gauge_readings: int = 128
    """Gauge readings kept per window; older ones are dropped (mean/max over the rest)."""
    max_page_bytes: int = 4 * 1024 * 1024
    """Larger pages are refused; a real vLLM page is well under 1 MiB."""


@dataclass(frozen=True, slots=True)
class TargetStatus:
    name: str
    url: str
    stale: bool
    """No successful scrape within ``stale_after_s`` (or ever)."""
    consecutive_failures: int
    last_success_at: float | None
    """Clock time of the last successful scrape."""
    last_error: str | None
    """One line describing the last failure, None after a success."""
    next_scrape_at: float | None
    """Clock time the target is due next (None before the scraper runs)."""


@dataclass(frozen=True, slots=True)
class TargetWindow:
    """A target's window as ``take_window`` hands it out."""

    status: TargetStatus
    window: WorkerWindow | None
    """None until the target was scraped successfully at least once."""
    scrapes: int
    """Successful scrapes that fell in the window (its ends included)."""


class _TargetState:
    """Per-target memory: two snapshots, a bounded deque of gauge readings, counters."""

    def __init__(self, target: ScrapeTarget, max_gauge_readings: int) -> None:
        self.target = target
        self.first: WorkerSnapshot | None = None
        self.latest: WorkerSnapshot | None = None
        self.restarted = False
        self.gauges: deque[GaugeReading] = deque(maxlen=max_gauge_readings)
        self.scrapes = 0
        self.consecutive_failures = 0
        self.last_success_at: float | None = None
        self.last_error: str | None = None
        self.next_scrape_at: float | None = None

    def record(self, snapshot: WorkerSnapshot, now: float) -> None:
        if self.latest is None:
            self.first = snapshot
        elif counters_went_back(self.latest, snapshot):
            # The window continues from the new process' counters alone.
            self.first, self.restarted = None, True
        self.latest = snapshot
        self.gauges.append(gauge_reading(snapshot))
        self.scrapes += 1
        self.consecutive_failures = 0
        self.last_success_at = now
        self.last_error = None


class Scraper:
    """Scrapes ``targets`` with ``client`` until cancelled (``run``), or on demand.

    The caller owns ``client``; its connection limits should fit the fleet (httpx pools
    100 connections by default, and a request waiting for one counts against its
    target's timeout).
    """

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        client: httpx.AsyncClient,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        settings: ScraperSettings | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings or ScraperSettings()
        self._client = client
        self._clock = clock
        self._rng = rng
        self._sleep = sleep
        self._states: dict[str, _TargetState] = {}
        for target in targets:
            if target.name in self._states:
                raise ValueError(f"duplicate scrape target name {target.name!r}")
            self._states[target.name] = _TargetState(target, self.settings.max_gauge_readings)

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(self._states)

    def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
        """Scrape these from now on: targets kept keep their windows; a target whose URL
        changed starts afresh (it is another process). For fleets whose instances come
        and go (a managed pool's new instance); use with ``scrape``/``scrape_all``."""
        wanted = {target.name: target for target in targets}
        if len(wanted) != len(targets):
            raise ValueError("duplicate scrape target names")
        for name in [n for n in self._states if n not in wanted]:
            del self._states[name]
        for name, target in wanted.items():
            state = self._states.get(name)
            if state is None or state.target.url != target.url:
                self._states[name] = _TargetState(target, self.settings.max_gauge_readings)

    async def run(self) -> None:
        """Scrape every target on its own schedule until the task is cancelled."""
        async with asyncio.TaskGroup() as group:
            for name in self._states:
                group.create_task(self._run_target(name))

    async def scrape_all(self) -> Mapping[str, bool]:
        """Scrape every target once, concurrently; True where the scrape succeeded."""
        names = list(self._states)
        results = await asyncio.gather(*(self.scrape(name) for name in names))
        return dict(zip(names, results, strict=True))

    async def scrape(self, name: str) -> bool:
        """Scrape one target once and record the outcome; never raises for the target's
        faults (refused connection, timeout, HTTP error, oversized or garbage page)."""
        state = self._states[name]
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                text = await self._fetch(state.target.url)
            snapshot = parse_exposition(text, scraped_at=self._clock())
        except Exception as error:
            # Expected: httpx.HTTPError, TimeoutError, ExpositionError, _PageError. Anything
            # else (a malformed URL, a client bug) still stays this target's failure: one
            # target must never take the others' tasks down with it.
            self._failed(state, describe_error(error))
            return False
        state.record(snapshot, self._clock())
        state.next_scrape_at = self._clock() + self._jittered(self.settings.interval_s)
        return True

    def status(self, name: str) -> TargetStatus:
        state = self._states[name]
        now = self._clock()
        stale = (
            state.last_success_at is None
            or now - state.last_success_at > self.settings.stale_after_s
        )
        return TargetStatus(
            name=name,
            url=state.target.url,
            stale=stale,
            consecutive_failures=state.consecutive_failures,
            last_success_at=state.last_success_at,
            last_error=state.last_error,
            next_scrape_at=state.next_scrape_at,
        )

    def peek_window(self, name: str) -> TargetWindow:
        """The current window of a target, without closing it."""
        state = self._states[name]
        window = None
        if state.latest is not None:
            window = worker_window(
                state.first, state.latest, list(state.gauges), restarted=state.restarted
            )
        return TargetWindow(self.status(name), window, state.scrapes)

    def take_window(self, name: str) -> TargetWindow:
        """The current window of a target; the next window starts at its latest scrape."""
        result = self.peek_window(name)
        state = self._states[name]
        if state.latest is not None:
            state.first, state.restarted = state.latest, False
            state.gauges.clear()
            state.gauges.append(gauge_reading(state.latest))
            state.scrapes = 1
        return result

    async def _run_target(self, name: str) -> None:
        state = self._states[name]
        # Spread the first scrapes over one interval so that N targets do not start at once.
        state.next_scrape_at = self._clock() + self._rng.uniform(0.0, self.settings.interval_s)
        while True:
            await self._sleep(max(0.0, state.next_scrape_at - self._clock()))
            await self.scrape(name)

    async def _fetch(self, url: str) -> str:
        limit = self.settings.max_page_bytes
        async with self._client.stream("GET", url, headers={"Accept": _ACCEPT}) as response:
            if response.status_code != 200:
                raise _PageError(f"HTTP {response.status_code}")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _PageError(f"page of {declared} bytes exceeds {limit}")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _PageError(f"page exceeds {limit} bytes")
                chunks.append(chunk)
        try:
            return b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as error:
            raise _PageError("page is not UTF-8 text") from error

    def _failed(self, state: _TargetState, error: str) -> None:
        state.consecutive_failures += 1
        state.last_error = error
        backoff = self.settings.interval_s * 2.0 ** (state.consecutive_failures - 1)
        delay = min(self.settings.max_backoff_s, backoff)
        state.next_scrape_at = self._clock() + self._jittered(delay)

    def _jittered(self, delay: float) -> float:
        jitter = self.settings.jitter
        return delay * self._rng.uniform(1.0 - jitter, 1.0 + jitter)


class _PageError(Exception):
    """The target answered, but not with a usable page."""


def describe_error(error: BaseException) -> str:
    """One line for a failed request: "timed out", else the error type and its message."""
    if isinstance(error, TimeoutError):
        return "timed out"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
