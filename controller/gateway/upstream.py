"""A lean HTTP/1.1 client for the gateway's upstreams: keep-alive pools on asyncio.

Why not httpx: measured in ``bench/gateway.py`` on this machine, httpx's pooled
AsyncClient cost about 4–6 ms of CPU per streamed request (its connection pool scans
every connection on every request, and each I/O step goes through anyio), far above the
gateway's whole budget. This client does one thing: send a request to a vLLM instance
over a pooled connection and hand back the response head and the body chunks as they
arrive, with the response parsed by ``httptools`` (C, the parser uvicorn uses).

Back-pressure: when the client reading the stream falls behind, the connection stops
reading from the upstream socket above ``_HIGH_WATER`` buffered bytes.

Timeouts (:class:`UpstreamTimeouts`, the ``gateway.upstream_timeouts`` settings): a
connection must be made in ``connect_s``, else the attempt fails with
:class:`UpstreamTimeout`; each read after the first must come within ``between_chunks_s``
of the one before, else the exchange fails the same way. A response whose first byte has
not come within ``first_byte_s`` of the request is *overdue*: :meth:`UpstreamConnection.head`
then fails, while :meth:`UpstreamConnection.answer` lets the gateway start another
attempt beside it and keep waiting on this one (a slow instance still answers; a hung one
never does, see ``controller.gateway.app``). The two read deadlines are checked by one
sweep over the connections in use, about once a second, not by a timer per request or
per chunk (that would sit on every event's critical path): a read only counts itself,
and the sweep notes when the count last moved.

A sweep that runs late (the event loop was held up: a loaded machine, a long callback)
judges nothing that round: replies that arrived meanwhile may still sit unread in the
sockets, and the loop reads them before the next sweep.
"""

from __future__ import annotations

import asyncio
import collections
import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httptools

_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 16


_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class UpstreamError(Exception):
    """The connection failed or the upstream sent something that is not HTTP/1.1.

    ``local``: the failure is this process's (out of file descriptors or memory), not
    the upstream's, and says nothing about the instance."""

    def __init__(self, message: str, *, local: bool = False) -> None:
        super().__init__(message)
        self.local = local


