"""The gateway's own HTTP/1.1 front end: an asyncio protocol around :meth:`Gateway.handle`.

Why not uvicorn: measured with ``bench/gateway.py`` (replay upstream), about four fifths
of the gateway's CPU under uvicorn went to its per-event ASGI ``send`` path (message
dicts, state checks, flow-control events, one task per request to watch for a
disconnect) and the added latency per stream was 1.4 ms at one stream and 3.7 ms at 64.
A proxy that relays already-framed events needs none of it: here a streamed event costs
one chunk header and one ``transport.write``, a client disconnect is the transport's
``connection_lost`` cancelling the request's task, and requests are parsed by
``httptools`` (C, the parser uvicorn uses). The event loop is uvloop's in a gateway
worker process (:mod:`controller.gateway.workers`).

What it speaks: HTTP/1.1 and 1.0 with keep-alive, ``content-length`` and chunked request
bodies, ``Expect: 100-continue``, pipelined requests (answered in order). Responses are
chunked unless :meth:`Gateway.handle` forwards a ``content-length``; an HTTP/1.0 client
gets the body delimited by closing the connection. No TLS, no WebSocket: the gateway
sits next to the fleet, and a request to upgrade is served as plain HTTP/1.1.

What a client may take (:class:`GatewayLimits`, the ``gateway.limits`` settings): a
request's headers and its body must arrive in time (else 408), its URL, header block and
body stay under their sizes (414, 431, 413: a ``content-length`` over the limit is
refused before any of the body is read), a body needs a ``content-length`` or chunked
encoding (else 411), and past ``max_connections`` a new connection gets a 503 and is
closed. All deadlines are checked by one sweep over the connections about once a
second, never by a timer per request. A refused request closes its connection after the
responses before it (the client's input is read and dropped for a moment, so that the
refusal is not lost to a reset).

The ASGI interface (:meth:`Gateway.__call__`) stays for running the gateway inside
another ASGI server; both call the same :meth:`Gateway.handle`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import math
import os
import resource
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

import httptools

from controller.gateway.app import DirectResponse, Gateway, Headers, Request, ResponseAborted
from controller.gateway.throttle import Throttled

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """What one client may take of the gateway (the ``gateway.limits`` settings)."""

    keep_alive_s: float = 75.0
    """Seconds an idle client connection stays open between requests: clients keep
    connections to a gateway open between requests, as they do to vLLM (whose uvicorn
    default is 5 s; longer here so a pooled client connection rarely meets a
    just-closed socket)."""
    header_timeout_s: float = 10.0
    """From a request's first byte to the end of its headers; a new connection must
    also start its first request within this (or ``keep_alive_s`` if shorter). Past it:
    408 and the connection closed."""
    body_timeout_s: float = 60.0
    """From the end of a request's headers to the end of its body: 408 and closed."""
    max_url_bytes: int = 8192
    """Longest request target (path and query): 414."""
    max_header_bytes: int = 64 * 1024
    """Largest header block (names and values of one request together): 431."""
    max_body_bytes: int = 64 << 20
    """Largest request body: 413. Prompts are text, and a body is held whole."""
    max_connections: int = 4096
    """Client connections open at once; a new one past it gets 503 and is closed. Fewer
    when the open-file limit cannot cover them (see :func:`connection_budget`)."""


FDS_PER_CONNECTION = 2
"""A client connection and the upstream connection serving it."""
FD_RESERVE = 128
"""File descriptors kept out of the connection budget: the store, the API, logs, the
classifier's files, idle upstream connections beyond one per client."""
LINGER_S = 2.0
"""How long a refused connection's further input is read and dropped before closing:
closing a socket with unread input resets it, which can destroy the refusal in flight."""
ACCEPT_BATCH = 128
ACCEPT_BACKOFF_S = (0.05, 1.0)
"""Accepting pauses this long after running out of file descriptors (doubling from the
first to the second figure while it lasts)."""
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_NO_BODY_STATUSES = frozenset({204, 304})
_WATCHED_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"expect"})
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# Where a connection is in reading its current request (``GatewayProtocol._phase``).
_IDLE, _HEAD, _BODY, _LINGER = 0, 1, 2, 3


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def _error_response(status: int, message: str, *, extra: bytes = b"") -> bytes:
    """A whole response that closes the connection, with an OpenAI-style error body."""
    body = json.dumps({"error": {"message": message, "type": HTTPStatus(status).phrase}})
    data = body.encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\n%bconnection: close\r\n\r\n"
    return _STATUS_LINES[status] + head % (len(data), extra) + data


