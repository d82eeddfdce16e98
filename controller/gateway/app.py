"""The gateway: an OpenAI-compatible reverse proxy in front of vLLM pools.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are classified, routed by the
routing table, balanced least-in-flight inside the pool, retried on another instance
while nothing has reached the client yet, relayed (SSE event by event) and observed.
``/v1/models`` and ``/health`` (and other methods on the completion paths) are passed
through to an instance of the default pool, since every pool serves the same models.
Any other path is answered 404 by the gateway itself: vLLM serves more (its
``/metrics``, tokenizer and admin endpoints) that clients of the gateway have no
business reaching.

An attempt that fails before the client saw a byte (connection refused or timed out, a
502/503/504) is retried on another instance and counts toward ejecting the instance; one
that fails after the first byte ends the response unfinished (an SSE stream gets an
``error`` event first, as vLLM sends one) and counts too. A client that leaves says
nothing about the instance.

An attempt with no answer within the first-byte timeout is *hedged*, not dropped: another
attempt starts on another instance beside it and the first head to arrive wins (as
Envoy's ``hedge_on_per_try_timeout``). Why: a timeout cannot tell a hung instance from a
healthy one that is slow for a moment (a loaded machine stalls a process for a second
now and then); abandoning the slow one could leave nothing but the hung one, and a
well-behaved request a 503. The request gives up only when its newest attempt is
overdue too and no other instance is left to try. An overdue attempt that lost the race
without having sent a byte counts toward ejection (a hung instance is ejected as
before); one that answered, however late, does not.

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
from time import perf_counter
from typing import Any, NamedTuple, Protocol

import orjson
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from prometheus_client import CollectorRegistry

from collectors.observations import RequestObservation
from controller.gateway.classify import (
    WORKLOAD_CLASS_HEADER,
    Classifier,
    RequestKeys,
    UnknownModel,
)
from controller.gateway.metrics import ABORTED, DISCONNECTED, NO_CLASS, NO_POOL, GatewayMetrics
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
from controller.gateway.throttle import Throttled
from controller.gateway.upstream import (
    ResponseHead,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
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
SERVED_PATHS = INFERENCE_PATHS | {"/v1/models", "/health"}
"""Paths the gateway passes upstream; any other is a 404 from the gateway."""

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
    """An attempt failed before anything reached the client; another instance may serve.

    ``local``: the gateway's own failure (out of file descriptors), not the instance's:
    no other instance would fare better, and none is held to account for it."""

    def __init__(self, message: str, *, local: bool = False) -> None:
        super().__init__(message)
        self.local = local


class ResponseAborted(Exception):
    """The response started and cannot be completed (its upstream failed mid-body).
    The front end closes the client's connection without ending the body, so the client
    sees it unfinished; the gateway has logged why."""


class _Attempt:
    """One try of a request on one instance, counted in flight until it is released."""

    __slots__ = ("connection", "head", "instance", "outcome", "pool", "sent")

    def __init__(self, pool: Pool, instance: Instance) -> None:
        self.pool = pool
        self.instance = instance
        self.connection: UpstreamConnection | None = None
        self.head: ResponseHead | None = None
        self.sent = 0.0
        """When the request went upstream (``perf_counter``)."""
        self.outcome = ""
        """How it ended when it did not win (for the log of a request no instance served)."""

    def answered(self) -> tuple[Pool, Instance, UpstreamConnection, ResponseHead]:
        assert self.connection is not None and self.head is not None
        return self.pool, self.instance, self.connection, self.head


def _check_head(instance: Instance, connection: UpstreamConnection, head: ResponseHead) -> None:
    """A 502/503/504 says the instance cannot serve now: the attempt failed."""
    if head.status in _RETRY_STATUSES:
        connection.close()
        raise UpstreamFailed(f"{instance.display_url}: HTTP {head.status}")


def _retrieved(task: asyncio.Task[None]) -> None:
    """Mark a raced attempt's outcome as seen: one cancelled after it failed must not be
    logged as an exception nobody retrieved."""
    if not task.cancelled():
        task.exception()


class Gateway:
    """The ASGI app. ``sink`` receives one observation per request that completed.

    ``classifier`` classifies a request that names no class; a :class:`RequestKeys`
    (what ``serve`` passes) also bounds classes and models to the configured ones.

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
        tracer: Tracer | None = None,
    ) -> None:
        self.fleet = fleet
        self.routing: RoutingTable = routing or StaticRoutingTable(fleet.default_pool)
        self.keys = (
            classifier
            if isinstance(classifier, RequestKeys)
            else RequestKeys(classifier=classifier)
        )
        self.sink = sink
        self.buckets = buckets or ConcurrencyBuckets()
        self.upstreams = upstreams or UpstreamPool()
        self.max_attempts = max_attempts
        self._wall_clock = wall_clock
        self.metrics: GatewayMetrics | None = None
        """Set with :meth:`count_on`; None counts nothing."""
        self.tracer = tracer
        """None (tracing off, ``controller.tracing``): no span code runs at all."""
        self._troubles: dict[tuple[str, str], Throttled] = {}

    def count_on(self, registry: CollectorRegistry) -> GatewayMetrics:
        """Count requests, retries, ejections, in-flight and added latency on ``registry``
        (``serve`` passes the API's)."""
        self.metrics = GatewayMetrics(registry, self.fleet, self.keys.classes)
        return self.metrics

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
        except ResponseAborted:
            pass  # returning mid-response makes the ASGI server close the connection
        finally:
            watcher.cancel()

    async def handle(self, request: Request, response: Response) -> None:
        """Serve one request. The caller cancels this when the client goes away; the
        upstream connection is then closed on the way out, which makes vLLM abort."""
        path = request.path
        if request.method == "POST" and path in INFERENCE_PATHS:
            tracer = self.tracer
            if tracer is None:
                await self._inference(request, response, None)
            else:
                await self._traced_inference(tracer, request, response)
        elif path in SERVED_PATHS:
            await self._passthrough(request, request.body, response)
        else:
            await _send_error(response, 404, f"no such path: {path}", "NotFoundError")
            if self.metrics is not None:
                self.metrics.request(NO_POOL, NO_POOL, NO_CLASS, 404)

    async def _passthrough(self, request: Request, body: bytes, response: Response) -> None:
        headers = _forward_headers(request.headers)
        metrics = self.metrics
        status: int | str = DISCONNECTED
        pool_name = arm = NO_POOL
        try:
            attempt = await self._first_answer(
                request, self.fleet.default_pool, headers, body, None
            )
            if attempt is None:
                await _send_unavailable(response)
                status = 503
                return
            pool, instance, connection, head = attempt.answered()
            pool_name, arm = pool.name, pool.arm
            ok: bool | None = None  # no verdict on the instance when the client leaves
            try:
                await _relay_whole(response, connection, head, parse=False)
                ok = True
            except UpstreamError as exc:
                ok, status = False, ABORTED
                raise self._aborted(pool, instance, exc) from exc
            finally:
                self.upstreams.release(instance.host, instance.port, connection)
                self.fleet.release(pool, instance, ok=ok)
            status = head.status
        finally:
            if metrics is not None:
                metrics.request(pool_name, arm, NO_CLASS, status)

    async def _traced_inference(self, tracer: Tracer, request: Request, response: Response) -> None:
        """``_inference`` inside a span (GenAI semantic conventions, plus ``specpilot.*``)."""
        operation = "chat" if request.path == "/v1/chat/completions" else "text_completion"
        span = tracer.start_span(
            operation,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "vllm",
                "http.request.method": request.method,
                "url.path": request.path,
            },
        )
        try:
            await self._inference(request, response, span)
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            raise
        finally:
            span.end()

    async def _inference(self, request: Request, response: Response, span: Span | None) -> None:
        received = perf_counter()
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
        keys = self.keys
        try:
            model = keys.model(body)
        except UnknownModel as exc:
            # Refused before the routing table (and the policy) sees the name.
            await _send_error(response, 404, str(exc), "NotFoundError", param="model")
            if self.metrics is not None:
                self.metrics.request(NO_POOL, NO_POOL, NO_CLASS, 404)
            if span is not None:
                _span_refused(span, 404, "NotFoundError")
            return
        workload_class = keys.workload_class(_class_header(request.headers), body, request.headers)
        streaming = body.get("stream") is True
        if span is not None:
            _span_request(span, body, model, workload_class, streaming)
        strip_usage = False
        upstream_body = raw_body
        if streaming:
            options = body.get("stream_options")
            if options is None or (isinstance(options, dict) and not options.get("include_usage")):
                upstream_body = _with_usage(raw_body, body, options)
                strip_usage = True

        fleet = self.fleet
        metrics = self.metrics
        in_flight = fleet.begin(model)
        bucket = self.buckets.bucket(in_flight)
        if span is not None:
            span.set_attributes({"specpilot.concurrency": in_flight, "specpilot.bucket": bucket})
        status: int | str = DISCONNECTED
        served = arm = NO_POOL  # labels: the pool that answered, and its arm
        try:
            pool_name = served = self.routing.pool_for(model, workload_class, bucket)
            headers = _forward_headers(request.headers)
            attempt = await self._first_answer(request, pool_name, headers, upstream_body, span)
            if attempt is None:
                await _send_unavailable(response)
                status = 503
                if span is not None:
                    _span_refused(span, 503, "NoInstanceAvailable")
                return
            pool, instance, connection, head = attempt.answered()
            served, arm = pool.name, pool.arm
            routed = fleet.pools.get(pool_name)
            if routed is not None and routed is not pool and metrics is not None:
                metrics.failover(pool_name, served)  # its own pool could not take it
            ok: bool | None = None  # no verdict on the instance when the client leaves
            try:
                if streaming:
                    document, tail = await _relay_stream(response, connection, head, strip_usage)
                else:
                    document, tail = await _relay_whole(response, connection, head, parse=True)
                ok = True
            except UpstreamError as exc:
                # Broken after the first byte reached the client: too late to retry.
                ok, status = False, ABORTED
                raise self._aborted(pool, instance, exc) from exc
            finally:
                self.upstreams.release(instance.host, instance.port, connection)
                fleet.release(pool, instance, ok=ok)
            status = head.status
            if metrics is not None:
                metrics.added_latency.observe(attempt.sent - received + tail)
            if span is not None:
                span.set_attribute("http.response.status_code", head.status)
                if head.status >= 400:
                    _span_refused(span, head.status, str(head.status))
            if (self.sink is not None or span is not None) and head.status == 200:
                self._observe(
                    document, model, workload_class, pool, in_flight, started, span,
                    routed=routed, instance=instance,
                )  # fmt: skip
        finally:
            fleet.end(model)
            if metrics is not None:
                if not arm and served in fleet.pools:
                    arm = fleet.pools[served].arm
                metrics.request(served, arm, workload_class, status)

    async def _first_answer(
        self,
        request: Request,
        pool_name: str,
        headers: Headers,
        body: bytes,
        span: Span | None,
    ) -> _Attempt | None:
        """The attempt whose response head came first, still counted in flight (the
        caller relays it and releases it); None when no instance could answer (logged,
        at most once per ``LOG_EVERY_S`` per pool, with what each attempt came to)."""
        attempts: list[_Attempt] = []
        winner = await self._race(request, pool_name, headers, body, span, attempts)
        if winner is None:
            key = (pool_name, "")
            throttled = self._troubles.get(key)
            if throttled is None:
                throttled = self._troubles[key] = Throttled(logger)
            throttled.warning(
                "pool %s: a request got 503, no instance answered it (%s)",
                pool_name,
                "; ".join(f"{a.instance.display_url}: {a.outcome}" for a in attempts)
                or "no instance to try",
            )
        return winner

    async def _race(
        self,
        request: Request,
        pool_name: str,
        headers: Headers,
        body: bytes,
        span: Span | None,
        attempts: list[_Attempt],
    ) -> _Attempt | None:
        """:meth:`_first_answer`'s work; every attempt started is added to ``attempts``.

        Attempts go one at a time while they fail outright (the common case is one
        attempt, answered, waited on inline without a task). An attempt that is overdue
        (no byte within the first-byte timeout) stays open while the next one starts
        beside it; the first head of any wins and the others are closed (which makes
        vLLM abort them). The request gives up when every attempt still open is overdue
        and no further one can start (``max_attempts``, or no instance left)."""
        tried: list[Instance] = []
        open_: dict[asyncio.Task[None], _Attempt] = {}
        late: set[asyncio.Task[None]] = set()
        """Tasks waiting on an overdue attempt, past its deadline."""
        winner: _Attempt | None = None
        try:
            while True:
                if len(late) == len(open_):
                    attempt = self._next_attempt(pool_name, tried, span)
                    if attempt is not None:
                        attempts.append(attempt)
                    if attempt is not None and not open_:
                        try:
                            await self._open(request, attempt, headers, body)
                        except UpstreamFailed as exc:
                            self._failed(attempt, exc)
                            if exc.local:
                                return None
                            continue
                        except BaseException:
                            self._drop(attempt)
                            raise
                        if attempt.head is not None:
                            winner = attempt
                            return winner
                        self._watch_late(attempt, open_, late)
                        continue
                    if attempt is not None:
                        task = asyncio.create_task(self._open(request, attempt, headers, body))
                        task.add_done_callback(_retrieved)
                        open_[task] = attempt
                    elif len(late) == len(open_):
                        return None  # every open attempt overdue, none left to start
                done, _ = await asyncio.wait(open_, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    attempt = open_.pop(task)
                    late.discard(task)
                    error = task.exception()
                    if isinstance(error, UpstreamFailed):
                        self._failed(attempt, error)
                        if error.local:
                            return None
                    elif error is not None:
                        self._drop(attempt)
                        raise error
                    elif attempt.head is not None and winner is None:
                        winner = attempt
                    elif attempt.head is not None:
                        self._drop(attempt)  # answered in the same turn as the winner
                    else:
                        self._watch_late(attempt, open_, late)
                if winner is not None:
                    return winner
        finally:
            for task, attempt in open_.items():
                task.cancel()
                self._drop(attempt)

    def _next_attempt(
        self, pool_name: str, tried: list[Instance], span: Span | None
    ) -> _Attempt | None:
        """A new attempt on the least-loaded instance not tried yet, counted in flight;
        None when ``max_attempts`` are spent or no instance is left."""
        if len(tried) >= self.max_attempts:
            return None
        fleet = self.fleet
        try:
            pool, instance = fleet.pick(pool_name, tried)
        except NoInstanceAvailable:
            return None
        if tried and self.metrics is not None:
            self.metrics.retry(pool.name)
        tried.append(instance)
        fleet.acquire(pool, instance)
        if span is not None:
            _span_attempt(span, pool, instance, len(tried))
        return _Attempt(pool, instance)

    def _watch_late(
        self,
        attempt: _Attempt,
        open_: dict[asyncio.Task[None], _Attempt],
        late: set[asyncio.Task[None]],
    ) -> None:
        """Keep waiting on an overdue attempt (a slow instance may still answer)."""
        task = asyncio.create_task(self._late_head(attempt))
        task.add_done_callback(_retrieved)
        open_[task] = attempt
        late.add(task)

    def _failed(self, attempt: _Attempt, error: UpstreamFailed) -> None:
        """An attempt that failed outright: closed, and held against its instance unless
        the failure was the gateway's own."""
        attempt.outcome = f"{'failed here' if error.local else 'failed'}: {error}"
        if attempt.connection is not None:
            attempt.connection.close()
            self.upstreams.release(attempt.instance.host, attempt.instance.port, attempt.connection)
        self.fleet.release(attempt.pool, attempt.instance, ok=None if error.local else False)
        if not error.local:
            self._log_failure(attempt.pool, attempt.instance, error)

    def _drop(self, attempt: _Attempt) -> None:
        """Close an attempt that did not win (or whose request went away). Overdue with
        not a byte received: that counts toward ejecting its instance (a hung instance
        answers nothing, ever); anything else says nothing about it."""
        connection = attempt.connection
        ok: bool | None = None
        attempt.outcome = "closed unanswered"
        if connection is not None:
            if connection.overdue is not None:
                attempt.outcome = connection.overdue
            if connection.overdue is not None and not connection.received_any:
                ok = False
                self._trouble(attempt.pool, attempt.instance).warning(
                    "pool %s: %s failed (%s; it was tried elsewhere meanwhile); the failure "
                    "counts toward ejection",
                    attempt.pool.name,
                    attempt.instance.display_url,
                    connection.overdue,
                )
            connection.close()
            self.upstreams.release(attempt.instance.host, attempt.instance.port, connection)
        self.fleet.release(attempt.pool, attempt.instance, ok=ok)

    async def _open(
        self, request: Request, attempt: _Attempt, headers: Headers, body: bytes
    ) -> None:
        """Send the request to the attempt's instance and wait for the response head
        (``attempt.head``), or until it is overdue (``attempt.head`` None, the
        connection left open). Sets ``attempt.connection`` and ``attempt.sent`` (when
        it was sent, ``perf_counter``).

        Raises :class:`UpstreamFailed` when the instance could not serve (connection
        failure or a 502/503/504), which is always before the client saw a byte. A pooled
        connection that fails before any response byte was most likely closed by the
        upstream while idle: that is retried once on a fresh connection, not held against
        the instance.
        """
        instance = attempt.instance
        encoded = encode_request(
            request.method, request.target, instance.host_header, headers, body
        )
        upstreams = self.upstreams
        while True:
            try:
                connection, reused = await upstreams.connect(instance.host, instance.port)
            except UpstreamError as exc:
                raise UpstreamFailed(str(exc), local=exc.local) from exc
            attempt.connection = connection
            try:
                connection.send(encoded)
                attempt.sent = perf_counter()
                head = await connection.answer()
            except UpstreamError as exc:
                connection.close()
                if reused and not connection.received_any and not isinstance(exc, UpstreamTimeout):
                    continue
                raise UpstreamFailed(f"{instance.display_url}: {exc}") from exc
            except BaseException:
                connection.close()
                raise
            if head is not None:
                _check_head(instance, connection, head)
                attempt.head = head
            return

    async def _late_head(self, attempt: _Attempt) -> None:
        """Wait on an overdue attempt until its head comes (``attempt.head``) or it fails."""
        connection = attempt.connection
        assert connection is not None
        try:
            head = await connection.answer(past_due=True)
        except UpstreamError as exc:
            connection.close()
            raise UpstreamFailed(f"{attempt.instance.display_url}: {exc}") from exc
        assert head is not None
        _check_head(attempt.instance, connection, head)
        attempt.head = head

    def _trouble(self, pool: Pool, instance: Instance) -> Throttled:
        """The instance's failures are logged at most once per ``LOG_EVERY_S``: a hung
        instance fails every request sent to it before it is ejected."""
        key = (pool.name, instance.display_url)
        throttled = self._troubles.get(key)
        if throttled is None:
            throttled = self._troubles[key] = Throttled(logger)
        return throttled

    def _log_failure(self, pool: Pool, instance: Instance, error: UpstreamFailed) -> None:
        """An attempt failed before the client saw a byte (it is retried elsewhere)."""
        self._trouble(pool, instance).warning(
            "pool %s: %s failed (%s); retrying elsewhere, the failure counts toward ejection",
            pool.name,
            instance.display_url,
            error,
        )

    def _aborted(self, pool: Pool, instance: Instance, error: UpstreamError) -> ResponseAborted:
        self._trouble(pool, instance).warning(
            "pool %s: %s failed mid-response (%s); the client's response ends unfinished, "
            "the failure counts toward ejection",
            pool.name,
            instance.display_url,
            error,
        )
        return ResponseAborted(str(error))

    def _observe(
        self,
        document: bytes | None,
        model: str | None,
        workload_class: str,
        pool: Pool,
        concurrency: int,
        started: float,
        span: Span | None = None,
        *,
        routed: Pool | None = None,
        instance: Instance | None = None,
    ) -> None:
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
                routed_arm=routed.arm if routed is not None else pool.arm,
                instance=instance.display_url if instance is not None else None,
                concurrency=concurrency,
                finished_at=(finished := self._wall_clock()),
                e2e_s=finished - started,
            )
            if span is not None:
                _span_observed(span, observation)
            if self.sink is not None:
                self.sink(observation)
        except Exception:
            logger.exception("observation sink failed")