class UpstreamTimeout(UpstreamError):
    """The upstream did not connect, answer or go on within its timeout."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """How long the gateway waits on an upstream (the ``gateway.upstream_timeouts``
    settings). A non-streaming completion sends its first byte only once the whole
    completion is generated, hence the long ``first_byte_s``."""

    connect_s: float = 2.0
    first_byte_s: float = 300.0
    """From the request sent to the response's first byte."""
    between_chunks_s: float = 60.0
    """From one read of the response to the next (a queued or prefilling request may
    be silent for a while between its head and its first event)."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]
    """Raw header pairs as received (names in the upstream's case)."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: ResponseHead | None = None
        self._complete = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._raw: Callable[[bytes, bytes], bool] | None = None
        self._on_end: Callable[[bytes], None] | None = None
        self._chunked = False
        self._at_chunk_boundary = False
        self.closed = False
        self.received_any = False
        """Whether this request got any response byte: a reused connection that fails
        before that was most likely closed by the upstream while idle."""
        self.reads = 0
        """Reads so far: the pool's sweep tells progress from a stall by this moving."""
        self.watched: tuple[int, float] | None = None
        """``(reads, loop time)`` when the sweep last saw ``reads`` move; None: not yet
        for this request (or while the gateway holds the upstream back)."""
        self.overdue: str | None = None
        """Why the response is overdue (no byte within ``first_byte_s``); None: it is not."""

    # asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.reads += 1
        if self._at_chunk_boundary and self._sink is not None:
            # Between two chunks of a chunked body, whole chunks (what vLLM's uvicorn
            # writes per event) are taken here without the parser's callbacks; see pipe().
            whole = whole_chunks(data)
            if whole is not None:
                payload, last = whole
                if last:
                    if self._on_end is None and payload:
                        self._sink(payload)
                        payload = b""
                    self._end_message(payload)
                    # The parser never saw this body end: the next response needs a
                    # fresh one (after the end went out: off the stream's critical path).
                    self._parser = httptools.HttpResponseParser(self)
                elif self._raw is None or not self._raw(data, payload):
                    self._sink(payload)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad response from upstream: {exc}"))
            return
        if self._sink is not None:
            # Piping (see pipe()): the body already went to the sink; the task waiting in
            # pipe() only needs waking at the end, which on_message_complete does.
            return
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._complete:
            self._fail(UpstreamError(f"upstream closed the connection: {exc!r}"))
        self._wake()

    # httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head = ResponseHead(self._parser.get_status_code(), self._headers)
        # Read here: once the message is complete the parser has reset for the next one.
        self._keep_alive = self._parser.should_keep_alive()
        self._chunked = self._at_chunk_boundary = any(
            name.lower() == b"transfer-encoding" and b"chunked" in value.lower()
            for name, value in self._headers
        )

    def on_chunk_header(self) -> None:
        self._at_chunk_boundary = False

    def on_chunk_complete(self) -> None:
        self._at_chunk_boundary = self._chunked and not self._complete

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink(body)
            return
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self._end_message(b"")

    def _end_message(self, last_payload: bytes) -> None:
        self._complete = True
        self._at_chunk_boundary = False
        if self._on_end is not None:
            self._on_end(last_payload)
        self._wake()

    # the gateway's side ---------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """End the exchange with ``error`` (closing the connection); whoever waits on it
        raises it."""
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._transport is not None:
            self._transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def send(self, request: bytes) -> None:
        assert self._transport is not None
        self._headers = []
        self._head = None
        self._complete = False
        self._keep_alive = False
        self.received_any = False
        self.watched = None
        self.overdue = None
        self.resume_reading()
        self._transport.write(request)

    async def head(self) -> ResponseHead:
        """The response head; raises :class:`UpstreamTimeout` once it is overdue."""
        while self._head is None:
            if self._error is not None:
                raise self._error
            if self.overdue is not None:
                raise UpstreamTimeout(self.overdue)
            await self._wait()
        return self._head

    def mark_overdue(self, why: str) -> None:
        """No byte came within ``first_byte_s`` (the pool's sweep): wake whoever waits."""
        if self.overdue is None and self._head is None:
            self.overdue = why
            self._wake()

    async def answer(self, *, past_due: bool = False) -> ResponseHead | None:
        """The response head, or None once it is overdue (the connection stays open: the
        head may still come). ``past_due``: wait for the head however late it is, until
        it comes, the connection fails or the caller closes it."""
        while self._head is None:
            if self._error is not None:
                raise self._error
            if self.overdue is not None and not past_due:
                return None
            await self._wait()
        return self._head

    async def chunk(self) -> bytes | None:
        """The next piece of the decoded body (chunked framing removed); None at its end."""
        while not self._chunks:
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            await self._wait()
        data = self._chunks.popleft()
        if self._chunks:
            # Hand over everything that is already here in one piece: fewer writes.
            data = b"".join((data, *self._chunks))
            self._chunks.clear()
        self._buffered = 0
        self.resume_reading()
        return data

    async def pipe(
        self,
        sink: Callable[[bytes], None],
        raw: Callable[[bytes, bytes], bool] | None = None,
        on_end: Callable[[bytes], None] | None = None,
    ) -> None:
        """Hand the rest of the body to ``sink`` piece by piece, as it arrives, and
        return at its end.

        ``sink`` runs inside the socket's read callback, so a streamed event reaches the
        client without a task switch. ``raw``, when given, is offered first every read
        that is whole chunks of a chunked body, as ``(received, payload)``: the bytes as
        received (framing included) and their payload; it returns True when it took care
        of them itself, False to have the payload handed to ``sink``. ``on_end`` runs in
        the same callback once the body is complete (not when it fails), with the body's
        last piece when that came in the same read as its end (b"" otherwise), so the end
        of a stream can go out in one write. None of them may block or raise; they may
        call :meth:`pause_reading` (back-pressure).

        Why: the gateway's work per event sits on the stream's critical path, and
        measured on this 2-core VM its cost there is mostly cache misses, several
        microseconds per Python call layer with caches cold between events: a vLLM event
        read here costs one bytes scan and one write, where the parser's callbacks cost
        four calls per chunk.
        """
        if self._chunks:
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            sink(data)
        if self._paused:
            self.resume_reading()
        if self._complete:
            if on_end is not None:
                on_end(b"")
            return
        self._sink, self._raw, self._on_end = sink, raw, on_end
        try:
            while not self._complete:
                if self._error is not None:
                    raise self._error
                await self._wait()
        finally:
            self._sink = self._raw = self._on_end = None

    def pause_reading(self) -> None:
        """Stop reading from the upstream socket (TCP then holds the upstream back)."""
        if not self._paused and self._transport is not None and not self.closed:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    @property
    def reusable(self) -> bool:
        return self._complete and not self.closed and self._error is None and self._keep_alive

    @property
    def waiting(self) -> bool:
        """Whether the response is still due and the gateway is not holding it back."""
        return not self._complete and not self._paused and not self.closed

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class UpstreamPool:
    """Idle keep-alive connections per upstream (host, port), reused last-in first-out,
    and the read deadlines of the connections in use (:class:`UpstreamTimeouts`)."""

    def __init__(
        self, timeouts: UpstreamTimeouts | None = None, max_idle_per_host: int = 256
    ) -> None:
        self.timeouts = timeouts or UpstreamTimeouts()
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._busy: set[UpstreamConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_due = 0.0
        """Loop time the next sweep was scheduled for."""
        self._skipped = False
        """Whether the last sweep ran late and judged nothing."""

    async def connect(self, host: str, port: int) -> tuple[UpstreamConnection, bool]:
        """A connection to (host, port) and whether it was reused from the pool."""
        idle = self._idle.get((host, port))
        while idle:
            connection = idle.pop()
            if not connection.closed:
                self._checked_out(connection)
                return connection, True
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(UpstreamConnection, host, port), self.timeouts.connect_s
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"cannot connect to {host}:{port} within {self.timeouts.connect_s:g} s"
            ) from exc
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to {host}:{port}: {exc!r}", local=exc.errno in _LOCAL_ERRNOS
            ) from exc
        self._checked_out(protocol)
        return protocol, False

    def _checked_out(self, connection: UpstreamConnection) -> None:
        self._busy.add(connection)
        if self._sweeper is None:
            self._schedule_sweep(asyncio.get_running_loop())

    def _schedule_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        interval = self._sweep_interval
        self._sweep_due = loop.time() + interval
        self._sweeper = loop.call_later(interval, self._sweep)

    @property
    def _sweep_interval(self) -> float:
        timeouts = self.timeouts
        return min(1.0, timeouts.first_byte_s / 4, timeouts.between_chunks_s / 4)

    def _sweep(self) -> None:
        """Mark overdue the responses whose first byte is late and fail the exchanges
        that went silent after it. Runs while connections are in use, about once a
        second: a deadline is met up to one interval late, and a request costs nothing
        for it on its own path. A sweep that runs more than an interval late judges
        nothing (what arrived while the loop was held up may not have been read yet);
        the next one, after the loop has read its sockets, does."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        timeouts = self.timeouts
        judge = self._skipped or now - self._sweep_due <= self._sweep_interval
        self._skipped = not judge
        for connection in list(self._busy):
            if connection.closed:
                self._busy.discard(connection)
                continue
            if not connection.waiting:
                connection.watched = None  # held back by the client, or complete
                continue
            watched = connection.watched
            if watched is None or watched[0] != connection.reads:
                connection.watched = (connection.reads, now)
                continue
            if not judge:
                continue
            if connection.received_any:
                limit = timeouts.between_chunks_s
                if now - watched[1] >= limit:
                    message = f"the upstream sent nothing more for {limit:g} s"
                    connection.fail(UpstreamTimeout(message))
                    self._busy.discard(connection)
            elif now - watched[1] >= timeouts.first_byte_s:
                connection.mark_overdue(
                    f"the upstream did not answer for {timeouts.first_byte_s:g} s"
                )
        self._sweeper = None
        if self._busy:
            self._schedule_sweep(loop)

    def release(self, host: str, port: int, connection: UpstreamConnection) -> None:
        """Back to the pool when the exchange completed cleanly; closed otherwise (a
        half-read response must not be reused, and closing it is what makes vLLM abort
        the request)."""
        self._busy.discard(connection)
        if not connection.reusable:
            connection.close()
            return
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < self.max_idle_per_host:
            idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for connection in self._busy:
            connection.close()
        self._busy.clear()
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


def encode_request(
    method: str, target: str, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """An HTTP/1.1 request with ``content-length``; ``headers`` must be hop-by-hop free."""
    parts = [
        method.encode("latin-1"),
        b" ",
        target.encode("latin-1"),
        b" HTTP/1.1\r\nhost: ",
        host,
        b"\r\ncontent-length: ",
        str(len(body)).encode(),
        b"\r\n",
    ]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


_HEX_DIGITS = b"0123456789abcdefABCDEF"
_LAST_CHUNK_END = b"\r\n"


def whole_chunks(data: bytes) -> tuple[bytes, bool] | None:
    """``(payload, ends_body)`` when ``data`` is one or more complete chunks of a chunked
    body without extensions, possibly ending with the body's last chunk (``0``, no
    trailers); None for anything else (a chunk cut short, extensions, trailers), which
    the parser then handles."""
    at, end = 0, len(data)
    parts: list[bytes] = []
    while at < end:
        line = data.find(b"\r\n", at, at + 10)
        if line <= at or data[at:line].strip(_HEX_DIGITS):
            return None
        start = line + 2
        size = int(data[at:line], 16)
        if size == 0:
            if data[start:] != _LAST_CHUNK_END:
                return None
            return b"".join(parts), True
        stop = start + size
        if data[stop : stop + 2] != b"\r\n":
            return None
        parts.append(data[start:stop])
        at = stop + 2
    if not parts:
        return None
    return (parts[0] if len(parts) == 1 else b"".join(parts)), False
