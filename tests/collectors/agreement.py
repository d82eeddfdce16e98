"""Assertions and readers for comparing the Prometheus reader with a direct scrape.

Shared by the tests against loopback servers and those against a real vLLM: both sides
must agree "within rounding" on ratios, quantiles and means (the reader's counts are
exact differences of two scrapes, or extrapolated by one factor per target, which
cancels in them).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from collectors.promql import PrometheusReader
from collectors.window import WindowStats

EXACT = 1e-9
"""Relative tolerance of "within rounding"."""


def assert_same_ratios(read: WindowStats, direct: WindowStats) -> None:
    """The figures a Prometheus reader and a direct scrape must agree on within rounding:
    spec-decode ratios, latency quantiles and means."""
    if direct.spec is None:
        assert read.spec is None
    else:
        assert read.spec is not None
        for name in (
            "acceptance_rate",
            "mean_acceptance_length",
            "mean_proposed_tokens_per_draft",
            "per_position_acceptance",
            "conditional_acceptance",
        ):
            assert_close(getattr(read.spec, name), getattr(direct.spec, name))
    for name in ("inter_token_latency", "time_per_output_token", "time_to_first_token"):
        got, want = getattr(read, name), getattr(direct, name)
        assert_close(
            (got.p50_s, got.p90_s, got.p99_s, got.mean_s),
            (want.p50_s, want.p90_s, want.p99_s, want.mean_s),
        )


def assert_close(got: object, want: object) -> None:
    """Equal within rounding, element-wise, with None ("no data") only matching None."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for item, expected in zip(got, want, strict=True):
            assert_close(item, expected)
    elif want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=EXACT)


def read_windows(
    prometheus_url: str, range_s: float, at: float, selector: str = 'job="vllm"'
) -> dict[str, WindowStats]:
    """Every worker's window over ``[at - range_s, at]`` as the reader gets it."""

    async def read() -> dict[str, WindowStats]:
        async with httpx.AsyncClient() as client:
            reader = PrometheusReader(prometheus_url, client, selector=selector)
            windows = await reader.windows(range_s, at=at)
        return {worker: window.total for worker, window in windows.items()}

    return asyncio.run(read())