_BUSY = _error_response(503, "the gateway is at its connection limit", extra=b"retry-after: 1\r\n")


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_budget(wanted: int) -> int:
    """How many client connections this process can hold: ``wanted``, or fewer where the
    open-file limit cannot cover two descriptors for each plus ``FD_RESERVE`` beside what
    is open already. The soft limit is raised toward the hard one first when it is short:
    a server that runs out of descriptors fails every client, not only the newest."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _open_fds()
    needed = FDS_PER_CONNECTION * wanted + FD_RESERVE + in_use
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - in_use - FD_RESERVE) // FDS_PER_CONNECTION))


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


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request the limits refuse."""


class GatewayProtocol(asyncio.Protocol):
    """One client connection: parses requests, runs each as a task, one at a time."""

    def __init__(self, gateway: Gateway, server_state: _ServerState) -> None:
        self._gateway = gateway
        self._state = server_state
        self._limits = server_state.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._phase = _IDLE
        self.deadline = math.inf
        """Loop time by which the connection must have moved on from ``_phase`` (the
        next request begun, the headers or the body received, the lingering done);
        checked by :class:`_ServerState`'s sweep while no request is being served (one
        sweep for all connections rather than a timer per request: arming and
        cancelling a timer cost every request on its critical path)."""
        self._url = b""
        self._headers: Headers = []
        self._header_bytes = 0
        self._head_reads = -1
        self._body: list[bytes] = []
        self._body_size = 0
        self._content_length: bytes | None = None
        self._chunked_body = False
        self._expect_continue = False
        self._continue_owed = False
        self._refusal: tuple[int, str] | None = None
        """Set by a parser callback just before it stops the parser."""
        self._deferred: tuple[int, str] | None = None
        """A refusal that waits for the responses before it to be complete."""
        self._pending: collections.deque[tuple[Request, bool, bool]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._response: _ClientResponse | None = None
        self._drain: asyncio.Future[None] | None = None
        self._drained: list[Callable[[], None]] = []
        self._closing = False
        self.counted_as_accepting = False
        """Set while the listener counts this connection in ``accepting``: from
        ``connection_made`` on it counts in ``connections`` instead, never in both (a
        burst of accepts would otherwise see the limit early and turn clients away)."""
        self.write_paused = False
        self.keep_alive = True
        self.http11 = True

    # asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        state = self._state
        if self.counted_as_accepting:
            self.counted_as_accepting = False
            state.accepting -= 1
        state.connections.add(self)
        limits = self._limits
        self.deadline = self._loop.time() + min(limits.keep_alive_s, limits.header_timeout_s)
        if state.shutting_down:
            self._close()

    def data_received(self, data: bytes) -> None:
        if self._phase == _LINGER:
            return  # refused: what else the client sends is dropped until it leaves
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol to switch to: the request was complete and is served as HTTP/1.1.
            pass
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            self._refuse(*(refusal or (400, f"invalid HTTP request: {exc}")))
            return
        if self._phase == _HEAD:
            self._head_continues(len(data))

    def _head_continues(self, received: int) -> None:
        """A head still incomplete after a read. httptools gathers a header line that
        spans reads before any callback sees it, so a header that never ends is caught
        here: every read after the first of a head is head only."""
        if self._head_reads < 0:
            self._head_reads = 0  # the first read may hold the previous request's end
            return
        self._head_reads += received
        limits = self._limits
        if self._head_reads > limits.max_header_bytes + limits.max_url_bytes:
            self._refuse(431, "request header fields too large")

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
        self._phase = _HEAD
        self.deadline = self._loop.time() + self._limits.header_timeout_s
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._head_reads = -1
        self._body = []
        self._body_size = 0
        self._content_length = None
        self._chunked_body = self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        url = self._url + url
        if len(url) > self._limits.max_url_bytes:
            self._refusal = (414, "request URL too long")
            raise _Refused
        self._url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers.append((name, value))
        size = self._header_bytes + len(name) + len(value)
        if size > self._limits.max_header_bytes:
            self._refusal = (431, "request header fields too large")
            raise _Refused
        self._header_bytes = size
        if name in _WATCHED_HEADERS:
            if name == b"content-length":
                self._content_length = value
            elif name == b"transfer-encoding":
                self._chunked_body = True
            elif value.lower() == b"100-continue":
                self._expect_continue = True

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self.deadline = self._loop.time() + self._limits.body_timeout_s
        length = self._content_length
        if length is not None:
            if int(length) > self._limits.max_body_bytes:
                self._refusal = (413, "request body too large")
                raise _Refused
        elif not self._chunked_body and self._parser.get_method() in _BODY_METHODS:
            # Without either, where the body ends is unknown (its bytes would be read as
            # the next request).
            self._refusal = (411, "a request body needs content-length or chunked encoding")
            raise _Refused
        if self._expect_continue and self._parser.get_http_version() == "1.1":
            if self._task is None:
                self._transport_write(_CONTINUE)  # the client waits for it to send the body
            else:
                # A response is in progress on this connection: the 100 goes out once the
                # responses before this request are complete, not inside them.
                self._continue_owed = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_size += len(body)
        if self._body_size > self._limits.max_body_bytes:
            self._refusal = (413, "request body too large")
            raise _Refused

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self.deadline = math.inf
        self._continue_owed = False  # the client sent the body without waiting for it
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
        except ResponseAborted:
            self.keep_alive = False  # the gateway said why; the body stays incomplete
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
            if not self._pending and self._deferred is None:
                transport.resume_reading()
            return
        if self._deferred is not None:
            self._refuse(*self._deferred)
            return
        if self._continue_owed:
            self._continue_owed = False
            transport.write(_CONTINUE)
        # Whatever this connection was doing waited for the response: its time starts now.
        limits = self._limits
        phase = self._phase
        if phase == _IDLE:
            wait = limits.keep_alive_s
        elif phase == _HEAD:
            wait = limits.header_timeout_s
        else:
            wait = limits.body_timeout_s
        self.deadline = self._loop.time() + wait

    # plumbing ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self._closing:
            assert self._transport is not None
            self._transport.write(data)

    def _transport_write(self, data: bytes) -> None:
        if self._transport is not None and not self._closing:
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
        """Answer ``status`` and close: at once when no response is in progress, else
        after it and the pipelined ones before this request (reading stops meanwhile)."""
        transport = self._transport
        if transport is None or self._closing:
            return
        self._phase = _LINGER
        if self._task is not None:
            self._deferred = (status, message)
            transport.pause_reading()
            return
        self._deferred = None
        self._state.refusals.warning("refused a client request: %d %s", status, message)
        transport.write(_error_response(status, message))
        # Read and drop what the client still sends, briefly, then close (see LINGER_S).
        self._closing = True
        self.deadline = self._loop.time() + LINGER_S
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    @property
    def serving(self) -> bool:
        return self._task is not None

    def expire(self) -> None:
        """The sweep found :attr:`deadline` passed while nothing was being served."""
        if self._phase == _HEAD or self._phase == _BODY:
            self._refuse(408, "request not received in time")
        else:
            self._close()  # idle, or done lingering

    def shutdown(self) -> None:
        """Close now if idle, else once the response in progress is complete."""
        if self._task is None:
            self._close()


class _ServerState:
    __slots__ = (
        "_sweeper",
        "accepting",
        "connections",
        "drained",
        "limits",
        "max_connections",
        "refusals",
        "shutting_down",
        "turned_away",
    )

    def __init__(self, limits: GatewayLimits) -> None:
        self.limits = limits
        self.max_connections = connection_budget(limits.max_connections)
        if self.max_connections < limits.max_connections:
            logger.warning(
                "gateway: at most %d client connections (max_connections %d is more than "
                "the open-file limit covers at %d descriptors each plus %d spare)",
                self.max_connections,
                limits.max_connections,
                FDS_PER_CONNECTION,
                FD_RESERVE,
            )
        self.connections: set[GatewayProtocol] = set()
        self.accepting = 0
        """Accepted sockets whose protocol is not made yet (they count as connections)."""
        self.shutting_down = False
        self.drained = asyncio.Event()
        """Set when the last connection closed after shutdown began."""
        self.refusals = Throttled(logger)
        self.turned_away = Throttled(logger)
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def full(self) -> bool:
        return len(self.connections) + self.accepting >= self.max_connections

    def start_sweeping(self) -> None:
        """Expire connections past their deadline, checking a few times per shortest
        period (at most every second): each lives its period plus at most that."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        shortest = min(limits.keep_alive_s, limits.header_timeout_s, limits.body_timeout_s)
        interval = min(1.0, shortest / 4)

        def sweep() -> None:
            now = loop.time()
            for connection in [c for c in self.connections if c.deadline <= now]:
                if not connection.serving:
                    connection.expire()
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


class _Listener:
    """Accepts client connections itself, rather than through ``loop.create_server``.

    Out of file descriptors, asyncio's accept loop logs a traceback per attempt (up to
    its backlog per wake-up) and schedules one restart per failure, and uvloop's closes
    the server for good. Here accepting pauses (``ACCEPT_BACKOFF_S``) and the trouble is
    logged once per ``LOG_EVERY_S``. A connection past the budget is answered 503 on the
    bare socket and closed, before a transport or protocol is made for it.
    """

    def __init__(
        self,
        sock: socket.socket,
        state: _ServerState,
        factory: Callable[[], GatewayProtocol],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._state = state
        self._factory = factory
        self._backoff_s = ACCEPT_BACKOFF_S[0]
        self._retry: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._trouble = Throttled(logger)
        self._closed = False
        sock.setblocking(False)
        self._listen()

    def _listen(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        state = self._state
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._back_off(exc)
                return
            self._backoff_s = ACCEPT_BACKOFF_S[0]
            if state.full or state.shutting_down:
                _turn_away(conn)
                state.turned_away.warning(
                    "gateway: turned a connection away with 503 (%d open, the limit)",
                    len(state.connections),
                )
                continue
            conn.setblocking(False)
            state.accepting += 1
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        made: list[GatewayProtocol] = []

        def protocol() -> GatewayProtocol:
            made.append(self._factory())
            made[0].counted_as_accepting = True
            return made[0]

        try:
            await self._loop.connect_accepted_socket(protocol, conn)
        except Exception as exc:
            conn.close()
            self._trouble.warning("gateway: could not take a connection: %r", exc)
        finally:
            if not made or made[0].counted_as_accepting:
                if made:
                    made[0].counted_as_accepting = False
                self._state.accepting -= 1

    def _back_off(self, exc: OSError) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(self._backoff_s, self._listen)
        if exc.errno in _OUT_OF_RESOURCES:
            self._trouble.warning(
                "gateway: cannot accept connections (%s); accepting again in %.2f s",
                os.strerror(exc.errno or 0),
                self._backoff_s,
            )
        else:
            self._trouble.warning("gateway: accept failed (%r); retrying", exc)
        self._backoff_s = min(2 * self._backoff_s, ACCEPT_BACKOFF_S[1])

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


def _turn_away(conn: socket.socket) -> None:
    """503 and close, holding nothing: what the client already sent is dropped first,
    since closing over unread input resets the connection, which can destroy the 503."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(_BUSY)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass
    conn.close()


