"""Window statistics of a fleet that Prometheus already scrapes, via its HTTP query API.

Instead of scraping every worker itself, specpilot asks Prometheus for each counter's
increase over a range (figures per second are that increase / range) and for the
gauges' ``avg_over_time``/``max_over_time``/``last_over_time``, all in one
round of instant queries at time ``at`` that each cover the whole fleet. The answers
are assembled by ``collectors.window.assemble_window``, the same code the direct scrape
uses, into one ``WorkerWindow`` per worker (Prometheus' ``instance`` label by default).

How the figures relate to a direct scrape of the same worker:

- Counts (``drafts``, ``accepted_tokens``…) are exact: the sample at ``at`` less the
  last one at or before ``at - range`` (``x - x offset R``), the difference of two
  scrapes, as the direct scrape computes it. So ratios (acceptance rate, mean
  acceptance length, per-position acceptance, proposed tokens per draft), latency
  quantiles and means agree with a direct scrape of the same two scrapes exactly. The
  span is that of the two samples, up to a scrape interval longer than the range;
  figures per second divide by the range. Where a series has no sample at or before the
  range's start (a worker Prometheus found inside the range), the count is
  ``increase()``'s instead: extrapolated to the range, not a whole number, and, where a
  counter's first sample in the range is small against its increase, stopped where it
  would cross zero at a limit that differs per series, so a ratio can move by a few
  percent.
- Gauges are the ``*_over_time`` of the samples inside the range.
- Restarts: a worker whose ``process_start_time_seconds`` changed, or whose counters
  reset, since that earlier sample is read from its new process only, as the direct
  scrape reads it: each counter's value, over the time since the new process started;
  flagged ``reset=True``. Without ``process_start_time_seconds`` the counts are
  ``increase()``'s (both processes, Prometheus' semantics), flagged all the same.
- The max of running/waiting summed over several engines of one worker is the sum of
  the engines' maxima (an upper bound); a vLLM worker usually has one engine.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from collectors.exposition import (
    E2E_LATENCY,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    KV_CACHE_USAGE,
    PROCESS_START_TIME,
    RUNNING,
    SPEC_ACCEPTED_PER_POS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    WAITING,
    EngineKey,
    Histogram,
)
from collectors.window import (
    EngineDelta,
    GaugeWindow,
    SpecDecodeWindow,
    WindowGauges,
    WorkerWindow,
    assemble_window,
)

_HISTOGRAMS = (INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN, E2E_LATENCY)
_GAUGES = (RUNNING, WAITING, KV_CACHE_USAGE)
_GAUGE_FUNCTIONS = ("avg_over_time", "max_over_time", "last_over_time", "count_over_time")
_RESET_COUNTERS = (SPEC_DRAFTS, GENERATION_TOKENS)


class PrometheusError(RuntimeError):
    """Prometheus could not be asked or refused a query; the message is one line."""


Counts = Literal["difference", "since_start", "increase"]
"""How a round counts a counter's events in its range: ``difference``, the sample at the
range's end less the last one at or before its start (exact; Prometheus' ``increase()``
where there is none before the start); ``since_start``, the counter's value (a process
that started inside the range); ``increase``, Prometheus' own (across a reset whose
restart time is unknown)."""

Labels = Mapping[str, str]
Vector = list[tuple[Labels, float]]


@dataclass(frozen=True, slots=True)
class PrometheusReader:
    """Reads window statistics of vLLM workers from a Prometheus server.

    ``selector`` restricts the series (PromQL label matchers without braces, e.g.
    ``job="vllm"``); ``worker_label`` names the label that tells workers apart.
    """

    base_url: str
    """E.g. ``http://prometheus:9090``."""
    client: httpx.AsyncClient
    selector: str = ""
    worker_label: str = "instance"
    timeout_s: float = 10.0

    async def windows(self, range_s: float, *, at: float) -> dict[str, WorkerWindow]:
        """Each worker's window over ``[at - range_s, at]`` (Unix seconds)."""
        results = await self._round(self.selector, range_s, at)
        starts = await self._vector(
            f"last_over_time({PROCESS_START_TIME}{self._braces(self.selector)}[{_range(range_s)}])",
            at,
        )
        start_of = {labels.get(self.worker_label, ""): value for labels, value in starts}
        restarted = await self._restarted(range_s, at)
        windows: dict[str, WorkerWindow] = {}
        for worker in results.workers():
            if worker not in restarted:
                windows[worker] = results.window(worker, range_s, reset=False)
                continue
            started = start_of.get(worker)
            since_start = None if started is None else at - started
            only = _and(self.selector, f'{self.worker_label}="{_escape(worker)}"')
            if since_start is None or not 0 < since_start < range_s:
                again = await self._round(only, range_s, at, "increase")
                windows[worker] = again.window(worker, range_s, reset=True)
                continue
            again = await self._round(only, since_start, at, "since_start")
            windows[worker] = again.window(worker, since_start, reset=True)
        return windows

    async def _restarted(self, range_s: float, at: float) -> set[str]:
        sel, window = self._braces(self.selector), _range(range_s)
        start = f"{PROCESS_START_TIME}{sel}"
        # The exact difference reaches back to the last sample at or before the range's
        # start: a restart between it and the range's first sample counts too.
        queries = [f"changes({start}[{window}])", f"{start} != bool {start} offset {window}"]
        for name in _RESET_COUNTERS:
            counter = f"{name}_total{sel}"
            queries += [
                f"resets({counter}[{window}])",
                f"{counter} < bool {counter} offset {window}",
            ]
        vectors = await asyncio.gather(*(self._vector(query, at) for query in queries))
        return {
            labels.get(self.worker_label, "")
            for vector in vectors
            for labels, value in vector
            if value > 0
        }

    async def _round(
        self, selector: str, range_s: float, at: float, counts: Counts = "difference"
    ) -> _Results:
        sel, window = self._braces(selector), _range(range_s)

        def count(series: str) -> str:
            plain = f"{series}{sel}"
            if counts == "since_start":
                return plain
            if counts == "increase":
                return f"increase({plain}[{window}])"
            return f"({plain} - {plain} offset {window}) or increase({plain}[{window}])"

        queries: dict[tuple[str, str], str] = {}
        for name in (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_ACCEPTED_PER_POS):
            queries[(name, "increase")] = count(f"{name}_total")
        queries[(GENERATION_TOKENS, "increase")] = count(f"{GENERATION_TOKENS}_total")
        for name in _HISTOGRAMS:
            for part in ("bucket", "count", "sum"):
                queries[(name, part)] = count(f"{name}_{part}")
        for name in _GAUGES:
            for function in _GAUGE_FUNCTIONS:
                queries[(name, function)] = f"{function}({name}{sel}[{window}])"
        answers = await asyncio.gather(*(self._vector(query, at) for query in queries.values()))
        return _Results(self.worker_label, dict(zip(queries, answers, strict=True)))

    async def _vector(self, query: str, at: float) -> Vector:
        try:
            response = await self.client.get(
                f"{self.base_url.rstrip('/')}/api/v1/query",
                params={"query": query, "time": f"{at:.3f}"},
                timeout=self.timeout_s,
            )
            body = response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise PrometheusError(f"query {query!r} failed: {_one_line(error)}") from error
        if not isinstance(body, dict) or body.get("status") != "success":
            detail = body.get("error") if isinstance(body, dict) else None
            raise PrometheusError(
                f"query {query!r} failed: HTTP {response.status_code} {_one_line(detail)}"
            )
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise PrometheusError(f"query {query!r} did not return an instant vector")
        vector: Vector = []
        for item in data.get("result", []):
            value = float(item["value"][1])
            if math.isfinite(value):
                vector.append((item.get("metric", {}), value))
        return vector

    def _braces(self, selector: str) -> str:
        return f"{{{selector}}}" if selector else ""


