"""vLLM's Prometheus exposition text → typed snapshots of the series specpilot uses.

A ``/metrics`` page of vLLM 0.32 carries a few hundred series; specpilot reads about a
dozen families (see ``USED_FAMILIES``) and ignores the rest. The series (name and labels)
of the used lines are parsed by ``prometheus_client``'s own parser, not by a hand-written
one, once per distinct series (they repeat on every scrape); the value after them is a
float. Lines of other series are only checked for shape (a name, optional labels, a
number), because fully parsing several hundred unused histogram buckets per worker is
most of the cost at fleet scale (``bench/scale.py`` measures it). Anything that is not
exposition text raises ``ExpositionError`` with a one-line message.

Every vLLM series carries the labels ``model_name`` and ``engine`` (the engine-core
index, a string such as ``"0"``); a snapshot groups the series by that pair.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
PROCESS_START_TIME = "process_start_time_seconds"

COUNTER_FAMILIES = (
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POS,
    GENERATION_TOKENS,
)
GAUGE_FAMILIES = (RUNNING, WAITING, KV_CACHE_USAGE)
HISTOGRAM_FAMILIES = (
    INTER_TOKEN_LATENCY,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    E2E_LATENCY,
)
MAX_SPEC_POSITIONS = 64
"""Draft positions read at most; a larger ``position`` label is not a real γ (and would
cost memory), so it is ignored."""
USED_FAMILIES = (*COUNTER_FAMILIES, *GAUGE_FAMILIES, *HISTOGRAM_FAMILIES, PROCESS_START_TIME)
"""Metric families specpilot reads; every other series on the page is ignored."""

# Sample names as they appear on the page, mapped to (family, part). Counters carry the
# `_total` suffix on the wire; histograms are spread over `_bucket`, `_count` and `_sum`.
_USED_SAMPLES: dict[str, tuple[str, str]] = {
    **{f"{name}_total": (name, "counter") for name in COUNTER_FAMILIES},
    **{name: (name, "gauge") for name in GAUGE_FAMILIES},
    **{f"{name}_bucket": (name, "bucket") for name in HISTOGRAM_FAMILIES},
    **{f"{name}_count": (name, "count") for name in HISTOGRAM_FAMILIES},
    **{f"{name}_sum": (name, "sum") for name in HISTOGRAM_FAMILIES},
    PROCESS_START_TIME: (PROCESS_START_TIME, "gauge"),
}

# The shape of one sample line of the text format (version 0.0.4): a metric name,
# optional labels in braces, a value and an optional integer timestamp. Only used to
# reject non-exposition text among the lines that are not handed to the real parser.
_SAMPLE_LINE = re.compile(
    r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_NAME_END = re.compile(r"[{ \t]")


class ExpositionError(ValueError):
    """The text is not Prometheus exposition text; the message is one line."""


@dataclass(frozen=True, slots=True)
class EngineKey:
    """One vLLM engine core of one served model, as the labels name it."""

    model_name: str
    engine: str


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative Prometheus histogram of one series.

    ``upper_bounds`` ascend and end with ``inf``; ``cumulative_counts[i]`` counts the
    observations ≤ ``upper_bounds[i]``. ``sum`` is in the histogram's unit (seconds for
    every histogram specpilot reads).
    """

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    count: float
    sum: float