def _span_request(
    span: Span, body: dict[str, Any], model: str | None, workload_class: str, streaming: bool
) -> None:
    operation = "chat" if "messages" in body else "text_completion"
    if model is not None:
        span.update_name(f"{operation} {model}")
        span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("specpilot.workload_class", workload_class)
    span.set_attribute("specpilot.stream", streaming)
    for key, attribute in _REQUEST_ATTRIBUTES:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            span.set_attribute(attribute, value)


_REQUEST_ATTRIBUTES = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
)


def _span_attempt(span: Span, pool: Pool, instance: Instance, attempt: int) -> None:
    span.set_attributes(
        {
            "server.address": instance.host,
            "server.port": instance.port,
            "specpilot.pool": pool.name,
            "specpilot.arm": pool.arm or "unknown",
            "specpilot.attempts": attempt,
        }
    )


def _span_refused(span: Span, status: int, error_type: str) -> None:
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR))


def _span_observed(span: Span, observation: RequestObservation) -> None:
    """What vLLM measured for the request, as GenAI attributes (seconds, tokens)."""
    attributes: dict[str, str | int | float] = {}
    if observation.model is not None:
        attributes["gen_ai.response.model"] = observation.model
    if observation.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = observation.prompt_tokens
    if observation.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = observation.output_tokens
    if observation.ttft_s is not None:
        attributes["gen_ai.server.time_to_first_token"] = observation.ttft_s
    if (tpot := observation.tpot_s) is not None:
        attributes["gen_ai.server.time_per_output_token"] = tpot
    if observation.e2e_s is not None:
        attributes["gen_ai.server.request.duration"] = observation.e2e_s
    spec = observation.spec
    if spec is not None:
        if (rate := spec.acceptance_rate) is not None:
            attributes["specpilot.spec_decode.acceptance_rate"] = rate
        if (length := spec.mean_acceptance_length) is not None:
            attributes["specpilot.spec_decode.mean_acceptance_length"] = length
        if spec.num_draft_tokens is not None:
            attributes["specpilot.spec_decode.draft_tokens"] = spec.num_draft_tokens
        if spec.num_accepted_tokens is not None:
            attributes["specpilot.spec_decode.accepted_tokens"] = spec.num_accepted_tokens
    span.set_attributes(attributes)


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

    __slots__ = ("_connection", "_direct", "_last", "relay", "tail_s")

    def __init__(self, strip_usage: bool) -> None:
        self.relay = SseRelay(strip_usage=strip_usage)
        self._last = b""
        self._direct: DirectResponse | None = None
        self._connection: UpstreamConnection | None = None
        self.tail_s = 0.0
        """From the upstream body's end to the client's (set by :meth:`complete`)."""

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
        ended = perf_counter()
        out = self.feed(last) if last else b""
        self._direct.end_now(out + self.finish())
        self.tail_s = perf_counter() - ended

    def _hold_upstream(self) -> None:
        # The client's socket buffer is full: stop reading the upstream until it drains.
        assert self._direct is not None and self._connection is not None
        self._connection.pause_reading()
        self._direct.on_drained(self._connection.resume_reading)


