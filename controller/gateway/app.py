"""The gateway: an OpenAI-compatible reverse proxy in front of vLLM pools.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are classified, routed by the
routing table, balanced least-in-flight inside the pool, retried on another instance
while nothing has reached the client yet, relayed (SSE event by event) and observed.
Every other path (``/v1/models`` included) is passed through to an instance of the
default pool, since every pool serves the same models.

:meth:`Gateway.handle` does that for one :class:`Request`, writing to a
:class:`Response`. Two front ends call it: the gateway's own HTTP/1.1 server
(:mod:`controller.gateway.server`, what ``specpilot gateway`` runs), whose responses are
:class:`DirectResponse` and can be written from the upstream socket's read callback, and
:meth:`Gateway.__call__`, raw ASGI for any ASGI server. Raw ASGI rather than
Starlette/FastAPI: the proxy touches every streamed chunk, and a framework's
request/response objects would add work per request and per chunk without buying
anything here. Under uvicorn, most of the gateway's CPU per stream went to the per-event
ASGI send path; the native front end costs about a quarter less per stream at one stream
(``bench/gateway.py --gateway-server``).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import orjson

from collectors.observations import RequestObservation
from controller.gateway.classify import (
    DEFAULT_CLASS,
    WORKLOAD_CLASS_HEADER,
    Classifier,
    ConstantClassifier,
)
from controller.gateway.observe import ObservationSink, observation_from_response
from controller.gateway.routing import (
    Clock,
    Fleet,
    Instance,
    NoInstanceAvailable,
    Pool,
    RoutingTable,
    StaticRoutingTable,
)
from controller.gateway.sse import SseRelay, json_object
from controller.gateway.upstream import (
    ResponseHead,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
    encode_request,
)
from policies.arms import ConcurrencyBuckets

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class Request(NamedTuple):
    """One client request, read whole, as either front end hands it to :meth:`Gateway.handle`.

    A named tuple: built on every request's critical path, where a frozen dataclass's
    ``__init__`` costs several times as much."""

    method: str
    path: str
    """Percent-decoded path without the query: what routing looks at."""
    target: str
    """The request target as the client sent it (raw path and query): what goes upstream."""
    headers: Headers
    """Header pairs as received, names lower-case."""
    body: bytes


class Response(Protocol):
    """Where :meth:`Gateway.handle` writes its answer: ``start`` once, ``write`` any number
    of times (each piece goes to the client at once), ``end`` once. The front end frames
    the body (chunked unless the headers carry a ``content-length``)."""

    async def start(self, status: int, headers: Headers) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes) -> None: ...


class DirectResponse(abc.ABC):
    """A :class:`Response` that can also be written synchronously, from the upstream
    socket's read callback (the native front end's; an ASGI ``send`` cannot). A base
    class rather than a protocol so that telling one apart is a cheap ``isinstance``."""

    @abc.abstractmethod
    async def start(self, status: int, headers: Headers) -> None: ...

    @abc.abstractmethod
    async def write(self, data: bytes) -> None: ...

    @abc.abstractmethod
    async def end(self, data: bytes) -> None: ...

    @abc.abstractmethod
    def write_now(self, data: bytes) -> bool:
        """Send ``data`` to the client now; True when the client's socket buffer is over
        its high-water mark and the caller should stop feeding it until ``on_drained``."""

    @property
    @abc.abstractmethod
    def chunked(self) -> bool:
        """Whether the body goes out in chunked encoding (known once started)."""

    @abc.abstractmethod
    def write_framed(self, framed: bytes) -> bool:
        """Like :meth:`write_now` for bytes already in chunked framing (``chunked``)."""

    @abc.abstractmethod
    def end_now(self, data: bytes) -> None:
        """:meth:`end`, synchronously; a later :meth:`end` does nothing."""

    @abc.abstractmethod
    def on_drained(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client's socket buffer has drained (or it left)."""


logger = logging.getLogger(__name__)

_DONE_EVENT = b"data: [DONE]\n\n"
INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes. Host and
# content-length are set by the client library for the upstream request.
_REQUEST_SKIP = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        # uvicorn already answered any 100-continue; the upstream gets the whole body.
        b"expect",
    }
)
_RESPONSE_SKIP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"}
)
# Statuses that say "this instance cannot serve now", not "this request is wrong":
# worth another instance while the client has seen nothing.
_RETRY_STATUSES = frozenset({502, 503, 504})


class UpstreamFailed(Exception):
    """An attempt failed before anything reached the client; another instance may serve."""