class _Results:
    """The answers of one query round, regrouped per worker and engine."""

    def __init__(self, worker_label: str, answers: Mapping[tuple[str, str], Vector]) -> None:
        self._by_engine: dict[tuple[str, str], dict[tuple[str, EngineKey], Vector]] = {}
        for query, vector in answers.items():
            grouped = self._by_engine.setdefault(query, {})
            for labels, value in vector:
                key = (
                    labels.get(worker_label, ""),
                    EngineKey(labels.get("model_name", ""), labels.get("engine", "")),
                )
                grouped.setdefault(key, []).append((labels, value))

    def workers(self) -> list[str]:
        return sorted({worker for grouped in self._by_engine.values() for worker, _ in grouped})

    def window(self, worker: str, duration_s: float, *, reset: bool) -> WorkerWindow:
        keys = sorted(
            {key for grouped in self._by_engine.values() for w, key in grouped if w == worker},
            key=lambda key: (key.model_name, key.engine),
        )
        deltas = {key: self._delta(worker, key) for key in keys}
        per_engine = {key: self._gauges(worker, key) for key in keys}

        def gauges_of(engines: Sequence[EngineKey]) -> WindowGauges:
            chosen = [per_engine[key] for key in engines]
            return WindowGauges(
                running=_combine([g.running for g in chosen], mean=False),
                waiting=_combine([g.waiting for g in chosen], mean=False),
                kv_cache_usage=_combine([g.kv_cache_usage for g in chosen], mean=True),
            )

        return assemble_window(deltas, gauges_of, duration_s=duration_s, reset=reset)

    def _values(self, query: tuple[str, str], worker: str, key: EngineKey) -> Vector:
        return self._by_engine.get(query, {}).get((worker, key), [])

    def _scalar(self, query: tuple[str, str], worker: str, key: EngineKey) -> float | None:
        values = self._values(query, worker, key)
        return values[0][1] if values else None

    def _delta(self, worker: str, key: EngineKey) -> EngineDelta:
        spec = None
        drafts = self._scalar((SPEC_DRAFTS, "increase"), worker, key)
        if drafts is not None:
            positions: dict[int, float] = {}
            for labels, value in self._values((SPEC_ACCEPTED_PER_POS, "increase"), worker, key):
                position = labels.get("position", "")
                if position.isdigit():
                    positions[int(position)] = value
            spec = SpecDecodeWindow(
                drafts=drafts,
                draft_tokens=self._scalar((SPEC_DRAFT_TOKENS, "increase"), worker, key) or 0.0,
                accepted_tokens=self._scalar((SPEC_ACCEPTED_TOKENS, "increase"), worker, key)
                or 0.0,
                accepted_per_position=tuple(
                    positions.get(i, 0.0) for i in range(max(positions, default=-1) + 1)
                ),
            )
        return EngineDelta(
            spec=spec,
            generation_tokens=self._scalar((GENERATION_TOKENS, "increase"), worker, key),
            inter_token_latency=self._histogram(INTER_TOKEN_LATENCY, worker, key),
            time_per_output_token=self._histogram(TIME_PER_OUTPUT_TOKEN, worker, key),
            time_to_first_token=self._histogram(TIME_TO_FIRST_TOKEN, worker, key),
            e2e_latency=self._histogram(E2E_LATENCY, worker, key),
        )

    def _histogram(self, name: str, worker: str, key: EngineKey) -> Histogram | None:
        buckets: dict[float, float] = {}
        for labels, value in self._values((name, "bucket"), worker, key):
            try:
                buckets[float(labels.get("le", ""))] = value
            except ValueError:
                continue
        count = self._scalar((name, "count"), worker, key)
        if not buckets and count is None:
            return None
        bounds = tuple(sorted(buckets))
        cumulative = tuple(buckets[bound] for bound in bounds)
        if count is None:
            count = cumulative[-1] if cumulative else 0.0
        return Histogram(bounds, cumulative, count, self._scalar((name, "sum"), worker, key) or 0.0)

    def _gauges(self, worker: str, key: EngineKey) -> WindowGauges:
        def gauge(name: str) -> GaugeWindow:
            mean, peak, latest, samples = (
                self._scalar((name, function), worker, key) for function in _GAUGE_FUNCTIONS
            )
            return GaugeWindow(mean, peak, latest, int(samples or 0))

        return WindowGauges(gauge(RUNNING), gauge(WAITING), gauge(KV_CACHE_USAGE))


def _combine(windows: Sequence[GaugeWindow], *, mean: bool) -> GaugeWindow:
    present = [window for window in windows if window.samples > 0]
    if not present:
        return GaugeWindow(None, None, None, 0)

    def fold(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        if not known:
            return None
        return math.fsum(known) / len(known) if mean else math.fsum(known)

    peaks = [w.max for w in present]
    return GaugeWindow(
        mean=fold([w.mean for w in present]),
        max=max((p for p in peaks if p is not None), default=None) if mean else fold(peaks),
        latest=fold([w.latest for w in present]),
        samples=max(w.samples for w in present),
    )


def _range(seconds: float) -> str:
    # PromQL durations take whole units; milliseconds keep sub-second precision.
    return f"{max(1, round(seconds * 1000))}ms"


def _and(selector: str, matcher: str) -> str:
    return f"{selector},{matcher}" if selector else matcher


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _one_line(value: object) -> str:
    return " ".join(str(value).split())[:200]