async def _relay_stream(
    response: Response, connection: UpstreamConnection, head: ResponseHead, strip_usage: bool
) -> tuple[bytes | None, float]:
    """Forward an SSE body event by event; returns the usage chunk's JSON when one came,
    and the seconds from the upstream body's end to the client's."""
    if not _content_type(head).startswith(b"text/event-stream"):
        return await _relay_whole(response, connection, head, parse=True)
    forwarder = _StreamForwarder(strip_usage)
    await _send_start(response, head, keep_length=False)
    direct = False
    try:
        if isinstance(response, DirectResponse):
            direct = True
            forwarder.attach(response, connection)
            raw = forwarder.forward_raw if response.chunked else None
            await connection.pipe(forwarder.forward, raw, forwarder.complete)
        else:
            while (chunk := await connection.chunk()) is not None:
                out = forwarder.feed(chunk)
                if out:
                    await response.write(out)
    except UpstreamError as exc:
        # What vLLM itself sends when a stream fails: OpenAI's clients raise it as an
        # error rather than take the stream for a short, complete answer.
        await response.write(_error_event(f"the upstream failed mid-stream: {exc}"))
        raise
    ended = perf_counter()
    await response.end(forwarder.finish())
    # Direct: the client's response ended in the read callback (``complete``).
    tail = forwarder.tail_s if direct else perf_counter() - ended
    return forwarder.relay.usage_data, tail