class GatewayServer:
    """The gateway listening on a socket in the running event loop.

    ``await GatewayServer.start(gateway, host=..., port=...)`` (or ``sock=``, bound)
    listens; :meth:`close` stops accepting, lets responses in progress finish (up to
    ``grace_s``), then closes the gateway's upstream connections.
    """

    def __init__(self, gateway: Gateway, listener: _Listener, state: _ServerState) -> None:
        self.gateway = gateway
        self._listener = listener
        self._state = state

    @classmethod
    async def start(
        cls,
        gateway: Gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        limits: GatewayLimits | None = None,
        backlog: int = 2048,
    ) -> GatewayServer:
        state = _ServerState(limits or GatewayLimits())
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=backlog)
        else:
            sock.listen(backlog)
        listener = _Listener(sock, state, lambda: GatewayProtocol(gateway, state))
        state.start_sweeping()
        return cls(gateway, listener, state)

    @property
    def port(self) -> int:
        return self._listener.port

    async def close(self, grace_s: float = 30.0) -> None:
        self._state.shutting_down = True
        self._state.stop_sweeping()
        self._listener.close()
        for connection in list(self._state.connections):
            connection.shutdown()
        if self._state.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._state.drained.wait(), grace_s)
        for connection in list(self._state.connections):
            connection._close()
        self.gateway.aclose()
