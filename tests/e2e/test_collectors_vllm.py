"""The collectors on a real vLLM: counters, per-request metrics and Prometheus agree.

A server of its own (``ngram:3``, used by no other test) so its counters start at zero
while Prometheus watches: Prometheus has a sample at or before the range's start to count
from, or extrapolates every series by the same factor from zero, and ratios must agree
within rounding either way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from collectors.exposition import parse_exposition
from collectors.observations import RequestObservation
from collectors.per_request import observation_from_response, observation_from_stream, summed_spec
from collectors.window import worker_window
from testbed.server import VllmServer
from testbed.traffic import PROSE_PROMPTS, code_prompt, completion_body
from tests.collectors.agreement import assert_same_ratios, read_windows
from tests.conftest import VllmServers
from tests.helpers.prometheus import PrometheusServer, running_prometheus

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def fresh_server(vllm_servers: VllmServers) -> VllmServer:
    return vllm_servers.get("ngram:3")


@pytest.fixture(scope="module")
def prometheus(
    fresh_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    target = fresh_server.base_url.removeprefix("http://")
    with running_prometheus(
        [target], tmp_path_factory.mktemp("prom"), scrape_interval_s=0.5
    ) as server:
        yield server


def drive(client: httpx.Client) -> list[RequestObservation]:
    """Non-streaming code and prose, plus one streamed request with include_usage."""
    observations = []
    for prompt in (code_prompt(0), code_prompt(1), PROSE_PROMPTS[0]):
        response = client.post("/v1/completions", json=completion_body(prompt))
        response.raise_for_status()
        observations.append(observation_from_response(response.content))
    body = completion_body(code_prompt(2), 32, stream=True, include_usage=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        streamed = observation_from_stream(response.iter_lines())
    assert streamed is not None and streamed.spec is not None
    observations.append(streamed)
    return observations


def test_counters_per_request_metrics_and_prometheus_agree(
    fresh_server: VllmServer, prometheus: PrometheusServer
) -> None:
    with httpx.Client(base_url=fresh_server.base_url, timeout=120.0) as client:
        prometheus.wait_for("count_over_time(vllm:spec_decode_num_drafts_total[1h]) >= 2")
        start = parse_exposition(client.get("/metrics").text)
        observations = drive(client)
        end = parse_exposition(client.get("/metrics").text)
    direct = worker_window(start, end).total

    # 1. The counters' window equals the per-request metrics summed over the same requests.
    summed = summed_spec(observations)
    assert direct.spec is not None and summed is not None
    assert direct.spec.drafts == summed.drafts > 0
    assert direct.spec.draft_tokens == summed.draft_tokens
    assert direct.spec.accepted_tokens == summed.accepted_tokens > 0
    assert direct.spec.accepted_per_position == summed.accepted_per_position
    assert direct.generation_tokens == sum(o.output_tokens or 0 for o in observations)

    # 2. Prometheus' view of the same window, once it has scraped past the traffic.
    done = time.time()
    prometheus.wait_for(f"timestamp(vllm:generation_tokens_total) > {done + 1:.3f}")
    windows = read_windows(
        prometheus.url, time.time() - start_ts(prometheus) + 0.5, time.time(), 'job="vllm"'
    )
    (read,) = windows.values()
    assert not read.reset
    assert_same_ratios(read, worker_window(None, end).total)


def start_ts(prometheus: PrometheusServer) -> float:
    """When Prometheus first scraped the server: the range must start no earlier."""
    (series,) = prometheus.query("vllm:generation_tokens_total[1h]")
    values = series["values"]
    assert isinstance(values, list)
    return float(values[0][0])
