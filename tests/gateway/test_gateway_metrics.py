"""The gateway's own metrics, on a registry passed in, moving as requests go through
(both front ends, fake upstreams on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client import CollectorRegistry

from controller.gateway.app import Gateway
from controller.gateway.classify import RequestKeys
from controller.gateway.routing import EjectionPolicy, Fleet, Pool
from testbed.server import free_port
from tests.gateway.conftest import LoopThread, RunningGateway, wait_until
from tests.gateway.test_gateway_fakes import STREAM_BODY, FakeClock, start_replay, stream_text


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_requests_retries_ejections_in_flight_and_added_latency_are_counted(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    _, url = start_replay(loop_thread)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fleet = Fleet(
        [Pool("ngram", "ngram:4", [dead, url]), Pool("plain", "off", [url])],
        clock=FakeClock(),
        ejection=EjectionPolicy(cooldown_s=3600.0),
    )
    registry = CollectorRegistry()
    gateway = Gateway(fleet, classifier=RequestKeys(["code", "chat"], "chat"))
    gateway.count_on(registry)
    running = run_gateway(gateway)
    base = running.base_url

    # The first request meets the dead instance first: retried on the live one, which
    # answers; the dead one is ejected. Then two more, one streamed, one whole.
    stream_text(base, STREAM_BODY, **{"X-Workload-Class": "code"})
    stream_text(base, STREAM_BODY, **{"X-Workload-Class": "made-up-by-a-client"})
    whole = httpx.post(f"{base}/v1/completions", json={**STREAM_BODY, "stream": False}, timeout=30)
    assert whole.status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=30).status_code == 404
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
    running.wait_observations(3)

    requests = "specpilot_gateway_requests_total"
    ngram = {"pool": "ngram", "arm": "ngram:4"}
    # Counted once per request, after it is answered (the count may trail the client).
    wait_until(
        lambda: value(registry, requests, **ngram, workload_class="chat", status="200") == 2,
        what="the chat requests counted",
    )
    assert value(registry, requests, **ngram, workload_class="code", status="200") == 1
    # A class no setting lists is no label: it is the default class here (RequestKeys).
    assert value(registry, requests, pool="", arm="", workload_class="", status="404") == 1
    assert value(registry, requests, **ngram, workload_class="", status="200") == 1  # /v1/models
    assert value(registry, "specpilot_gateway_retries_total", pool="ngram") == 1
    assert value(registry, "specpilot_gateway_ejections_total", pool="ngram") == 1
    assert value(registry, "specpilot_gateway_ejections_total", pool="plain") == 0
    assert value(registry, "specpilot_gateway_in_flight_requests", **ngram) == 0
    # One observation per completed inference request, each a non-negative duration.
    assert value(registry, "specpilot_gateway_added_latency_seconds_count") == 3
    assert value(registry, "specpilot_gateway_added_latency_seconds_sum") >= 0.0
    families = {m.name for m in registry.collect()}
    assert families >= {
        "specpilot_gateway_requests",
        "specpilot_gateway_retries",
        "specpilot_gateway_ejections",
        "specpilot_gateway_in_flight_requests",
        "specpilot_gateway_added_latency_seconds",
    }


def test_in_flight_shows_a_request_in_progress(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    release = asyncio.Event()
    arrived: list[int] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        arrived.append(1)
        await release.wait()
        body = b'{"choices": []}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await writer.drain()
        writer.close()

    port = free_port()
    loop_thread.run(asyncio.start_server(slow, "127.0.0.1", port))
    registry = CollectorRegistry()
    gateway = Gateway(
        Fleet([Pool("plain", "off", [f"http://127.0.0.1:{port}"])], clock=FakeClock())
    )
    gateway.count_on(registry)
    running = run_gateway(gateway)

    in_flight = "specpilot_gateway_in_flight_requests"
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            httpx.post,
            f"{running.base_url}/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"X-Workload-Class": "chat"},
            timeout=30,
        )
        wait_until(lambda: arrived == [1], what="the request upstream")
        assert value(registry, in_flight, pool="plain", arm="off") == 1
        loop_thread.loop.call_soon_threadsafe(release.set)
        assert sent.result(30).status_code == 200
    # Released once the body has gone out: the client may see the end first.
    wait_until(
        lambda: value(registry, in_flight, pool="plain", arm="off") == 0,
        what="the request released",
    )
    wait_until(
        lambda: value(
            registry, "specpilot_gateway_requests_total",
            pool="plain", arm="off", workload_class="other", status="200",
        ) == 1,
        what="the request counted",
    )  # fmt: skip
