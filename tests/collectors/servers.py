"""Real loopback HTTP servers for scraper tests: good, slow, trickling, garbage, failing.

Each server is a ``ThreadingHTTPServer`` on 127.0.0.1 with a free port, so the scraper
goes through a real TCP connection and real HTTP parsing.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Route:
    """What one path answers. ``hits`` counts requests received."""

    def __init__(self) -> None:
        self.hits = 0

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        raise NotImplementedError


class Pages(Route):
    """Serves the given pages in order, then keeps serving the last one."""

    def __init__(self, pages: Sequence[str]) -> None:
        super().__init__()
        self.pages = list(pages)

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        page = self.pages[min(self.hits - 1, len(self.pages) - 1)].encode()
        _send(handler, 200, page, "text/plain; version=0.0.4; charset=utf-8")


class Fixed(Route):
    def __init__(self, status: int, body: bytes, content_type: str = "text/html") -> None:
        super().__init__()
        self.status, self.body, self.content_type = status, body, content_type

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        _send(handler, self.status, self.body, self.content_type)


class Hang(Route):
    """Accepts the request and answers nothing until released (or the server stops)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        self.release.wait(timeout=60)


class Trickle(Route):
    """Sends headers at once, then one byte of a valid page every ``pause_s``."""

    def __init__(self, pause_s: float = 0.2) -> None:
        super().__init__()
        self.pause_s = pause_s
        self.stop = threading.Event()

    def respond(self, handler: BaseHTTPRequestHandler) -> None:
        body = b"# HELP x y\n" * 1000
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        for byte in body:
            if self.stop.wait(self.pause_s):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()


class LoopbackServer:
    def __init__(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = server.routes.get(self.path)
                if route is None:
                    _send(self, 404, b"not found", "text/plain")
                    return
                route.hits += 1
                # The scraper giving up on a slow answer is the point of some routes.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    route.respond(self)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def serving(routes: dict[str, Route]) -> Iterator[LoopbackServer]:
    server = LoopbackServer(routes)
    server.thread.start()
    try:
        yield server
    finally:
        for route in routes.values():
            if isinstance(route, Hang):
                route.release.set()
            if isinstance(route, Trickle):
                route.stop.set()
        server.httpd.shutdown()
        server.httpd.server_close()


def dead_url() -> str:
    """A loopback URL where nothing listens (the port was just free)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
