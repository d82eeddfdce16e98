"""Upstreams that hang (``UpstreamTimeouts``) on both front ends: one that never accepts,
one that accepts and never answers, one that stops mid-stream, one that answers only
after its first-byte timeout (slow, not hung); and a client that leaves, which says
nothing about the instance. Timeouts here are short bounds the gateway must act within;
the tests wait for what it does and time nothing."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.gateway import FIXTURES, ReplayUpstream, sse_events
from controller.gateway.app import Gateway
from controller.gateway.routing import EjectionPolicy, Fleet, Pool
from controller.gateway.upstream import UpstreamConnection, UpstreamPool, UpstreamTimeouts
from testbed.server import free_port
from tests.gateway.conftest import LoopThread, RunningGateway, wait_until
from tests.gateway.test_gateway_fakes import STREAM_BODY, FakeClock, start_replay

SHORT = UpstreamTimeouts(connect_s=0.3, first_byte_s=0.3, between_chunks_s=0.3)


def gateway_over(fleet: Fleet) -> Gateway:
    return Gateway(fleet, upstreams=UpstreamPool(SHORT))


def start_silent(loop_thread: LoopThread) -> str:
    """Accepts, reads the request, never answers."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.Event().wait()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    return f"http://127.0.0.1:{port}"


def start_stalling(loop_thread: LoopThread, head: bytes, first: bytes) -> str:
    """Sends ``head`` and ``first``, then nothing more, and keeps the connection open."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + first)
        await writer.drain()
        await asyncio.Event().wait()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def unaccepting() -> Iterator[str]:
    """A listener whose accept queue is full: a connect to it is never completed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=5)]
    yield f"http://127.0.0.1:{port}"
    for sock in queued:
        sock.close()
    listener.close()


def test_an_instance_that_never_answers_is_left_for_another_and_ejected(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    silent = start_silent(loop_thread)
    replay, url = start_replay(loop_thread)
    clock = FakeClock()
    fleet = Fleet([Pool("p", "off", [silent, url])], clock=clock)
    gateway = run_gateway(gateway_over(fleet))
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=STREAM_BODY, timeout=30)
    assert response.status_code == 200
    assert replay.requests == 1
    hung, served = fleet.pools["p"].instances
    assert hung.ejected_until > clock.now and served.ejected_until <= clock.now


def start_slow_beside_silent(loop_thread: LoopThread) -> tuple[ReplayUpstream, str, str]:
    """A slow instance and a silent one: the slow one answers only once a request has
    reached the silent one, so only after the gateway stopped waiting on it alone (its
    first-byte timeout passed), however long that took. Their replay and URLs."""
    replay = ReplayUpstream(
        sse_events(FIXTURES / "completion-ngram-stream.sse"),
        sse_events(FIXTURES / "completion-ngram-stream-usage.sse"),
        interval_s=0.0,
    )
    reached = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        reached.set()
        await asyncio.Event().wait()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reached.wait()
        await replay.handle(reader, writer)

    ports = free_port(), free_port()
    loop_thread.run(asyncio.start_server(slow, "127.0.0.1", ports[0]))
    loop_thread.run(asyncio.start_server(silent, "127.0.0.1", ports[1]))
    return replay, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"


def test_a_slow_instance_past_its_timeout_still_serves_beside_a_hung_one_and_stays(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    replay, slow, silent = start_slow_beside_silent(loop_thread)
    clock = FakeClock()
    fleet = Fleet([Pool("p", "off", [slow, silent])], clock=clock)  # the slow one first
    gateway = run_gateway(gateway_over(fleet))
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=STREAM_BODY, timeout=30)
    assert response.status_code == 200 and b"[DONE]" in response.content
    assert replay.requests == 1
    late, _ = fleet.pools["p"].instances
    assert late.ejected_until <= clock.now and late.consecutive_failures == 0, (
        "an instance that answered, however late, is not ejected"
    )
    # The attempt is released once the stream's end has gone out to the client, so the
    # client can see the end first.
    wait_until(lambda: fleet.pools["p"].in_flight == 0, what="the attempt to be released")


def test_when_every_instance_is_overdue_the_request_gets_503_and_they_are_ejected(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    clock = FakeClock()
    silent = [start_silent(loop_thread), start_silent(loop_thread)]
    fleet = Fleet([Pool("p", "off", silent)], clock=clock)
    gateway = run_gateway(gateway_over(fleet))
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=STREAM_BODY, timeout=30)
    assert response.status_code == 503
    assert all(i.ejected_until > clock.now for i in fleet.pools["p"].instances)
    assert fleet.pools["p"].in_flight == 0