def _error_event(message: str) -> bytes:
    error = {"error": {"message": message, "type": "BadGateway", "code": 502}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


async def _relay_whole(
    response: Response, connection: UpstreamConnection, head: ResponseHead, *, parse: bool
) -> tuple[bytes | None, float]:
    """Forward a body unchanged; with ``parse``, also return it (a 200's) for the
    observation, which decodes it after the client has its response. Also returns the
    seconds from the upstream body's end to the client's."""
    await _send_start(response, head, keep_length=True)
    parts: list[bytes] = []
    while (chunk := await connection.chunk()) is not None:
        if parse:
            parts.append(chunk)
        await response.write(chunk)
    ended = perf_counter()
    await response.end(b"")
    tail = perf_counter() - ended
    if not parse or head.status != 200:
        return None, tail
    return b"".join(parts), tail


def _class_header(headers: Headers) -> str | None:
    for name, value in headers:
        if name == WORKLOAD_CLASS_HEADER and value.strip():
            return value.decode("latin-1")
    return None


async def _send_unavailable(response: Response) -> None:
    await _send_error(response, 503, "no upstream instance available", "ServiceUnavailable")


async def _send_error(
    response: Response, status: int, message: str, kind: str, param: str | None = None
) -> None:
    """An error answered by the gateway itself, shaped as vLLM's (OpenAI's) errors."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": status}
    body = json.dumps({"error": error}).encode()
    await response.start(
        status,
        [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    )
    await response.end(body)
