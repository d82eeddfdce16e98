"""What a client may take of the gateway's own front end (``GatewayLimits``), over raw
sockets: slow requests, oversized ones, bodies without a length, too many connections,
``Expect: 100-continue`` behind a response in progress, and running out of file
descriptors. Every deadline here is a bound the server must act within; the tests only
wait for what it does, they time nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.gateway import ReplayUpstream
from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool
from controller.gateway.server import GatewayLimits
from tests.gateway.conftest import LoopThread, RunningGateway, gateway_runner, wait_until
from tests.gateway.test_gateway_fakes import start_replay
from tests.gateway.test_server import STREAM, dechunk, post

ROOT = Path(__file__).resolve().parents[2]
LIMITS = GatewayLimits(
    header_timeout_s=0.4,
    body_timeout_s=0.4,
    max_url_bytes=256,
    max_header_bytes=1024,
    max_body_bytes=4096,
    max_connections=3,
)


@pytest.fixture
def limited(loop_thread: LoopThread) -> Iterator[tuple[RunningGateway, ReplayUpstream]]:
    replay, upstream_url = start_replay(loop_thread)
    fleet = Fleet([Pool("p", "ngram:4", [upstream_url])], clock=lambda: 0.0)
    runner = gateway_runner("native", LIMITS)
    start: Callable[[Gateway], RunningGateway] = next(runner)
    yield start(Gateway(fleet)), replay
    next(runner, None)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_headers_that_do_not_arrive_in_time_get_408_and_the_connection_closed(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    with connect(gateway.port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n")  # never finished
        response = read_all(sock)
    assert status_of(response) == 408
    assert b"connection: close" in response


def test_a_body_that_does_not_arrive_in_time_gets_408(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    with connect(gateway.port) as sock:
        sock.sendall(post("/v1/completions", STREAM)[:-5])  # the body's last bytes never come
        response = read_all(sock)
    assert status_of(response) == 408


def test_a_long_url_is_414_and_a_large_header_block_431(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, replay = limited
    with connect(gateway.port) as sock:
        sock.sendall(b"GET /v1/models?" + b"q" * 300 + b" HTTP/1.1\r\nhost: gw\r\n\r\n")
        assert status_of(read_all(sock)) == 414
    many = b"".join(b"x-filler-%d: %s\r\n" % (i, b"v" * 50) for i in range(40))
    with connect(gateway.port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n" + many + b"\r\n")
        assert status_of(read_all(sock)) == 431
    assert replay.requests == 0, "nothing refused went upstream"


def test_one_header_line_that_never_ends_is_refused_while_it_grows(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    """httptools gathers a header line itself until it ends: the server must stop it
    from the reads alone, long before the line would end."""
    gateway, _ = limited
    with connect(gateway.port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nx-huge: ")
        refused = b""
        for _ in range(200):  # far beyond the limits, in separate reads
            try:
                sock.sendall(b"v" * 1024)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.005)
            sock.setblocking(False)
            try:
                refused += sock.recv(65536)
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
            if refused:
                break
        refused += read_all(sock)
    assert status_of(refused) == 431


def test_a_content_length_over_the_limit_is_413_before_the_body_is_sent(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000000000\r\n"
        b"expect: 100-continue\r\n\r\n"
    )
    with connect(gateway.port) as sock:
        sock.sendall(head)  # and no body at all: the answer must not wait for it
        response = read_all(sock)
    assert status_of(response) == 413, "a final status instead of 100 Continue"
    assert b"100 Continue" not in response


def test_a_chunked_body_that_grows_past_the_limit_is_413(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    chunk = b"%x\r\n%s\r\n" % (1000, b"x" * 1000)
    with connect(gateway.port) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunk * 5
        )
        response = read_all(sock)
    assert status_of(response) == 413


def test_a_post_with_neither_length_nor_chunked_encoding_is_411(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, replay = limited
    with connect(gateway.port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n\r\n" + STREAM)
        response = read_all(sock)
    assert status_of(response) == 411
    assert replay.requests == 0


def test_past_max_connections_a_new_one_gets_503_and_is_closed(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    held = [connect(gateway.port) for _ in range(LIMITS.max_connections)]
    try:
        # Each held connection answered once, so the server surely counts it.
        for sock in held:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        with connect(gateway.port) as extra:
            response = read_all(extra)
        assert status_of(response) == 503
        assert json.loads(response.partition(b"\r\n\r\n")[2])["error"]["message"]
    finally:
        for sock in held:
            sock.close()

    # With those closed there is room again, once the server has seen them go.
    def answered() -> int:
        with connect(gateway.port) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
            return status_of(read_all(sock))

    wait_until(lambda: answered() == 200, what="room for a new connection")


def test_pipelined_expect_continue_waits_for_the_response_before_it(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    """The second request's ``100 Continue`` must follow the first response's end, not
    land inside its chunked body."""
    gateway, _ = limited
    second_head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nexpect: 100-continue\r\nconnection: close\r\n\r\n" % len(STREAM)
    )
    with connect(gateway.port) as sock:
        sock.sendall(post("/v1/completions", STREAM) + second_head)
        received = b""
        while b"100 Continue" not in received:
            chunk = sock.recv(65536)
            assert chunk, "closed before the 100 Continue"
            received += chunk
        first, _, rest = received.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        body_end = rest.index(b"0\r\n\r\n") + 5
        assert dechunk(rest[:body_end]).endswith(b"data: [DONE]\n\n")
        assert rest[body_end:].startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(STREAM)
        received += read_all(sock)
    second = received[received.index(b"100 Continue\r\n\r\n") + 16 :]
    assert second.startswith(b"HTTP/1.1 200 OK\r\n")
    assert second.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_an_error_in_a_pipelined_request_waits_for_the_response_before_it(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    with connect(gateway.port) as sock:
        sock.sendall(post("/v1/completions", STREAM) + b"NOT HTTP\r\n\r\n")
        received = read_all(sock)
    first, _, rest = received.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    body_end = rest.index(b"0\r\n\r\n") + 5
    assert dechunk(rest[:body_end]).endswith(b"data: [DONE]\n\n")
    assert rest[body_end:].startswith(b"HTTP/1.1 400 Bad Request\r\n")


OUT_OF_FDS = r"""
import asyncio, logging, os, socket, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")

