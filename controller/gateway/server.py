"""The gateway's own HTTP/1.1 front end: an asyncio protocol around :meth:`Gateway.handle`.

Why not uvicorn: measured with ``bench/gateway.py`` (replay upstream), about four fifths
of the gateway's CPU under uvicorn went to its per-event ASGI ``send`` path (message
dicts, state checks, flow-control events, one task per request to watch for a
disconnect) and the added latency per stream was 1.4 ms at one stream and 3.7 ms at 64.
A proxy that relays already-framed events needs none of it: here a streamed event costs
one chunk header and one ``transport.write``, a client disconnect is the transport's
``connection_lost`` cancelling the request's task, and requests are parsed by
``httptools`` (C, the parser uvicorn uses). The event loop is uvloop's when the server
runs on its own (:func:`run`).

What it speaks: HTTP/1.1 and 1.0 with keep-alive, ``content-length`` and chunked request
bodies, ``Expect: 100-continue``, pipelined requests (answered in order). Responses are
chunked unless :meth:`Gateway.handle` forwards a ``content-length``; an HTTP/1.0 client
gets the body delimited by closing the connection. No TLS, no WebSocket: the gateway
sits next to the fleet, and a request to upgrade is served as plain HTTP/1.1.

The ASGI interface (:meth:`Gateway.__call__`) stays for running the gateway inside
another ASGI server; both call the same :meth:`Gateway.handle`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import signal
import socket
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

import httptools

from controller.gateway.app import DirectResponse, Gateway, Headers, Request

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75.0
"""Seconds an idle client connection stays open: clients keep connections to a gateway
open between requests, as they do to vLLM (whose uvicorn default is 5 s; longer here so
a pooled client connection rarely meets a just-closed socket)."""

_MAX_BODY = 64 << 20
"""Largest request body accepted (bytes): prompts are text, and a body is held whole."""

_NO_BODY_STATUSES = frozenset({204, 304})


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


class _ClientResponse(DirectResponse):
    """:class:`controller.gateway.app.Response` written straight to the client's transport.

    ``write`` awaits only when the client's socket buffer is over its high-water mark
    (the protocol's ``pause_writing``), which is the back-pressure the upstream read
    then follows.
    """

    __slots__ = ("_chunked", "_close_delimited", "_no_body", "_protocol", "complete", "started")

    def __init__(self, protocol: GatewayProtocol, *, head_only: bool) -> None:
        self._protocol = protocol
        self._chunked = False
        self._close_delimited = False
        self._no_body = head_only
        self.started = False
        self.complete = False

    async def start(self, status: int, headers: Headers) -> None:
        protocol = self._protocol
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        has_length = False
        for name, value in headers:
            if name == b"content-length":
                has_length = True
            parts += (name, b": ", value, b"\r\n")
        if status in _NO_BODY_STATUSES or status < 200:
            self._no_body = True
        elif not has_length and not self._no_body:
            if protocol.http11:
                self._chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                self._close_delimited = True
                protocol.keep_alive = False
        if not protocol.keep_alive:
            parts.append(b"connection: close\r\n")
        elif not protocol.http11:
            parts.append(b"connection: keep-alive\r\n")  # HTTP/1.0 closes unless told
        parts.append(b"\r\n")
        self.started = True
        protocol.write(b"".join(parts))

    async def write(self, data: bytes) -> None:
        if self.write_now(data):
            await self._protocol.drain()

    def write_now(self, data: bytes) -> bool:
        if not data or self._no_body:
            return False
        protocol = self._protocol
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        protocol.write(data)
        return protocol.write_paused

    @property
    def chunked(self) -> bool:
        return self._chunked

    def write_framed(self, framed: bytes) -> bool:
        protocol = self._protocol
        protocol.write(framed)
        return protocol.write_paused

    def on_drained(self, callback: Callable[[], None]) -> None:
        self._protocol.on_drained(callback)

    async def end(self, data: bytes) -> None:
        self.end_now(data)

    def end_now(self, data: bytes) -> None:
        if self.complete:
            return
        if data and not self._no_body:
            if self._chunked:
                data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
            self._protocol.write(data)
        elif self._chunked:
            self._protocol.write(b"0\r\n\r\n")
        self.complete = True


class GatewayProtocol(asyncio.Protocol):
    """One client connection: parses requests, runs each as a task, one at a time."""

    def __init__(self, gateway: Gateway, server_state: _ServerState) -> None:
        self._gateway = gateway
        self._state = server_state
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: Headers = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._pending: collections.deque[tuple[Request, bool, bool]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._response: _ClientResponse | None = None
        self.idle_since: float | None = None
        """Loop time this connection last went idle between requests; None while a
        request is being read or served. :class:`_ServerState` closes it after
        ``keep_alive_s`` (one sweep for all connections rather than a timer per request:
        arming and cancelling a timer cost every request on its critical path)."""
        self._drain: asyncio.Future[None] | None = None
        self._drained: list[Callable[[], None]] = []
        self._closing = False
        self.write_paused = False
        self.keep_alive = True
        self.http11 = True

    # asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._state.connections.add(self)
        self.idle_since = self._loop.time()

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol to switch to: the request was complete and is served as HTTP/1.1.
            pass
        except httptools.HttpParserError as exc:
            self._refuse(400, f"invalid HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._state.discard(self)
        self._pending.clear()
        self._wake_drain()
        response = self._response
        if self._task is not None and response is not None and not response.complete:
            # The client left mid-response: cancelling the request closes its upstream
            # connection, which is what makes vLLM abort the request.
            self._task.cancel()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    # httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        if name == b"expect" and value.lower() == b"100-continue" and self._transport:
            # The client waits for this before it sends the body.
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_size += len(body)
        if self._body_size > _MAX_BODY:
            raise httptools.HttpParserError("request body too large")

    def on_message_complete(self) -> None:
        parser = self._parser
        method = parser.get_method().decode("latin-1")
        target = self._url.decode("latin-1")
        path = target.partition("?")[0]
        if "%" in path:
            path = urllib.parse.unquote(path)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(method, path, target, self._headers, body)
        http11 = parser.get_http_version() == "1.1"
        keep_alive = parser.should_keep_alive() and not self._state.shutting_down
        if self._task is None:
            self._start(request, http11, keep_alive)
        else:
            # Pipelined: answered in order; read no further until this one's turn.
            self._pending.append((request, http11, keep_alive))
            if self._transport is not None:
                self._transport.pause_reading()

    # requests ---------------------------------------------------------------------------

    def _start(self, request: Request, http11: bool, keep_alive: bool) -> None:
        self.http11, self.keep_alive = http11, keep_alive
        self._response = _ClientResponse(self, head_only=request.method == "HEAD")
        self._task = self._loop.create_task(self._serve(request, self._response))

    async def _serve(self, request: Request, response: _ClientResponse) -> None:
        try:
            await self._gateway.handle(request, response)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        except Exception:
            logger.exception("gateway failed on %s %s", request.method, request.target)
            if not response.started and not self._closing:
                self.keep_alive = False
                await response.start(500, [(b"content-length", b"21")])
                await response.end(b"Internal Server Error")
        finally:
            self._task = None
            self._response = None
            self._finished(response)

    def _finished(self, response: _ClientResponse) -> None:
        transport = self._transport
        if transport is None or self._closing:
            return
        if not response.complete or not self.keep_alive or self._state.shutting_down:
            self._close()
            return
        if self._pending:
            self._start(*self._pending.popleft())
            if not self._pending:
                transport.resume_reading()
        else:
            self.idle_since = self._loop.time()

    # plumbing ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self._closing:
            assert self._transport is not None
            self._transport.write(data)

    async def drain(self) -> None:
        if self._closing or not self.write_paused:
            return
        self._drain = self._loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def on_drained(self, callback: Callable[[], None]) -> None:
        if self._closing or not self.write_paused:
            callback()
        else:
            self._drained.append(callback)

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        callbacks, self._drained = self._drained, []
        for callback in callbacks:
            callback()

    def _refuse(self, status: int, message: str) -> None:
        logger.warning("refused a client request: %s", message)
        if self._task is None and self._transport is not None:
            body = message.encode("latin-1", "replace")
            self._transport.write(
                _STATUS_LINES[status] + b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body)
            )
        self._close()

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def close_if_idle_since(self, before: float) -> None:
        """Close this connection when it has been idle since ``before`` or earlier."""
        if self.idle_since is not None and self.idle_since <= before and self._task is None:
            self._close()

    def shutdown(self) -> None:
        """Close now if idle, else once the response in progress is complete."""
        if self._task is None:
            self._close()


class _ServerState:
    __slots__ = ("_sweeper", "connections", "drained", "keep_alive_s", "shutting_down")

    def __init__(self, keep_alive_s: float) -> None:
        self.keep_alive_s = keep_alive_s
        self.connections: set[GatewayProtocol] = set()
        self.shutting_down = False
        self.drained = asyncio.Event()
        """Set when the last connection closed after shutdown began."""
        self._sweeper: asyncio.TimerHandle | None = None

    def start_sweeping(self) -> None:
        """Close connections idle for ``keep_alive_s``, checking a few times per period
        (at most every second): an idle connection lives keep_alive_s plus at most that."""
        loop = asyncio.get_running_loop()
        interval = min(1.0, self.keep_alive_s / 4)

        def sweep() -> None:
            before = loop.time() - self.keep_alive_s
            for connection in list(self.connections):
                connection.close_if_idle_since(before)
            self._sweeper = loop.call_later(interval, sweep)

        self._sweeper = loop.call_later(interval, sweep)

    def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def discard(self, connection: GatewayProtocol) -> None:
        self.connections.discard(connection)
        if self.shutting_down and not self.connections:
            self.drained.set()


class GatewayServer:
    """The gateway listening on a socket in the running event loop.

    ``await GatewayServer.start(gateway, host=..., port=...)`` (or ``sock=``) listens;
    :meth:`close` stops accepting, lets responses in progress finish (up to
    ``grace_s``), then closes the gateway's upstream connections.
    """

    def __init__(self, gateway: Gateway, server: asyncio.Server, state: _ServerState) -> None:
        self.gateway = gateway
        self._server = server
        self._state = state

    @classmethod
    async def start(
        cls,
        gateway: Gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        keep_alive_s: float = KEEP_ALIVE_S,
        backlog: int = 2048,
    ) -> GatewayServer:
        state = _ServerState(keep_alive_s)
        loop = asyncio.get_running_loop()
        if sock is not None:
            server = await loop.create_server(
                lambda: GatewayProtocol(gateway, state), sock=sock, backlog=backlog
            )
        else:
            server = await loop.create_server(
                lambda: GatewayProtocol(gateway, state), host, port, backlog=backlog
            )
        state.start_sweeping()
        return cls(gateway, server, state)

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, grace_s: float = 30.0) -> None:
        self._state.shutting_down = True
        self._state.stop_sweeping()
        self._server.close()
        for connection in list(self._state.connections):
            connection.shutdown()
        if self._state.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._state.drained.wait(), grace_s)
        for connection in list(self._state.connections):
            connection._close()
        self.gateway.aclose()


def run(gateway: Gateway, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, on uvloop; then shut down gracefully."""
    import uvloop

    async def main() -> None:
        server = await GatewayServer.start(gateway, host=host, port=port)
        # Everything allocated so far (the CLI imports numpy, scipy, scikit-learn: about
        # 190k objects) lives as long as the process: out of the collector's sight, a
        # full collection no longer walks it. Walking it took 90-150 ms here, a stall
        # every stream in flight would wait out; the benchmark's runs trigger none while
        # serving, a gateway that runs for days eventually does.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await server.close()

    uvloop.run(main())
