"""The gateway's own HTTP/1.1 front end (controller/gateway/server.py) over raw sockets:
what an HTTP client library would hide (framing, keep-alive, pipelining, HTTP/1.0,
``Expect: 100-continue``, malformed requests), and the raw-chunk fast path."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator

import pytest

from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool
from controller.gateway.server import GatewayLimits, GatewayServer
from tests.gateway.conftest import LoopThread, RunningGateway, gateway_runner
from tests.gateway.test_gateway_fakes import start_replay

STREAM = json.dumps({"model": "tiny-llama", "prompt": "def f(", "stream": True}).encode()


@pytest.fixture
def native(loop_thread: LoopThread) -> Iterator[RunningGateway]:
    _, upstream_url = start_replay(loop_thread)
    fleet = Fleet([Pool("p", "ngram:4", [upstream_url])], clock=lambda: 0.0)
    runner = gateway_runner("native")
    start: Callable[[Gateway], RunningGateway] = next(runner)
    yield start(Gateway(fleet))
    next(runner, None)


def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes the connection (the last request
    asks for that: a client that half-closes counts as gone, as under uvicorn)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def post(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def dechunk(body: bytes) -> bytes:
    out, at = b"", 0
    while True:
        line = body.index(b"\r\n", at)
        size = int(body[at:line], 16)
        out += body[line + 2 : line + 2 + size]
        at = line + 4 + size
        if size == 0:
            return out


def test_pipelined_requests_are_answered_in_order_on_one_connection(
    native: RunningGateway,
) -> None:
    get = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
    received = exchange(native.port, post("/v1/completions", STREAM) + get)
    first, _, rest = received.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in first.lower()
    events = dechunk(rest)
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in events
    second = rest[rest.index(b"0\r\n\r\n") + 5 :]
    assert second.startswith(b"HTTP/1.1 200 OK\r\n")
    assert second.endswith(b'"object":"model"}]}')


def test_http10_client_gets_the_same_stream_delimited_by_close(native: RunningGateway) -> None:
    chunked = exchange(native.port, post("/v1/completions", STREAM, extra="connection: close\r\n"))
    plain = exchange(native.port, post("/v1/completions", STREAM, version="1.0"))
    head, _, body = plain.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == dechunk(chunked.partition(b"\r\n\r\n")[2])


def test_expect_continue_is_answered_before_the_body_is_sent(native: RunningGateway) -> None:
    request = post("/v1/completions", STREAM, extra="expect: 100-continue\r\nconnection: close\r\n")
    head, body = request[: -len(STREAM)], STREAM
    with socket.create_connection(("127.0.0.1", native.port), timeout=30) as sock:
        sock.sendall(head)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_malformed_request_is_a_400_and_closes(native: RunningGateway) -> None:
    received = exchange(native.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"connection: close" in received


def test_idle_keep_alive_connections_are_closed_after_keep_alive_s_and_busy_ones_kept() -> None:
    async def run() -> tuple[bytes, bool]:
        fleet = Fleet([Pool("p", "off", ["http://127.0.0.1:9"])], clock=lambda: 0.0)
        limits = GatewayLimits(keep_alive_s=0.2)
        server = await GatewayServer.start(Gateway(fleet), limits=limits)
        try:
            idle_reader, _ = await asyncio.open_connection("127.0.0.1", server.port)
            busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", server.port)
            busy_writer.write(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 10\r\n\r\n{")
            # Closed by the server: the idle one within keep_alive_s plus one sweep.
            idle_end = await asyncio.wait_for(idle_reader.read(), timeout=5)
            await asyncio.sleep(0.5)
            return idle_end, busy_reader.at_eof()
        finally:
            await server.close(grace_s=0.1)

    idle_end, busy_closed = asyncio.run(run())
    assert idle_end == b""
    assert not busy_closed, "a connection in the middle of a request is not idle"