from bench.gateway import ReplayUpstream
from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Pool
from controller.gateway.server import GatewayServer


async def main():
    fleet = Fleet([Pool("p", "off", ["http://127.0.0.1:9"])], clock=time.monotonic)
    server = await GatewayServer.start(Gateway(fleet))
    clients = []
    for _ in range(3):
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", server.port))
        except BlockingIOError:
            pass
        clients.append(client)
    # Every descriptor taken: the listener's accepts fail with EMFILE from here on.
    fillers = []
    try:
        while True:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    await asyncio.sleep(2.0)  # many attempts at the first back-offs
    for fd in fillers:
        os.close(fd)
    loop = asyncio.get_running_loop()
    for client in clients:
        request = b"GET /nowhere HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
        await loop.sock_sendall(client, request)
        answer = await asyncio.wait_for(loop.sock_recv(client, 100), 30)
        print("ANSWER", answer.split(b"\r\n")[0].decode())
    await server.close(grace_s=1)


asyncio.run(main())
"""


def test_out_of_file_descriptors_the_listener_backs_off_and_logs_once() -> None:
    result = subprocess.run(
        [sys.executable, "-c", OUT_OF_FDS],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    logged = [line for line in lines if "cannot accept connections" in line]
    assert len(logged) == 1, result.stdout
    assert "Too many open files" in logged[0]
    assert "Traceback" not in result.stderr and "out of system resource" not in result.stderr
    # Once descriptors were free again the waiting clients were served (404: no such path).
    assert [line for line in lines if line.startswith("ANSWER")] == [
        "ANSWER HTTP/1.1 404 Not Found"
    ] * 3


def test_no_100_continue_once_the_pipelined_body_came_without_waiting(
    limited: tuple[RunningGateway, ReplayUpstream],
) -> None:
    gateway, _ = limited
    second = post("/v1/completions", STREAM, extra="expect: 100-continue\r\n")
    last = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
    with connect(gateway.port) as sock:
        sock.sendall(post("/v1/completions", STREAM) + second)
        received = b""
        while received.count(b"\r\n0\r\n\r\n") < 2:  # both streamed responses ended
            chunk = sock.recv(65536)
            assert chunk, "closed early"
            received += chunk
        sock.sendall(
            last
        )  # whatever the server wrote after the second response precedes this one's
        received += read_all(sock)
    assert b"100 Continue" not in received
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 3
