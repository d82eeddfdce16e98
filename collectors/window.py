"""Window statistics of one vLLM worker from two snapshots (or one: since process start).

Figures are computed per ``model_name`` and per ``engine``, and summed over engines
(and over models for the worker total). Each figure's docstring gives the PromQL that
computes the same thing over a Prometheus range ``[$w]``; ``collectors.promql`` runs
those queries for fleets that Prometheus already scrapes.

Rules that operators' hand-written PromQL often gets wrong, made explicit here:

- Counter resets. When any counter went down (or ``process_start_time_seconds``
  changed) the worker restarted inside the window; the window is then computed from the
  new process' counters alone and flagged ``reset=True``.
- No spec-decode series at all means speculation is off: ``spec`` is None, not an error.
- A zero denominator is "no data": None, never 0 and never a division error.
- Ratios are clamped to [0, 1]: a scrape is not atomic (vLLM bumps the drafts counter
  before the accepted counters), so two snapshots taken mid-update can disagree by one
  verify step.
- ``vllm:inter_token_latency_seconds`` is observed once per engine step per request; with
  speculation one step emits several tokens, so it is not a per-token latency. The
  per-token figure is ``vllm:request_time_per_output_token_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from collectors.exposition import (
    EngineKey,
    EngineSnapshot,
    Histogram,
    SpecDecodeCounters,
    WorkerSnapshot,
)

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class SpecDecodeWindow:
    """Spec-decode counter increases over the window (whole numbers, as floats)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: tuple[float, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens, in [0, 1]; None when none were proposed.

        PromQL: ``increase(vllm:spec_decode_num_accepted_tokens_total[$w])
        / increase(vllm:spec_decode_num_draft_tokens_total[$w])``
        """
        return _ratio(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts plus the bonus token), ≥ 1.

        PromQL: ``1 + increase(vllm:spec_decode_num_accepted_tokens_total[$w])
        / increase(vllm:spec_decode_num_drafts_total[$w])``
        """
        if self.drafts <= 0:
            return None
        return 1.0 + max(self.accepted_tokens, 0.0) / self.drafts

    @property
    def mean_proposed_tokens_per_draft(self) -> float | None:
        """Draft tokens proposed per verify step; n-gram often proposes fewer than γ.

        PromQL: ``increase(vllm:spec_decode_num_draft_tokens_total[$w])
        / increase(vllm:spec_decode_num_drafts_total[$w])``
        """
        if self.drafts <= 0:
            return None
        return max(self.draft_tokens, 0.0) / self.drafts

    @property
    def per_position_acceptance(self) -> tuple[float | None, ...]:
        """Share of verify steps whose draft token at position i was accepted, position 0
        first, each in [0, 1] and non-increasing in vLLM's prefix acceptance.

        PromQL: ``increase(vllm:spec_decode_num_accepted_tokens_per_pos_total[$w])
        / ignoring(position) group_left increase(vllm:spec_decode_num_drafts_total[$w])``
        """
        return tuple(_ratio(accepted, self.drafts) for accepted in self.accepted_per_position)

    @property
    def conditional_acceptance(self) -> tuple[float | None, ...]:
        """Probability that position i is accepted given position i-1 was, in [0, 1]:
        the per-position curve divided by its predecessor (position 0: itself). None where
        the predecessor has no data or is 0.

        PromQL (i > 0): ``increase(...per_pos_total{position="i"}[$w])
        / ignoring(position) increase(...per_pos_total{position="i-1"}[$w])``
        """
        curve = self.per_position_acceptance
        conditional: list[float | None] = []
        for i, share in enumerate(curve):
            if i == 0:
                conditional.append(share)
                continue
            previous = curve[i - 1]
            if share is None or previous is None or previous <= 0:
                conditional.append(None)
            else:
                conditional.append(min(1.0, share / previous))
        return tuple(conditional)


@dataclass(frozen=True, slots=True)
class GaugeWindow:
    """A gauge over the window's scrapes: mean and max of the readings, and the latest."""

    mean: float | None
    """PromQL: ``avg_over_time(<gauge>[$w])``."""
    max: float | None
    """PromQL: ``max_over_time(<gauge>[$w])``."""
    latest: float | None
    """PromQL: ``<gauge>``."""
    samples: int

    @classmethod
    def of(cls, readings: Sequence[float | None]) -> GaugeWindow:
        values = [value for value in readings if value is not None]
        if not values:
            return cls(None, None, None, 0)
        return cls(math.fsum(values) / len(values), max(values), values[-1], len(values))


@dataclass(frozen=True, slots=True)
class LatencyWindow:
    """A latency histogram's increase over the window, in seconds.

    Quantiles interpolate linearly inside a bucket, as PromQL's
    ``histogram_quantile(q, sum by (le) (increase(<name>_bucket[$w])))`` does, so a
    quantile is only as precise as the bucket bounds; one in the +Inf bucket is
    reported as the highest finite bound.
    """

    count: float
    sum_s: float
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None

    @property
    def mean_s(self) -> float | None:
        """PromQL: ``increase(<name>_sum[$w]) / increase(<name>_count[$w])``."""
        if self.count <= 0:
            return None
        return max(self.sum_s, 0.0) / self.count

    @classmethod
    def of(cls, histogram: Histogram) -> LatencyWindow:
        p50, p90, p99 = (histogram_quantile(q, histogram) for q in QUANTILES)
        return cls(histogram.count, histogram.sum, p50, p90, p99)


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What one engine (or a sum of engines) did during the window."""

    duration_s: float | None
    """Seconds the counters cover; None when unknown (dumps read from files)."""
    reset: bool
    """The worker restarted inside the window; counters are the new process' only."""
    spec: SpecDecodeWindow | None
    """None when no spec-decode series were on the page: speculation is off."""
    generation_tokens: float | None
    running: GaugeWindow
    """Requests in the running batch (``vllm:num_requests_running``), summed over engines."""
    waiting: GaugeWindow
    """Requests queued (``vllm:num_requests_waiting``), summed over engines."""
    kv_cache_usage: GaugeWindow
    """KV-cache usage fraction in [0, 1], averaged over engines."""
    inter_token_latency: LatencyWindow | None
    """Per engine step and request, not per token (``vllm:inter_token_latency_seconds``)."""
    time_per_output_token: LatencyWindow | None
    """Per output token (``vllm:request_time_per_output_token_seconds``)."""
    time_to_first_token: LatencyWindow | None
    e2e_latency: LatencyWindow | None

    @property
    def generation_tokens_per_s(self) -> float | None:
        """Output tokens per second over the window.

        PromQL: ``rate(vllm:generation_tokens_total[$w])``
        """
        if self.generation_tokens is None or not self.duration_s or self.duration_s <= 0:
            return None
        return max(self.generation_tokens, 0.0) / self.duration_s


@dataclass(frozen=True, slots=True)
class ModelWindow:
    """One served model: summed over its engines, and per engine (by engine label)."""

    model_name: str
    total: WindowStats
    engines: Mapping[str, WindowStats]


@dataclass(frozen=True, slots=True)
class WorkerWindow:
    """One worker's window: the total over all models and engines, and per model."""

    total: WindowStats
    models: Mapping[str, ModelWindow]

    @property
    def reset(self) -> bool:
        return self.total.reset


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """The gauges of one engine at one scrape: what the window keeps between its ends."""

    running: float | None
    waiting: float | None
    kv_cache_usage: float | None


GaugeReading = Mapping[EngineKey, EngineGauges]
"""The gauges of every engine of a worker at one scrape."""


def gauge_reading(snapshot: WorkerSnapshot) -> GaugeReading:
    return {
        key: EngineGauges(engine.running, engine.waiting, engine.kv_cache_usage)
        for key, engine in snapshot.engines.items()
    }


def worker_window(
    start: WorkerSnapshot | None,
    end: WorkerSnapshot,
    gauge_readings: Sequence[GaugeReading] | None = None,
    *,
    restarted: bool = False,
) -> WorkerWindow:
    """The window between two snapshots of the same worker (``start`` None: since the
    process started). ``gauge_readings`` are the gauges of every scrape in the window,
    oldest first; by default those of ``start`` and ``end``. ``restarted`` says the
    caller saw the worker restart between intermediate scrapes (which the two ends alone
    may not show once the new process' counters overtook the old ones).
    """
    reset = restarted or (start is not None and counters_went_back(start, end))
    baseline = None if reset else start
    duration = _duration(baseline, end)
    if gauge_readings is None:
        ends = (end,) if baseline is None else (baseline, end)
        gauge_readings = [gauge_reading(snapshot) for snapshot in ends]
    deltas = {
        key: EngineDelta.between(None if baseline is None else baseline.engines.get(key), engine)
        for key, engine in end.engines.items()
    }
    return assemble_window(
        deltas, _gauges_from_readings(gauge_readings), duration_s=duration, reset=reset
    )


@dataclass(frozen=True, slots=True)
class WindowGauges:
    """The gauges of one engine, or of several combined, over a window."""

    running: GaugeWindow
    waiting: GaugeWindow
    kv_cache_usage: GaugeWindow


GaugesOf = Callable[[Sequence[EngineKey]], WindowGauges]
"""Gauges over the window for a set of engines: summed running/waiting, mean KV usage."""


def assemble_window(
    deltas: Mapping[EngineKey, EngineDelta],
    gauges_of: GaugesOf,
    *,
    duration_s: float | None,
    reset: bool,
) -> WorkerWindow:
    """Per-engine increases and gauges → the window per engine, per model and in total.

    The one place where engines are summed, shared by the direct scrape
    (``worker_window``) and the Prometheus reader (``collectors.promql``).
    """

    def stats(keys: Sequence[EngineKey]) -> WindowStats:
        def latency(name: str) -> LatencyWindow | None:
            histogram = _sum_histograms(getattr(deltas[key], name) for key in keys)
            return None if histogram is None else LatencyWindow.of(histogram)

        gauges = gauges_of(keys)
        return WindowStats(
            duration_s=duration_s,
            reset=reset,
            spec=_sum_spec(deltas[key].spec for key in keys),
            generation_tokens=_sum_or_none(deltas[key].generation_tokens for key in keys),
            running=gauges.running,
            waiting=gauges.waiting,
            kv_cache_usage=gauges.kv_cache_usage,
            inter_token_latency=latency("inter_token_latency"),
            time_per_output_token=latency("time_per_output_token"),
            time_to_first_token=latency("time_to_first_token"),
            e2e_latency=latency("e2e_latency"),
        )

    models: dict[str, ModelWindow] = {}
    for model_name in sorted({key.model_name for key in deltas}):
        keys = [key for key in deltas if key.model_name == model_name]
        models[model_name] = ModelWindow(
            model_name, stats(keys), {key.engine: stats([key]) for key in keys}
        )
    return WorkerWindow(stats(list(deltas)), models)


def counters_went_back(start: WorkerSnapshot, end: WorkerSnapshot) -> bool:
    """True when the worker restarted between the snapshots: its process start time
    changed, or any counter of an engine present in both went down.

    PromQL: ``resets(vllm:generation_tokens_total[$w]) > 0`` (and the same for each
    counter; ``changes(process_start_time_seconds[$w]) > 0``).
    """
    if (
        start.process_start_time_s is not None
        and end.process_start_time_s is not None
        and start.process_start_time_s != end.process_start_time_s
    ):
        return True
    for key, before in start.engines.items():
        after = end.engines.get(key)
        if after is not None and any(
            later < earlier for earlier, later in _counter_pairs(before, after)
        ):
            return True
    return False


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """PromQL's ``histogram_quantile``: linear interpolation inside the bucket holding
    rank ``q × count``; the first bucket starts at 0; the +Inf bucket gives the highest
    finite bound. None without observations or finite buckets."""
    bounds, counts = histogram.upper_bounds, histogram.cumulative_counts
    if not counts or counts[-1] <= 0 or len(bounds) < 2 or not 0.0 <= q <= 1.0:
        return None
    rank = q * counts[-1]
    index = next(i for i, cumulative in enumerate(counts) if cumulative >= rank)
    if math.isinf(bounds[index]):
        return bounds[-2]
    lower = bounds[index - 1] if index > 0 else min(0.0, bounds[0])
    below = counts[index - 1] if index > 0 else 0.0
    in_bucket = counts[index] - below
    if in_bucket <= 0:
        return bounds[index]
    return lower + (bounds[index] - lower) * (rank - below) / in_bucket


def _ratio(numerator: float, denominator: float) -> float | None:
    if denominator <= 0:
        return None
    return min(1.0, max(0.0, numerator / denominator))


def _duration(start: WorkerSnapshot | None, end: WorkerSnapshot) -> float | None:
    if end.scraped_at is None:
        return None
    began = end.process_start_time_s if start is None else start.scraped_at
    if began is None:
        return None
    return end.scraped_at - began


def _counter_pairs(before: EngineSnapshot, after: EngineSnapshot) -> Iterable[tuple[float, float]]:
    if before.spec is not None and after.spec is not None:
        yield before.spec.drafts, after.spec.drafts
        yield before.spec.draft_tokens, after.spec.draft_tokens
        yield before.spec.accepted_tokens, after.spec.accepted_tokens
        yield from zip(
            before.spec.accepted_per_position, after.spec.accepted_per_position, strict=False
        )
    if before.generation_tokens is not None and after.generation_tokens is not None:
        yield before.generation_tokens, after.generation_tokens
    for name in _HISTOGRAMS:
        earlier, later = getattr(before, name), getattr(after, name)
        if earlier is not None and later is not None:
            yield earlier.count, later.count


_HISTOGRAMS = ("inter_token_latency", "time_per_output_token", "time_to_first_token", "e2e_latency")


@dataclass(frozen=True, slots=True)
class EngineDelta:
    """Counter and histogram increases of one engine over the window."""

    spec: SpecDecodeWindow | None
    generation_tokens: float | None
    inter_token_latency: Histogram | None = None
    time_per_output_token: Histogram | None = None
    time_to_first_token: Histogram | None = None
    e2e_latency: Histogram | None = None

    @classmethod
    def between(cls, before: EngineSnapshot | None, after: EngineSnapshot) -> EngineDelta:
        """Increases from ``before`` (None: from zero, i.e. since process start)."""

        def histogram(name: str) -> Histogram | None:
            return _histogram_delta(getattr(before, name, None), getattr(after, name))

        return cls(
            _spec_delta(before.spec if before else None, after.spec),
            _minus(after.generation_tokens, before.generation_tokens if before else None),
            inter_token_latency=histogram("inter_token_latency"),
            time_per_output_token=histogram("time_per_output_token"),
            time_to_first_token=histogram("time_to_first_token"),
            e2e_latency=histogram("e2e_latency"),
        )


def _minus(after: float | None, before: float | None) -> float | None:
    if after is None:
        return None
    return max(0.0, after - (before or 0.0))


def _spec_delta(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> SpecDecodeWindow | None:
    if after is None:
        return None
    zero = SpecDecodeCounters(0.0, 0.0, 0.0)
    before = before or zero
    earlier = before.accepted_per_position
    return SpecDecodeWindow(
        drafts=max(0.0, after.drafts - before.drafts),
        draft_tokens=max(0.0, after.draft_tokens - before.draft_tokens),
        accepted_tokens=max(0.0, after.accepted_tokens - before.accepted_tokens),
        accepted_per_position=tuple(
            max(0.0, value - (earlier[i] if i < len(earlier) else 0.0))
            for i, value in enumerate(after.accepted_per_position)
        ),
    )


def _histogram_delta(before: Histogram | None, after: Histogram | None) -> Histogram | None:
    if after is None:
        return None
    if before is None:
        return after
    if before.upper_bounds != after.upper_bounds:
        # Bounds change only with a new configuration, i.e. a restart; no common base.
        return None
    return Histogram(
        after.upper_bounds,
        tuple(
            max(0.0, b - a)
            for a, b in zip(before.cumulative_counts, after.cumulative_counts, strict=True)
        ),
        max(0.0, after.count - before.count),
        max(0.0, after.sum - before.sum),
    )


def _sum_histograms(histograms: Iterable[Histogram | None]) -> Histogram | None:
    present = [histogram for histogram in histograms if histogram is not None]
    if not present:
        return None
    bounds = present[0].upper_bounds
    # Engines of one vLLM share bucket bounds; one that does not cannot be added bucket-wise.
    same = [histogram for histogram in present if histogram.upper_bounds == bounds]
    return Histogram(
        bounds,
        tuple(
            math.fsum(column) for column in zip(*(h.cumulative_counts for h in same), strict=True)
        ),
        math.fsum(h.count for h in same),
        math.fsum(h.sum for h in same),
    )


def _sum_spec(windows: Iterable[SpecDecodeWindow | None]) -> SpecDecodeWindow | None:
    present = [window for window in windows if window is not None]
    if not present:
        return None
    depth = max(len(window.accepted_per_position) for window in present)
    return SpecDecodeWindow(
        drafts=math.fsum(window.drafts for window in present),
        draft_tokens=math.fsum(window.draft_tokens for window in present),
        accepted_tokens=math.fsum(window.accepted_tokens for window in present),
        accepted_per_position=tuple(
            math.fsum(
                window.accepted_per_position[i]
                for window in present
                if i < len(window.accepted_per_position)
            )
            for i in range(depth)
        ),
    )


def _sum_or_none(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return math.fsum(present) if present else None


def _mean_or_none(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return math.fsum(present) / len(present) if present else None


def _gauges_from_readings(readings: Sequence[GaugeReading]) -> GaugesOf:
    # Combine engines per scrape first, then over scrapes: the max of a sum is not the
    # sum of the maxima.
    def gauges_of(keys: Sequence[EngineKey]) -> WindowGauges:
        def over_window(
            name: str, combine: Callable[[Iterable[float | None]], float | None]
        ) -> GaugeWindow:
            return GaugeWindow.of(
                [
                    combine(getattr(reading[key], name) for key in keys if key in reading)
                    for reading in readings
                ]
            )

        return WindowGauges(
            running=over_window("running", _sum_or_none),
            waiting=over_window("waiting", _sum_or_none),
            kv_cache_usage=over_window("kv_cache_usage", _mean_or_none),
        )

    return gauges_of


JsonObject = dict[str, object]


def stats_json(stats: WindowStats) -> JsonObject:
    """One window as a JSON object: the ``specpilot metrics --json`` contract.

    Counts are integers, times seconds, ratios in [0, 1]; "no data" is null.
    ``per_position_acceptance`` and ``conditional_acceptance`` are lists, position 0
    first; ``speculation`` is false when the page had no spec-decode series.
    """
    spec = stats.spec
    return {
        "speculation": spec is not None,
        "acceptance_rate": spec.acceptance_rate if spec else None,
        "mean_acceptance_length": spec.mean_acceptance_length if spec else None,
        "mean_proposed_tokens_per_draft": spec.mean_proposed_tokens_per_draft if spec else None,
        "per_position_acceptance": list(spec.per_position_acceptance) if spec else [],
        "conditional_acceptance": list(spec.conditional_acceptance) if spec else [],
        "drafts": _whole(spec.drafts) if spec else None,
        "draft_tokens": _whole(spec.draft_tokens) if spec else None,
        "accepted_tokens": _whole(spec.accepted_tokens) if spec else None,
        "accepted_per_position": [_whole(v) for v in spec.accepted_per_position] if spec else [],
        "reset": stats.reset,
        "duration_s": stats.duration_s,
        "generation_tokens": _whole(stats.generation_tokens),
        "generation_tokens_per_s": stats.generation_tokens_per_s,
        "running": _gauge_json(stats.running),
        "waiting": _gauge_json(stats.waiting),
        "kv_cache_usage": _gauge_json(stats.kv_cache_usage),
        "inter_token_latency_per_step": _latency_json(stats.inter_token_latency),
        "time_per_output_token": _latency_json(stats.time_per_output_token),
        "time_to_first_token": _latency_json(stats.time_to_first_token),
        "e2e_latency": _latency_json(stats.e2e_latency),
    }


def worker_json(window: WorkerWindow) -> JsonObject:
    """The worker's window as JSON: the totals at the top level (summed over engines, and
    over models should a page carry several), and each model under ``models`` with its
    engines under ``engines``."""
    return {
        **stats_json(window.total),
        "models": {
            name: {
                **stats_json(model.total),
                "engines": {engine: stats_json(s) for engine, s in model.engines.items()},
            }
            for name, model in window.models.items()
        },
    }


def _whole(value: float | None) -> float | int | None:
    if value is None:
        return None
    return int(value) if value.is_integer() else value


def _gauge_json(gauge: GaugeWindow) -> JsonObject:
    return {"mean": gauge.mean, "max": gauge.max, "latest": gauge.latest, "samples": gauge.samples}


def _latency_json(latency: LatencyWindow | None) -> JsonObject | None:
    if latency is None:
        return None
    return {
        "count": _whole(latency.count),
        "mean_s": latency.mean_s,
        "p50_s": latency.p50_s,
        "p90_s": latency.p90_s,
        "p99_s": latency.p99_s,
    }