class Gateway:
    """The ASGI app. ``sink`` receives one observation per request that completed.

    ``fleet`` holds the pools and their clock (monotonic, drives ejection);
    ``wall_clock`` stamps ``finished_at``. A client disconnect cancels the upstream
    request: its connection is closed, which makes vLLM abort the request.
    """

    def __init__(
        self,
        fleet: Fleet,
        *,
        routing: RoutingTable | None = None,
        classifier: Classifier | None = None,
        sink: ObservationSink | None = None,
        buckets: ConcurrencyBuckets | None = None,
        upstreams: UpstreamPool | None = None,
        max_attempts: int = 3,
        wall_clock: Clock = time.time,
    ) -> None:
        self.fleet = fleet
        self.routing: RoutingTable = routing or StaticRoutingTable(fleet.default_pool)
        self.classifier: Classifier = classifier or ConstantClassifier()
        self.sink = sink
        self.buckets = buckets or ConcurrencyBuckets()
        self.upstreams = upstreams or UpstreamPool()
        self.max_attempts = max_attempts
        self._wall_clock = wall_clock

    def aclose(self) -> None:
        self.upstreams.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point, for running the gateway under any ASGI server.

        ``specpilot gateway`` serves :meth:`handle` directly (:mod:`controller.gateway.server`),
        which costs the client less per streamed event than an ASGI server's send path.
        """
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        target: str = (
            scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        )
        query: bytes = scope.get("query_string", b"")
        if query and "?" not in target:
            target += "?" + query.decode("latin-1")
        request = Request(scope["method"], scope["path"], target, scope["headers"], body)
        # Watch for the client going away while we wait on the upstream: uvicorn's send()
        # silently drops writes to a closed connection, so only receive() tells.
        # After the response is complete uvicorn's receive() also reports a disconnect;
        # that one must not cancel the task (it may be in uvicorn's own code by then).
        response = _AsgiResponse(send)
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, task, response))
        try:
            await self.handle(request, response)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled() or not watcher.result():
                raise
            # The client left: the upstream response was closed on the way out.
            task.uncancel()
        finally:
            watcher.cancel()

    async def handle(self, request: Request, response: Response) -> None:
        """Serve one request. The caller cancels this when the client goes away; the
        upstream connection is then closed on the way out, which makes vLLM abort."""
        if request.method == "POST" and request.path in INFERENCE_PATHS:
            await self._inference(request, response)
        else:
            await self._passthrough(request, request.body, response)

    async def _passthrough(self, request: Request, body: bytes, response: Response) -> None:
        headers = _forward_headers(request.headers)
        target = self.fleet.default_pool
        tried: list[Instance] = []
        for _ in range(self.max_attempts):
            try:
                pool, instance = self.fleet.pick(target, tried)
            except NoInstanceAvailable:
                break
            self.fleet.acquire(pool, instance)
            ok = True
            try:
                connection, head = await self._open(request, instance, headers, body)
                try:
                    await _relay_whole(response, connection, head, parse=False)
                finally:
                    self.upstreams.release(instance.host, instance.port, connection)
                return
            except UpstreamFailed as exc:
                ok = False
                tried.append(instance)
                _log_failure(pool, instance, exc)
            finally:
                self.fleet.release(pool, instance, ok=ok)
        await _send_unavailable(response)

    async def _inference(self, request: Request, response: Response) -> None:
        started = self._wall_clock()
        raw_body = request.body
        try:
            body = orjson.loads(raw_body)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            # Not ours to judge: the upstream answers malformed requests itself.
            await self._passthrough(request, raw_body, response)
            return
        model = body.get("model")
        model = model if isinstance(model, str) else None
        workload_class = self._classify(request.headers, body)
        streaming = body.get("stream") is True
        strip_usage = False
        upstream_body = raw_body
        if streaming:
            options = body.get("stream_options")
            if options is None or (isinstance(options, dict) and not options.get("include_usage")):
                upstream_body = _with_usage(raw_body, body, options)
                strip_usage = True

        fleet = self.fleet
        bucket = self.buckets.bucket(fleet.begin(model))
        try:
            pool_name = self.routing.pool_for(model, workload_class, bucket)
            headers = _forward_headers(request.headers)
            tried: list[Instance] = []
            for _ in range(self.max_attempts):
                try:
                    pool, instance = fleet.pick(pool_name, tried)
                except NoInstanceAvailable:
                    break
                concurrency = fleet.acquire(pool, instance)
                ok = True
                try:
                    connection, head = await self._open(request, instance, headers, upstream_body)
                    try:
                        if streaming:
                            document = await _relay_stream(response, connection, head, strip_usage)
                        else:
                            document = await _relay_whole(response, connection, head, parse=True)
                    finally:
                        self.upstreams.release(instance.host, instance.port, connection)
                except UpstreamFailed as exc:
                    ok = False
                    tried.append(instance)
                    _log_failure(pool, instance, exc)
                    continue
                except UpstreamError:
                    # Broken after the first byte reached the client: too late to retry.
                    ok = False
                    raise
                finally:
                    fleet.release(pool, instance, ok=ok)
                if self.sink is not None and head.status == 200:
                    self._observe(document, model, workload_class, pool, concurrency, started)
                return
            await _send_unavailable(response)
        finally:
            fleet.end(model)

    def _classify(self, raw_headers: Headers, body: dict[str, Any]) -> str:
        for name, value in raw_headers:
            if name == WORKLOAD_CLASS_HEADER and value.strip():
                return value.decode("latin-1").strip()
        classifier = self.classifier
        if type(classifier) is ConstantClassifier:
            return classifier.workload_class  # no need to decode the headers for it
        try:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
            return self.classifier(headers, body)
        except Exception:
            logger.exception("classifier failed; using the default class")
            return DEFAULT_CLASS

    async def _open(
        self, request: Request, instance: Instance, headers: Headers, body: bytes
    ) -> tuple[UpstreamConnection, ResponseHead]:
        """Send the request to ``instance`` and wait for the response head.

        Raises :class:`UpstreamFailed` when the instance could not serve (connection
        failure or a 502/503/504), which is always before the client saw a byte. A pooled
        connection that fails before any response byte was most likely closed by the
        upstream while idle: that is retried once on a fresh connection, not held against
        the instance.
        """
        encoded = encode_request(
            request.method, request.target, instance.host_header, headers, body
        )
        upstreams = self.upstreams
        while True:
            try:
                connection, reused = await upstreams.connect(instance.host, instance.port)
            except UpstreamError as exc:
                raise UpstreamFailed(str(exc)) from exc
            try:
                connection.send(encoded)
                head = await connection.head()
            except UpstreamError as exc:
                connection.close()
                if reused and not connection.received_any:
                    continue
                raise UpstreamFailed(f"{instance.base_url}: {exc}") from exc
            except BaseException:
                connection.close()
                raise
            if head.status in _RETRY_STATUSES:
                connection.close()
                raise UpstreamFailed(f"{instance.base_url}: HTTP {head.status}")
            return connection, head

    def _observe(
        self,
        document: bytes | None,
        model: str | None,
        workload_class: str,
        pool: Pool,
        concurrency: int,
        started: float,
    ) -> None:
        assert self.sink is not None
        try:
            parsed = json_object(document) if document is not None else None
            if parsed is not None:
                measured = observation_from_response(parsed)
            else:
                measured = RequestObservation(model, None, None, None, None, None, None)
            observation = replace(
                measured,
                model=measured.model or model,
                workload_class=workload_class,
                pool=pool.name,
                arm=pool.arm,
                concurrency=concurrency,
                finished_at=(finished := self._wall_clock()),
                e2e_s=finished - started,
            )
            self.sink(observation)
        except Exception:
            logger.exception("observation sink failed")


def _log_failure(pool: Pool, instance: Instance, error: UpstreamFailed) -> None:
    """An attempt failed before the client saw a byte (it is retried elsewhere)."""
    logger.warning(
        "pool %s: %s failed (%s); retrying elsewhere, the failure counts toward ejection",
        pool.name,
        instance.base_url,
        error,
    )


# Asks for the usage chunk (per-request metrics ride on it) without turning on
# continuous usage, which would change every chunk the client sees.
_USAGE_OPTIONS = {"include_usage": True, "continuous_usage_stats": False}
_USAGE_FIELD = b',"stream_options":' + json.dumps(_USAGE_OPTIONS, separators=(",", ":")).encode()


def _with_usage(raw_body: bytes, body: dict[str, Any], options: dict[str, Any] | None) -> bytes:
    """The request body with ``stream_options.include_usage`` on.

    When the client sent no ``stream_options`` at all (the common case) the field is
    spliced in before the closing brace: the client's bytes stay as they were and a long
    prompt is not encoded again.
    """
    if options is None and "stream_options" not in body:
        end = raw_body.rstrip().rfind(b"}")
        if end > 0:
            return raw_body[:end] + _USAGE_FIELD + raw_body[end:]
    body["stream_options"] = {**(options or {}), **_USAGE_OPTIONS}
    return json.dumps(body).encode()


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


class _AsgiResponse:
    """:class:`Response` over ASGI ``send``; knows when the response is complete."""

    __slots__ = ("_send", "complete")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.complete = False

    async def start(self, status: int, headers: Headers) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes) -> None:
        self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})


async def _cancel_on_disconnect(
    receive: Receive, task: asyncio.Task[Any], response: _AsgiResponse
) -> bool:
    """Cancel ``task`` when the client goes away before its response is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if response.complete:
                return False
            task.cancel()
            return True