def test_a_sweep_that_runs_late_judges_nothing_but_the_next_one_does() -> None:
    """A loop held up past a deadline may not have read the answer waiting in the
    socket yet: the late sweep leaves it, and the one after judges (never two skipped
    in a row, so a loop always late still times a hung upstream out)."""

    async def sweeps() -> tuple[str | None, str | None]:
        loop = asyncio.get_running_loop()
        pool = UpstreamPool(SHORT)
        connection = UpstreamConnection()  # sent, nothing received
        pool._checked_out(connection)  # as connect() does
        connection.watched = (0, loop.time() - 10 * SHORT.first_byte_s)
        pool._sweep_due = loop.time() - 10 * SHORT.first_byte_s  # this one is late
        pool._sweep()
        after_late = connection.overdue
        pool._sweep_due = loop.time() - 10 * SHORT.first_byte_s  # and so is the next
        pool._sweep()
        pool.close()
        return after_late, connection.overdue

    after_late, after_next = asyncio.run(sweeps())
    assert after_late is None
    assert after_next is not None and "did not answer" in after_next


def test_an_instance_that_never_accepts_is_left_for_another_and_ejected(
    loop_thread: LoopThread,
    run_gateway: Callable[[Gateway], RunningGateway],
    unaccepting: str,
) -> None:
    replay, url = start_replay(loop_thread)
    clock = FakeClock()
    fleet = Fleet([Pool("p", "off", [unaccepting, url])], clock=clock)
    gateway = run_gateway(gateway_over(fleet))
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=STREAM_BODY, timeout=30)
    assert response.status_code == 200 and replay.requests == 1
    assert fleet.pools["p"].instances[0].ejected_until > clock.now


def test_a_stream_that_stops_ends_with_an_error_event_and_counts_against_the_instance(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    event = sse_events(FIXTURES / "completion-ngram-stream-usage.sse")[0]
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    stalling = start_stalling(loop_thread, head, b"%x\r\n%s\r\n" % (len(event), event))
    clock = FakeClock()
    fleet = Fleet([Pool("p", "off", [stalling])], clock=clock)
    gateway = run_gateway(gateway_over(fleet))
    received = b""
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{gateway.base_url}/v1/completions", json=STREAM_BODY) as response,
        pytest.raises(httpx.RemoteProtocolError),  # the body ends unfinished
    ):
        assert response.status_code == 200
        for piece in response.iter_raw():
            received += piece
    assert received.startswith(event.rstrip(b"\n"))
    assert b'data: {"error": {"message": "the upstream failed mid-stream' in received
    assert b"[DONE]" not in received
    instance = fleet.pools["p"].instances[0]
    assert instance.ejected_until > clock.now, "the stall counts toward ejection"
    assert fleet.pools["p"].in_flight == 0


def test_a_passed_through_body_that_stops_counts_against_the_instance(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    stalling = start_stalling(loop_thread, head, b'{"object":')
    clock = FakeClock()
    fleet = Fleet([Pool("p", "off", [stalling])], clock=clock)
    gateway = run_gateway(gateway_over(fleet))
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"{gateway.base_url}/v1/models", timeout=30)
    assert fleet.pools["p"].instances[0].ejected_until > clock.now
    assert fleet.pools["p"].in_flight == 0


def test_a_client_that_leaves_mid_stream_does_not_clear_the_instances_failures(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway]
) -> None:
    upstream = ReplayUpstream(
        sse_events(FIXTURES / "completion-ngram-stream.sse"),
        sse_events(FIXTURES / "completion-ngram-stream-usage.sse"),
        interval_s=0.05,
    )
    port = free_port()
    loop_thread.run(asyncio.start_server(upstream.handle, "127.0.0.1", port))
    fleet = Fleet(
        [Pool("p", "off", [f"http://127.0.0.1:{port}"])],
        ejection=EjectionPolicy(failures_to_eject=2),
        clock=FakeClock(),
    )
    instance = fleet.pools["p"].instances[0]
    instance.consecutive_failures = 1  # it failed once before this request
    gateway = run_gateway(gateway_over(fleet))
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{gateway.base_url}/v1/completions", json=STREAM_BODY) as response,
    ):
        next(response.iter_raw())
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: fleet.pools["p"].in_flight == 0, what="the attempt to end")
    assert instance.consecutive_failures == 1, "a client leaving is no success of the instance"
    # A request that completes still clears it.
    with httpx.Client(timeout=30) as client:
        assert client.post(f"{gateway.base_url}/v1/models").status_code == 200
    assert instance.consecutive_failures == 0


def test_a_hung_instance_is_logged_once_however_many_requests_it_fails(
    loop_thread: LoopThread,
    run_gateway: Callable[[Gateway], RunningGateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    silent = start_silent(loop_thread)
    replay, url = start_replay(loop_thread)
    clock = FakeClock()
    # Never ejected, so every request that picks it fails on it.
    never = EjectionPolicy(failures_to_eject=1_000_000)
    fleet = Fleet([Pool("p", "off", [silent, url])], ejection=never, clock=clock)
    gateway = run_gateway(gateway_over(fleet))

    async def many() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
            sent = [client.post("/v1/completions", json=STREAM_BODY) for _ in range(20)]
            return [r.status_code for r in await asyncio.gather(*sent)]

    with caplog.at_level("WARNING", logger="controller.gateway.app"):
        assert asyncio.run(many()) == [200] * 20
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert fleet.pools["p"].instances[0].consecutive_failures > 1  # it failed several
    assert replay.requests == 20 and len(failed) == 1, [r.getMessage() for r in failed]
