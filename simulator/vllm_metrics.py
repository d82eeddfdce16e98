"""A simulated instance's ``/metrics``: vLLM 0.32's names, types, labels and buckets.

Copied from real pages (``tests/fixtures/vllm-0.32/metrics-*.txt`` on main): every
series carries ``engine="0"`` and ``model_name``, labels in alphabetical order (``le``
and ``position`` included, as vLLM's pages have them), counters expose ``_total`` and
``_created``, histograms use vLLM's bucket bounds. Only the families specpilot or a
dashboard reads are simulated, not the few hundred others.

A custom collector rather than ``prometheus_client.Histogram`` objects: one engine step
of a batch adds the same inter-token latency to many requests at once, and a
histogram that takes a count per observation keeps that cheap. It is registered on the
instance's own ``CollectorRegistry``; a restart builds a new one (counters reset).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from simulator.instance import FinishedRequest

ENGINE = "0"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
"""``inter_token_latency_seconds`` and ``request_time_per_output_token_seconds``."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
"""``e2e_request_latency_seconds`` and ``request_queue_time_seconds``."""
TOKEN_COUNT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

GaugeReader = Callable[[], tuple[int, int, float]]
"""(running, waiting, KV-cache usage in [0, 1]) read at scrape time."""


class _Histogram:
    """A cumulative histogram that accepts a count per observation."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0 or not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def cumulative(self) -> list[tuple[str, int]]:
        total = 0
        result = []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            result.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return result


class VllmMetrics(Collector):
    """The counters, gauges and histograms of one simulated engine since its start."""

    def __init__(
        self, model_name: str, *, spec_positions: int, started_at: float, gauges: GaugeReader
    ) -> None:
        self._model = model_name
        self._positions = spec_positions
        self._started_at = started_at
        self._gauges = gauges
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * spec_positions
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(LATENCY_BUCKETS)
        self.tpot = _Histogram(LATENCY_BUCKETS)
        self.e2e = _Histogram(REQUEST_BUCKETS)
        self.queue = _Histogram(REQUEST_BUCKETS)
        self.request_prompt_tokens = _Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = _Histogram(TOKEN_COUNT_BUCKETS)
        self.max_tokens = _Histogram(TOKEN_COUNT_BUCKETS)

    # -- updates (simulated seconds) -----------------------------------------------

    def on_arrival(self, prompt_tokens: int, max_tokens: int | None) -> None:
        self.prompt_tokens += prompt_tokens
        self.request_prompt_tokens.observe(prompt_tokens)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_steps(
        self, *, itl_s: float, itl_count: int, gamma: int, accepted: npt.NDArray[np.int64]
    ) -> None:
        """Engine steps of one request, all ``itl_s`` long; the first step of a request
        is its time to first token and counts as no inter-token latency (so the caller
        passes ``itl_count`` one short of the steps then)."""
        self.itl.observe(itl_s, itl_count)
        if gamma <= 0 or not len(accepted):
            return
        self.drafts += len(accepted)
        self.draft_tokens += gamma * len(accepted)
        self.accepted_tokens += int(accepted.sum())
        # Position i was accepted in every step that accepted more than i drafts.
        counts = np.bincount(accepted, minlength=gamma + 1)
        above = np.cumsum(counts[::-1])[::-1][1:]
        for position in range(min(gamma, self._positions)):
            self.accepted_per_position[position] += int(above[position])

    def add_generation_tokens(self, tokens: int) -> None:
        self.generation_tokens += tokens

    def on_finish(self, finished: FinishedRequest, e2e_s: float) -> None:
        output = finished.observation.output_tokens or 0
        self.finished[finished.finish_reason] += 1
        self.queue.observe(finished.queue_s)
        self.e2e.observe(e2e_s)
        self.request_generation_tokens.observe(output)
        if output > 1:
            self.tpot.observe(finished.generation_s / (output - 1))

    # -- exposition ----------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        labels = {"engine": ENGINE, "model_name": self._model}
        start = Metric(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            "gauge",
        )
        start.add_sample("process_start_time_seconds", {}, self._started_at)
        yield start
        if self._positions > 0:
            yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                self.drafts)  # fmt: skip
            yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                self.draft_tokens)  # fmt: skip
            yield self._counter("vllm:spec_decode_num_accepted_tokens",
                                "Number of accepted tokens.", self.accepted_tokens)  # fmt: skip
            per_pos = Metric(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                "counter",
            )
            for position, value in enumerate(self.accepted_per_position):
                series = {**labels, "position": str(position)}
                per_pos.add_sample(per_pos.name + "_total", series, float(value))
            for position in range(len(self.accepted_per_position)):
                series = {**labels, "position": str(position)}
                per_pos.add_sample(per_pos.name + "_created", series, self._started_at)
            yield per_pos
        running, waiting, kv_usage = self._gauges()
        yield self._gauge("vllm:num_requests_running",
                          "Number of requests in model execution batches.", running)  # fmt: skip
        yield self._gauge("vllm:num_requests_waiting",
                          "Number of requests waiting to be processed.", waiting)  # fmt: skip
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", kv_usage)  # fmt: skip
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                            self.prompt_tokens)  # fmt: skip
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            self.generation_tokens)  # fmt: skip
        success = Metric(
            "vllm:request_success", "Count of successfully processed requests.", "counter"
        )
        for reason, count in self.finished.items():
            series = {"engine": ENGINE, "finished_reason": reason, "model_name": self._model}
            success.add_sample(success.name + "_total", series, float(count))
        for reason in self.finished:
            series = {"engine": ENGINE, "finished_reason": reason, "model_name": self._model}
            success.add_sample(success.name + "_created", series, self._started_at)
        yield success
        for name, help_text, histogram in (
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
             self.request_prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.",
             self.request_generation_tokens),
            ("vllm:request_params_max_tokens",
             "Histogram of the max_tokens request parameter.", self.max_tokens),
            ("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", self.tpot),
            ("vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", self.e2e),
            ("vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", self.queue),
        ):  # fmt: skip
            yield self._histogram(name, help_text, histogram)

    def _counter(self, name: str, help_text: str, value: int) -> Metric:
        metric = Metric(name, help_text, "counter")
        labels = {"engine": ENGINE, "model_name": self._model}
        metric.add_sample(name + "_total", labels, float(value))
        metric.add_sample(name + "_created", labels, self._started_at)
        return metric

    def _gauge(self, name: str, help_text: str, value: float) -> Metric:
        metric = Metric(name, help_text, "gauge")
        metric.add_sample(name, {"engine": ENGINE, "model_name": self._model}, float(value))
        return metric

    def _histogram(self, name: str, help_text: str, histogram: _Histogram) -> Metric:
        metric = Metric(name, help_text, "histogram")
        cumulative = histogram.cumulative()
        for bound, count in cumulative:
            series = {"engine": ENGINE, "le": bound, "model_name": self._model}
            metric.samples.append(Sample(name + "_bucket", series, float(count)))
        labels = {"engine": ENGINE, "model_name": self._model}
        metric.add_sample(name + "_count", labels, float(cumulative[-1][1]))
        metric.add_sample(name + "_sum", labels, histogram.sum)
        metric.add_sample(name + "_created", labels, self._started_at)
        return metric