def _forward_headers(headers: Headers) -> Headers:
    return [(k, v) for k, v in headers if k not in _REQUEST_SKIP]


async def _send_start(response: Response, head: ResponseHead, *, keep_length: bool) -> None:
    headers = []
    for name, value in head.headers:
        name = name.lower()
        if name not in _RESPONSE_SKIP and (keep_length or name != b"content-length"):
            headers.append((name, value))
    await response.start(head.status, headers)


def _content_type(head: ResponseHead) -> bytes:
    for name, value in head.headers:
        if name.lower() == b"content-type":
            return value
    return b""


class _StreamForwarder:
    """What to send the client as upstream body pieces arrive: :class:`SseRelay`'s
    complete events, with a trailing ``[DONE]`` held back for the end of the response
    (vLLM ends its body right after it: sending both together saves one write and one
    wake-up of the client per request).

    On the native front end (:meth:`attach`) it writes to the client itself, from the
    upstream's read callback: :meth:`forward` for parsed body pieces and
    :meth:`forward_raw` for a token event that goes through untouched, framing and all.
    """

    __slots__ = ("_connection", "_direct", "_last", "relay")

    def __init__(self, strip_usage: bool) -> None:
        self.relay = SseRelay(strip_usage=strip_usage)
        self._last = b""
        self._direct: DirectResponse | None = None
        self._connection: UpstreamConnection | None = None

    def feed(self, chunk: bytes) -> bytes:
        out = self.relay.feed(chunk)
        if out:
            if self._last:
                out, self._last = self._last + out, b""
            if out.endswith(_DONE_EVENT):
                self._last = out
                return b""
        return out

    def finish(self) -> bytes:
        last, self._last = self._last, b""
        return last + self.relay.finish()

    def attach(self, direct: DirectResponse, connection: UpstreamConnection) -> None:
        self._direct, self._connection = direct, connection

    def forward(self, chunk: bytes) -> None:
        assert self._direct is not None
        out = self.feed(chunk)
        if out and self._direct.write_now(out):
            self._hold_upstream()

    def forward_raw(self, received: bytes, payload: bytes) -> bool:
        """Forward ``received`` (whole upstream chunks, framing included) unchanged when
        :meth:`feed` would pass ``payload`` through as it is; False to have it fed."""
        if self._last or payload.endswith(_DONE_EVENT) or not self.relay.passes(payload):
            return False
        assert self._direct is not None
        if self._direct.write_framed(received):
            self._hold_upstream()
        return True

    def complete(self, last: bytes) -> None:
        """The upstream body ended (``last``: its final piece, when it came with the
        end): end the client's response now, in one write, from the read callback (the
        end of the stream is on the critical path of every request)."""
        assert self._direct is not None
        out = self.feed(last) if last else b""
        self._direct.end_now(out + self.finish())

    def _hold_upstream(self) -> None:
        # The client's socket buffer is full: stop reading the upstream until it drains.
        assert self._direct is not None and self._connection is not None
        self._connection.pause_reading()
        self._direct.on_drained(self._connection.resume_reading)


