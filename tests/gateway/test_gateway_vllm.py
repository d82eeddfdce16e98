"""The gateway in front of a real vLLM 0.32 (n-gram γ=4) from the testbed."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool
from testbed.server import VllmServer, free_port
from testbed.traffic import PROSE_PROMPTS, chat_body, code_prompt, completion_body
from tests.conftest import VllmServers
from tests.gateway.conftest import RunningGateway, gateway_runner, wait_until

pytestmark = pytest.mark.vllm

_VOLATILE = (
    (re.compile(rb'"id":"[^"]*"'), b'"id":"-"'),
    (re.compile(rb'"created":\d+'), b'"created":0'),
    (
        re.compile(
            rb'"(time_to_first_token_ms|generation_time_ms|queue_time_ms|mean_itl_ms'
            rb'|tokens_per_second)":[-+0-9.eE]+'
        ),
        rb'"\1":0',
    ),
)


def normalise(data: bytes) -> bytes:
    """Blank what differs between two runs of one greedy request: ids, timestamps, timings."""
    for pattern, replacement in _VOLATILE:
        data = pattern.sub(replacement, data)
    return data


@pytest.fixture
def run_gateway() -> Iterator[Callable[[Gateway], RunningGateway]]:
    """Against real vLLM only the front end ``specpilot gateway`` runs (native); the ASGI
    interface runs the same :meth:`Gateway.handle` and is covered against the fakes."""
    yield from gateway_runner("native")


@pytest.fixture(scope="module")
def server(vllm_servers: VllmServers) -> VllmServer:
    return vllm_servers.get("ngram:4")


@pytest.fixture
def gateway(server: VllmServer, run_gateway: Callable[[Gateway], RunningGateway]) -> RunningGateway:
    return run_gateway(
        Gateway(Fleet([Pool("ngram", "ngram:4", [server.base_url])], clock=time.monotonic))
    )


def stream(client: httpx.Client, url: str, body: dict[str, Any]) -> bytes:
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        return response.read()


def metric(client: httpx.Client, server: VllmServer, name: str, labels: str = "") -> float:
    """Sum of one vLLM metric's samples whose labels contain ``labels``."""
    total = 0.0
    for line in client.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("client_usage", [False, True], ids=["no-usage", "client-usage"])
def test_stream_through_gateway_is_what_vllm_sends(
    server: VllmServer, gateway: RunningGateway, endpoint: str, client_usage: bool
) -> None:
    make = completion_body if endpoint == "/v1/completions" else chat_body
    body = make(code_prompt(3), 32, stream=True, include_usage=client_usage)
    with httpx.Client(timeout=120.0) as client:
        # vLLM's output handler merges the deltas of two engine steps into one event when
        # its event loop lags (this CPU is shared), so the event framing of the *direct*
        # stream can change from one run to the next. The gateway never merges or splits
        # events, so its stream must be byte for byte one that vLLM itself sends: compare
        # with every direct stream seen, alternating which path goes first.
        directs: list[bytes] = []
        throughs: list[bytes] = []
        for attempt in range(5):
            paths = [server.base_url, gateway.base_url][:: 1 if attempt % 2 == 0 else -1]
            for base in paths:
                text = normalise(stream(client, base + endpoint, body))
                (directs if base == server.base_url else throughs).append(text)
            if throughs[-1] in directs:
                break
    through, direct = throughs[-1], directs[-1]
    assert through in directs, f"through the gateway:\n{through!r}\ndirect:\n{direct!r}"
    assert direct.endswith(b"data: [DONE]\n\n")
    assert (b'"usage":{' in through) is client_usage
    # Every request still became an observation with the real speculation figures.
    observations = gateway.wait_observations(len(throughs))
    assert all(o.spec is not None and o.spec.num_draft_tokens for o in observations)