@dataclass(frozen=True, slots=True)
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters of one engine since its process started.

    Counts are floats because Prometheus counters are; they hold whole numbers.
    """

    drafts: float
    """Verify steps that carried draft tokens (``vllm:spec_decode_num_drafts_total``)."""
    draft_tokens: float
    """Draft tokens proposed (``vllm:spec_decode_num_draft_tokens_total``)."""
    accepted_tokens: float
    """Draft tokens accepted (``vllm:spec_decode_num_accepted_tokens_total``)."""
    accepted_per_position: tuple[float, ...] = ()
    """Accepted tokens at draft position i, position 0 first
    (``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``); its length
    is the configured γ (``num_speculative_tokens``)."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The series specpilot uses of one engine at one scrape; None = not on the page."""

    key: EngineKey
    spec: SpecDecodeCounters | None = None
    """None when the page has no spec-decode series: speculation is off."""
    generation_tokens: float | None = None
    """Output tokens generated since process start (``vllm:generation_tokens_total``)."""
    running: float | None = None
    """Requests in the running batch (``vllm:num_requests_running``)."""
    waiting: float | None = None
    """Requests queued (``vllm:num_requests_waiting``)."""
    kv_cache_usage: float | None = None
    """KV-cache usage as a fraction in [0, 1] (``vllm:kv_cache_usage_perc``)."""
    inter_token_latency: Histogram | None = None
    """Seconds per engine step per request (not per token: with speculation one step
    emits several tokens)."""
    time_per_output_token: Histogram | None = None
    """Seconds per output token, one observation per finished request."""
    time_to_first_token: Histogram | None = None
    e2e_latency: Histogram | None = None


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One scrape of one vLLM worker (one ``/metrics`` page)."""

    engines: Mapping[EngineKey, EngineSnapshot] = field(default_factory=dict)
    process_start_time_s: float | None = None
    """Unix time the worker process started (``process_start_time_seconds``), when the
    page has it; a change means the worker restarted."""
    scraped_at: float | None = None
    """Unix seconds (the scraper's injected wall clock) when the page was read; None for
    a file. Wall-clock because a window since process start is measured from
    ``process_start_time_s``."""

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(sorted({key.model_name for key in self.engines}))


def parse_exposition(text: str, *, scraped_at: float | None = None) -> WorkerSnapshot:
    """Parse one ``/metrics`` page into a snapshot of the series specpilot uses.

    Raises ``ExpositionError`` when the text is not Prometheus exposition text.
    Samples whose value is not finite (NaN, ±Inf) are treated as absent.
    """
    builder = _SnapshotBuilder()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line or line[0] == "#" or line.isspace():
            continue
        match = _NAME_END.search(line)
        name = line[: match.start()] if match else line
        if name not in _USED_SAMPLES:
            _check_sample_line(line, number)
            continue
        # The series (name and labels) is everything up to the closing brace; the value
        # and an optional timestamp follow.
        end = line.rfind("}") + 1 if match and line[match.start()] == "{" else len(name)
        fields = line[end:].split()
        try:
            if not end or not 1 <= len(fields) <= 2:
                raise ValueError("expected a value and an optional timestamp")
            sample_name, labels = _series(line[:end])
            value = float(fields[0])
        except ValueError as error:
            raise ExpositionError(
                f"not Prometheus exposition text: line {number}: {_one_line(error)}"
            ) from error
        builder.add(sample_name, labels, value)
    return builder.build(scraped_at)


@functools.lru_cache(maxsize=16384)
def _series(series: str) -> tuple[str, Mapping[str, str]]:
    """Sample name and labels of one series, as ``prometheus_client``'s parser reads them.

    A worker repeats the same series on every scrape and the workers of one model share
    them, so each distinct series is parsed once; only the value changes (see
    ``bench/scale.py`` for what this saves). The returned mapping is shared: read only.
    """
    try:
        (family,) = text_string_to_metric_families(f"{series} 0\n")
        (sample,) = family.samples
    except (ValueError, IndexError, KeyError, TypeError) as error:
        raise ValueError(_one_line(error)) from error
    return sample.name, MappingProxyType(dict(sample.labels))


def _check_sample_line(line: str, number: int) -> None:
    match = _SAMPLE_LINE.fullmatch(line)
    if match is not None:
        try:
            float(match.group(1))
        except ValueError:
            pass
        else:
            return
    raise ExpositionError(
        f"not Prometheus exposition text: line {number} is not a sample: {line[:60]!r}"
    )


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


class _SnapshotBuilder:
    """Accumulates samples per engine, then freezes them into a WorkerSnapshot."""

    def __init__(self) -> None:
        self.scalars: dict[tuple[EngineKey, str], float] = {}
        self.per_position: dict[EngineKey, dict[int, float]] = {}
        self.buckets: dict[tuple[EngineKey, str], dict[float, float]] = {}
        self.process_start_time_s: float | None = None

    def add(self, sample_name: str, labels: Mapping[str, str], value: float) -> None:
        used = _USED_SAMPLES.get(sample_name)
        if used is None or not math.isfinite(value):
            return
        family, part = used
        if family == PROCESS_START_TIME:
            self.process_start_time_s = value
            return
        key = EngineKey(labels.get("model_name", ""), labels.get("engine", ""))
        if family == SPEC_ACCEPTED_PER_POS:
            position = _int_or_none(labels.get("position"))
            if position is not None and 0 <= position < MAX_SPEC_POSITIONS:
                self.per_position.setdefault(key, {})[position] = value
        elif part == "bucket":
            upper = _float_or_none(labels.get("le"))
            if upper is not None:
                self.buckets.setdefault((key, family), {})[upper] = value
        elif part in ("count", "sum"):
            self.scalars[(key, f"{family}:{part}")] = value
        else:
            self.scalars[(key, family)] = value

    def build(self, scraped_at: float | None) -> WorkerSnapshot:
        keys = {key for key, _ in self.scalars} | set(self.per_position)
        keys |= {key for key, _ in self.buckets}
        engines = {key: self._engine(key) for key in sorted(keys, key=_engine_order)}
        return WorkerSnapshot(engines, self.process_start_time_s, scraped_at)

    def _engine(self, key: EngineKey) -> EngineSnapshot:
        def scalar(name: str) -> float | None:
            return self.scalars.get((key, name))

        return EngineSnapshot(
            key=key,
            spec=self._spec(key),
            generation_tokens=scalar(GENERATION_TOKENS),
            running=scalar(RUNNING),
            waiting=scalar(WAITING),
            kv_cache_usage=scalar(KV_CACHE_USAGE),
            inter_token_latency=self._histogram(key, INTER_TOKEN_LATENCY),
            time_per_output_token=self._histogram(key, TIME_PER_OUTPUT_TOKEN),
            time_to_first_token=self._histogram(key, TIME_TO_FIRST_TOKEN),
            e2e_latency=self._histogram(key, E2E_LATENCY),
        )

    def _spec(self, key: EngineKey) -> SpecDecodeCounters | None:
        drafts = self.scalars.get((key, SPEC_DRAFTS))
        if drafts is None:
            return None
        positions = self.per_position.get(key, {})
        # vLLM creates every position 0..γ-1 at start; a gap would mean a partial page.
        per_position = tuple(positions.get(i, 0.0) for i in range(max(positions, default=-1) + 1))
        return SpecDecodeCounters(
            drafts=drafts,
            draft_tokens=self.scalars.get((key, SPEC_DRAFT_TOKENS), 0.0),
            accepted_tokens=self.scalars.get((key, SPEC_ACCEPTED_TOKENS), 0.0),
            accepted_per_position=per_position,
        )

    def _histogram(self, key: EngineKey, family: str) -> Histogram | None:
        buckets = self.buckets.get((key, family))
        count = self.scalars.get((key, f"{family}:count"))
        if not buckets and count is None:
            return None
        bounds = tuple(sorted(buckets or {}))
        cumulative = tuple((buckets or {})[bound] for bound in bounds)
        if count is None:
            count = cumulative[-1] if cumulative else 0.0
        return Histogram(bounds, cumulative, count, self.scalars.get((key, f"{family}:sum"), 0.0))


def _engine_order(key: EngineKey) -> tuple[str, int, str]:
    engine = _int_or_none(key.engine)
    return (key.model_name, engine if engine is not None else -1, key.engine)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
