"""The gateway end to end on loopback against fake upstreams: a replay server that plays
recorded real vLLM 0.32 streams, a dead port, and an upstream that dies mid-stream.
The same behaviours against real vLLM are in test_gateway_vllm.py."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from bench.gateway import FIXTURES, ReplayUpstream, sse_events
from controller.gateway.app import Gateway
from controller.gateway.routing import EjectionPolicy, Fleet, Pool, RouteKey, StaticRoutingTable
from controller.gateway.table import Route, SampledRouting
from testbed.server import free_port
from tests.gateway.conftest import LoopThread, RunningGateway, wait_until

STREAM_BODY = {"model": "tiny-llama", "prompt": "def f(", "stream": True}
_ID = re.compile(rb'"id":"[^"]*"')


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def start_replay(loop_thread: LoopThread, interval_s: float = 0.0) -> tuple[ReplayUpstream, str]:
    upstream = ReplayUpstream(
        sse_events(FIXTURES / "completion-ngram-stream.sse"),
        sse_events(FIXTURES / "completion-ngram-stream-usage.sse"),
        interval_s=interval_s,
    )
    port = free_port()
    loop_thread.run(asyncio.start_server(upstream.handle, "127.0.0.1", port))
    return upstream, f"http://127.0.0.1:{port}"


def start_cut_upstream(loop_thread: LoopThread) -> tuple[list[int], str]:
    """Answers 200 with one SSE event, then closes the connection mid-body."""
    served: list[int] = []
    first_event = sse_events(FIXTURES / "completion-ngram-stream-usage.sse")[0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        served.append(1)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n"
            % (len(first_event), first_event)
        )
        await writer.drain()
        writer.close()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    return served, f"http://127.0.0.1:{port}"


def stream_text(base_url: str, body: Mapping[str, Any], **headers: str) -> bytes:
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        return response.read()


def test_stream_is_what_the_upstream_sends_without_usage_and_is_observed(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    replay, url = start_replay(loop_thread)
    fleet = Fleet([Pool("ngram", "ngram:4", [url])], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))

    through = stream_text(gateway.base_url, STREAM_BODY, **{"X-Workload-Class": "code"})
    direct = stream_text(url, STREAM_BODY)

    assert replay.requests == 2
    stream_text(gateway.base_url, STREAM_BODY)
    assert replay.connections == 2, "the gateway reused its keep-alive connection"
    # The fixtures were recorded as two requests, so their ids differ; nothing else may.
    assert _ID.sub(b"", through) == _ID.sub(b"", direct)
    observation = gateway.wait_observations(2)[0]
    assert observation.workload_class == "code"
    assert (observation.pool, observation.arm, observation.concurrency) == ("ngram", "ngram:4", 1)
    # The figures of the recorded usage chunk, read off the stream the client never saw.
    assert observation.spec is not None
    assert (observation.spec.num_drafts, observation.spec.num_draft_tokens) == (6, 14)
    assert observation.spec.num_accepted_tokens == 14
    assert observation.output_tokens == 24
    assert observation.ttft_s == pytest.approx(0.1466648680000162)
    assert fleet.pools["ngram"].in_flight == 0


def test_client_that_asked_for_usage_gets_it_unchanged(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    _, url = start_replay(loop_thread)
    gateway = run_gateway(Gateway(Fleet([Pool("p", "ngram:4", [url])], clock=FakeClock())))
    body = {**STREAM_BODY, "stream_options": {"include_usage": True}}
    assert stream_text(gateway.base_url, body) == stream_text(url, body)
    (observation,) = gateway.wait_observations(1)
    assert observation.spec is not None and observation.spec.num_drafts == 6


def test_dead_instance_is_ejected_and_the_request_retried_elsewhere(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    replay, url = start_replay(loop_thread)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    clock = FakeClock()
    fleet = Fleet(
        [Pool("p", "off", [dead, url])], clock=clock, ejection=EjectionPolicy(cooldown_s=10.0)
    )
    gateway = run_gateway(Gateway(fleet))
    dead_instance = fleet.pools["p"].instances[0]

    stream_text(gateway.base_url, STREAM_BODY)
    assert replay.requests == 1
    assert dead_instance.ejected_until == 10.0

    stream_text(gateway.base_url, STREAM_BODY)
    assert dead_instance.ejections == 1, "an ejected instance is not tried"
    clock.now = 10.0
    stream_text(gateway.base_url, STREAM_BODY)
    assert replay.requests == 3
    assert dead_instance.ejections == 2, "re-admitted after the cool-down, failed, ejected"
    assert dead_instance.ejected_until == 30.0, "the second cool-down is twice as long"
    assert len(gateway.wait_observations(3)) == 3


def test_no_retry_once_the_client_has_bytes(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    replay, url = start_replay(loop_thread)
    served, cut_url = start_cut_upstream(loop_thread)
    fleet = Fleet([Pool("p", "off", [cut_url, url])], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))

    received = b""
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream("POST", f"{gateway.base_url}/v1/completions", json=STREAM_BODY) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            for piece in response.iter_raw():
                received += piece
    assert received.startswith(b"data: {") and b"[DONE]" not in received
    assert served == [1] and replay.requests == 0, "the request was not sent twice"
    assert fleet.pools["p"].instances[0].ejections == 1
    assert gateway.observations == []


def test_no_available_instance_is_a_503(
    run_gateway: Callable[[Gateway], RunningGateway],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gateway = run_gateway(Gateway(Fleet([Pool("p", "off", [dead])], clock=FakeClock())))
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=STREAM_BODY, timeout=30.0)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "ServiceUnavailable"


def test_classifier_and_routing_table_pick_the_pool(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    off_replay, off_url = start_replay(loop_thread)
    ngram_replay, ngram_url = start_replay(loop_thread)
    fleet = Fleet(
        [Pool("off", "off", [off_url]), Pool("ngram", "ngram:4", [ngram_url])],
        clock=FakeClock(),
    )
    table = StaticRoutingTable("off")
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []

    def classifier(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        seen.append((dict(headers), dict(body)))
        if body.get("prompt") == "boom":
            raise RuntimeError("classifier bug")
        return "code" if str(body.get("prompt", "")).startswith("def") else "prose"

    gateway = run_gateway(Gateway(fleet, routing=table, classifier=classifier))
    stream_text(gateway.base_url, STREAM_BODY)
    assert (off_replay.requests, ngram_replay.requests) == (1, 0)

    table.replace({RouteKey("tiny-llama", "code", "1"): "ngram"})
    stream_text(gateway.base_url, STREAM_BODY)
    stream_text(gateway.base_url, {**STREAM_BODY, "prompt": "Once upon"})
    stream_text(gateway.base_url, {**STREAM_BODY, "prompt": "boom"})
    stream_text(gateway.base_url, STREAM_BODY, **{"X-Workload-Class": "prose"})
    assert (off_replay.requests, ngram_replay.requests) == (4, 1)

    observations = gateway.wait_observations(5)
    assert [o.workload_class for o in observations] == [
        "code",
        "code",
        "prose",
        "default",
        "prose",
    ]
    assert [o.arm for o in observations] == ["off", "ngram:4", "off", "off", "off"]
    # The header decides alone: the classifier was not asked the last time.
    assert len(seen) == 4
    assert seen[0][1]["prompt"] == "def f(" and "content-type" in seen[0][0]


def test_a_request_its_routed_pool_cannot_take_is_a_failover_observed_as_one(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    """The routing table sends code to n-gram, whose one instance is dead: the off pool
    serves it. The observation says where the table sent it (``routed_arm``) beside
    where it was served, and which instance served it; the failover is counted."""
    off_replay, off_url = start_replay(loop_thread)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fleet = Fleet(
        [Pool("off", "off", [off_url], model="tiny-llama"),
         Pool("ngram", "ngram:4", [dead], model="tiny-llama")],
        clock=FakeClock(),
    )  # fmt: skip
    routed: list[tuple[str, str]] = []
    table = SampledRouting(
        {"off": "off", "ngram:4": "ngram"},
        default_model="tiny-llama",
        on_routed=lambda model, cls, bucket, arm, reason: routed.append((arm, reason)),
    )
    table.replace({RouteKey("tiny-llama", "code", "1"): Route("ngram:4", "best")})
    gateway = Gateway(fleet, routing=table)
    registry = CollectorRegistry()
    gateway.count_on(registry)
    running = run_gateway(gateway)

    stream_text(running.base_url, STREAM_BODY, **{"X-Workload-Class": "code"})
    stream_text(running.base_url, STREAM_BODY, **{"X-Workload-Class": "chat"})
    assert off_replay.requests == 2
    assert routed == [("ngram:4", "best"), ("off", "learning")]
    failed_over, plain = running.wait_observations(2)
    assert (failed_over.arm, failed_over.routed_arm, failed_over.pool) == ("off", "ngram:4", "off")
    assert (plain.arm, plain.routed_arm) == ("off", "off")
    assert failed_over.instance == plain.instance == off_url
    count = registry.get_sample_value
    assert count("specpilot_gateway_failovers_total", {"pool": "ngram", "served_pool": "off"}) == 1
    assert count("specpilot_gateway_failovers_total", {"pool": "off", "served_pool": "ngram"}) == 0


def start_endless_upstream(loop_thread: LoopThread) -> tuple[dict[str, int], str]:
    """Streams one SSE event every 20 ms, up to 2000; ``state["sent"]`` counts them and
    ``state["closed"]`` becomes 1 when the gateway's connection to it goes away."""
    state = {"sent": 0, "closed": 0}
    event = sse_events(FIXTURES / "completion-ngram-stream-usage.sse")[0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(2000):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                state["sent"] += 1
                await asyncio.sleep(0.02)
        except ConnectionError:
            pass
        finally:
            state["closed"] = 1
            writer.close()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    return state, f"http://127.0.0.1:{port}"


def test_a_request_is_observed_in_the_bucket_it_was_routed_in(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    """The bucket counts the model's requests in flight on every pool, and so does the
    observation: a code request sent to n-gram while a prose stream holds the off pool
    is routed, and then counted, at concurrency 2, although it is alone on its pool."""
    _, off_url = start_replay(loop_thread, interval_s=0.05)
    ngram_replay, ngram_url = start_replay(loop_thread)
    fleet = Fleet(
        [Pool("off", "off", [off_url]), Pool("ngram", "ngram:4", [ngram_url])],
        clock=FakeClock(),
    )
    table = StaticRoutingTable("off", {RouteKey("tiny-llama", "code", "2-3"): "ngram"})
    gateway = run_gateway(Gateway(fleet, routing=table))

    prose = {**STREAM_BODY, "prompt": "Once upon"}
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream(
            "POST",
            f"{gateway.base_url}/v1/completions",
            json=prose,
            headers={"X-Workload-Class": "prose"},
        ) as held,
    ):
        assert held.status_code == 200
        chunks = held.iter_bytes()
        next(chunks)  # the prose stream is in flight on the off pool
        stream_text(gateway.base_url, STREAM_BODY, **{"X-Workload-Class": "code"})
        assert b"[DONE]" in b"".join(chunks)
    assert ngram_replay.requests == 1  # routed by the (code, 2-3) route
    by_class = {o.workload_class: o for o in gateway.wait_observations(2)}
    assert (by_class["code"].pool, by_class["code"].concurrency) == ("ngram", 2)
    assert (by_class["prose"].pool, by_class["prose"].concurrency) == ("off", 1)


def test_client_disconnect_closes_the_upstream_request(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    state, url = start_endless_upstream(loop_thread)
    fleet = Fleet([Pool("p", "off", [url])], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))
    with (
        httpx.Client(timeout=30.0) as client,
        client.stream("POST", f"{gateway.base_url}/v1/completions", json=STREAM_BODY) as response,
    ):
        assert next(response.iter_lines()).startswith("data: {")
    # Leaving the block closed the client's connection mid-stream.
    wait_until(lambda: state["closed"] == 1, what="the upstream connection to close")
    assert state["sent"] < 2000, "the upstream stream was cut, not played to its end"
    wait_until(lambda: fleet.pools["p"].in_flight == 0, what="the attempt to be released")
    assert gateway.observations == [], "an abandoned request is not an observation"


def test_slow_client_gets_a_large_stream_whole_and_in_order(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    """Far more than the sockets buffer: the gateway stops reading the upstream while
    the client lags, and resumes, without losing or reordering an event."""
    events = [b'data: {"n":%d,"pad":"%s"}\n\n' % (i, b"x" * 4000) for i in range(2000)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    fleet = Fleet([Pool("p", "off", [f"http://127.0.0.1:{port}"])], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))
    body = {**STREAM_BODY, "stream_options": {"include_usage": True}}
    received = b""
    with (
        httpx.Client(timeout=60.0) as client,
        client.stream("POST", f"{gateway.base_url}/v1/completions", json=body) as response,
    ):
        for i, piece in enumerate(response.iter_raw(16384)):
            if i % 64 == 0:
                time.sleep(0.01)  # lag behind the upstream
            received += piece
    assert received == b"".join(events)
    wait_until(lambda: fleet.pools["p"].in_flight == 0, what="the attempt to be released")


def test_body_the_gateway_cannot_decode_goes_upstream_unchanged_and_unobserved(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    # Python's json takes NaN; orjson (the gateway's decoder) refuses it. Not the
    # gateway's to judge: vLLM answers such a request itself, as it would directly.
    _, url = start_replay(loop_thread)
    gateway = run_gateway(Gateway(Fleet([Pool("p", "ngram:4", [url])], clock=FakeClock())))
    body = b'{"model":"tiny-llama","prompt":"x","stream":true,"temperature":NaN}'

    def post(base_url: str) -> bytes:
        response = httpx.post(f"{base_url}/v1/completions", content=body, timeout=30.0)
        assert response.status_code == 200
        return response.content

    assert post(gateway.base_url) == post(url)
    assert b'"choices":[]' not in post(gateway.base_url), "no usage chunk was asked for"
    stream_text(gateway.base_url, STREAM_BODY)
    (observation,) = gateway.wait_observations(1)
    assert observation.output_tokens == 24, "only the decodable request was observed"