def test_non_streaming_body_is_what_vllm_sends(server: VllmServer, gateway: RunningGateway) -> None:
    body = completion_body(code_prompt(4), 32)
    with httpx.Client(timeout=120.0) as client:
        direct = client.post(f"{server.base_url}/v1/completions", json=body)
        through = client.post(f"{gateway.base_url}/v1/completions", json=body)
        models_direct = client.get(f"{server.base_url}/v1/models")
        models_through = client.get(f"{gateway.base_url}/v1/models")
    assert through.status_code == direct.status_code == 200
    assert normalise(through.content) == normalise(direct.content)
    assert through.headers["content-type"] == direct.headers["content-type"]
    assert normalise(models_through.content) == normalise(models_direct.content)

    (observation,) = gateway.wait_observations(1)
    spec = through.json()["metrics"]["speculative_decoding"]
    assert observation.spec is not None
    assert observation.spec.num_drafts == spec["num_spec_steps"]
    assert observation.spec.num_draft_tokens == spec["num_draft_tokens"]
    assert observation.spec.num_accepted_tokens == spec["num_accepted_draft_tokens"]
    assert observation.output_tokens == 32
    assert (observation.pool, observation.arm, observation.model) == (
        "ngram",
        "ngram:4",
        "tiny-llama",
    )


def test_stream_observation_reconciles_with_vllm_counters(
    server: VllmServer, gateway: RunningGateway
) -> None:
    counters = (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    )
    body = completion_body(code_prompt(5), 48, stream=True)
    with httpx.Client(timeout=120.0) as client:
        before = [metric(client, server, name) for name in counters]
        text = stream(client, f"{gateway.base_url}/v1/completions", body)
        after = [metric(client, server, name) for name in counters]
    assert b'"usage"' not in text, "the client did not ask for usage and does not get it"
    (observation,) = gateway.wait_observations(1)
    spec = observation.spec
    assert spec is not None and spec.num_draft_tokens
    # Only this request ran on the server between the scrapes.
    assert [b - a for a, b in zip(before, after, strict=True)] == [
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
    ]
    assert observation.output_tokens == 48 and observation.ttft_s is not None
    assert observation.concurrency == 1 and observation.finished_at is not None


def test_client_disconnect_aborts_the_vllm_request(
    server: VllmServer, gateway: RunningGateway
) -> None:
    # Sampled prose: n-gram finds next to nothing to draft, so the request runs at about
    # a token per step and takes several times longer than the abort needs, even on a
    # loaded machine (greedy code, ~4.7 tokens per step, finished first there once).
    max_tokens = 800
    body = completion_body(PROSE_PROMPTS[0], max_tokens, stream=True, temperature=1.0)
    running = "vllm:num_requests_running"
    with httpx.Client(timeout=120.0) as metrics:
        tokens_before = metric(metrics, server, "vllm:generation_tokens_total")
        with (
            httpx.Client(timeout=120.0) as client,
            client.stream("POST", f"{gateway.base_url}/v1/completions", json=body) as response,
        ):
            events = response.iter_lines()
            assert next(events).startswith("data: {")
            assert metric(metrics, server, running) == 1.0
        # Leaving the block closed the client's connection mid-stream.
        wait_until(lambda: metric(metrics, server, running) == 0.0, what="vLLM to stop the request")
        tokens = metric(metrics, server, "vllm:generation_tokens_total") - tokens_before
    # Had the upstream request gone on, vLLM would have generated all max_tokens
    # (ignore_eos) before the running gauge fell back to 0.
    assert 0 < tokens < max_tokens
    assert gateway.observations == [], "an abandoned request is not an observation"
    assert gateway.gateway.fleet.pools["ngram"].in_flight == 0


def test_dead_instance_ejected_and_request_served_by_real_vllm(
    server: VllmServer, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    fleet = Fleet([Pool("ngram", "ngram:4", [dead, server.base_url])], clock=time.monotonic)
    gateway = run_gateway(Gateway(fleet))
    body = completion_body(code_prompt(2), 16, stream=True)
    with httpx.Client(timeout=120.0) as client:
        text = stream(client, f"{gateway.base_url}/v1/completions", body)
    assert text.endswith(b"data: [DONE]\n\n")
    dead_instance, live_instance = fleet.pools["ngram"].instances
    assert dead_instance.ejections == 1 and dead_instance.ejected_until > time.monotonic()
    assert live_instance.ejections == 0
    (observation,) = gateway.wait_observations(1)
    assert observation.spec is not None and observation.output_tokens == 16