async def _relay_stream(
    response: Response, connection: UpstreamConnection, head: ResponseHead, strip_usage: bool
) -> bytes | None:
    """Forward an SSE body event by event; returns the usage chunk's JSON when one came."""
    if not _content_type(head).startswith(b"text/event-stream"):
        return await _relay_whole(response, connection, head, parse=True)
    forwarder = _StreamForwarder(strip_usage)
    await _send_start(response, head, keep_length=False)
    if isinstance(response, DirectResponse):
        forwarder.attach(response, connection)
        raw = forwarder.forward_raw if response.chunked else None
        await connection.pipe(forwarder.forward, raw, forwarder.complete)
    else:
        while (chunk := await connection.chunk()) is not None:
            out = forwarder.feed(chunk)
            if out:
                await response.write(out)
    await response.end(forwarder.finish())
    return forwarder.relay.usage_data


async def _relay_whole(
    response: Response, connection: UpstreamConnection, head: ResponseHead, *, parse: bool
) -> bytes | None:
    """Forward a body unchanged; with ``parse``, also return it (a 200's) for the
    observation, which decodes it after the client has its response."""
    await _send_start(response, head, keep_length=True)
    parts: list[bytes] = []
    while (chunk := await connection.chunk()) is not None:
        if parse:
            parts.append(chunk)
        await response.write(chunk)
    await response.end(b"")
    if not parse or head.status != 200:
        return None
    return b"".join(parts)


async def _send_unavailable(response: Response) -> None:
    body = json.dumps(
        {"error": {"message": "no upstream instance available", "type": "ServiceUnavailable"}}
    ).encode()
    await response.start(
        503,
        [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    )
    await response.end(body)
