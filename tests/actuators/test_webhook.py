"""The webhook actuator against a real loopback HTTP server that fails the first tries."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controller.actuators.preflight import Preflight, PreflightError
from controller.actuators.webhook import (
    RetrySettings,
    WebhookActuator,
    WebhookFailed,
    idempotency_key,
)
from controller.fleet import PoolConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CHAT = PoolConfig("chat", NGRAM, (("1", "ngram:4"), ("2-3", "ngram:4")))


@dataclass
class Receiver:
    """Answers ``script`` statuses in order (then 200), recording each request."""

    script: list[int] = field(default_factory=list)
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            state.received.append((dict(self.headers), json.loads(self.rfile.read(length))))
            status = state.script.pop(0) if state.script else 200
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/spec"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def actuator(url: str, delays: list[float], **retry: Any) -> WebhookActuator:
    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    return WebhookActuator(
        url,
        retry=RetrySettings(**{"attempts": 5, "base_delay_s": 0.5, "max_delay_s": 2.0, **retry}),
        headers={"Authorization": "Bearer t"},
        rng=random.Random(7),
        sleep=sleep,
    )


def test_retries_with_bounded_backoff_and_one_idempotency_key(receiver: Receiver) -> None:
    receiver.script = [503, 502, 429, 500]
    delays: list[float] = []
    asyncio.run(actuator(receiver.url, delays).apply([CHAT]))

    assert len(receiver.received) == 5
    keys = {headers["Idempotency-Key"] for headers, _ in receiver.received}
    assert keys == {idempotency_key(CHAT)}
    _, body = receiver.received[-1]
    assert body == {
        "pool": "chat",
        "speculative_config": NGRAM,
        "arms_by_bucket": {"1": "ngram:4", "2-3": "ngram:4"},
        "idempotency_key": idempotency_key(CHAT),
    }
    assert all(h["Authorization"] == "Bearer t" for h, _ in receiver.received)
    ceilings = [0.5, 1.0, 2.0, 2.0]  # doubling, capped at max_delay_s
    assert len(delays) == 4
    assert all(0 < d <= c for d, c in zip(delays, ceilings, strict=True)), delays


def test_gives_up_after_the_attempts_and_says_why(receiver: Receiver) -> None:
    receiver.script = [503] * 10
    with pytest.raises(WebhookFailed, match=r"pool 'chat': HTTP 503.*after 3 attempts"):
        asyncio.run(actuator(receiver.url, [], attempts=3).apply([CHAT]))
    assert len(receiver.received) == 3


def test_a_client_error_is_final(receiver: Receiver) -> None:
    receiver.script = [422]
    with pytest.raises(WebhookFailed, match="HTTP 422"):
        asyncio.run(actuator(receiver.url, []).apply([CHAT]))
    assert len(receiver.received) == 1


def test_connection_refused_is_retried() -> None:
    delays: list[float] = []
    with pytest.raises(WebhookFailed, match="ConnectError"):
        asyncio.run(actuator("http://127.0.0.1:9/", delays, attempts=2).apply([CHAT]))
    assert len(delays) == 1


def test_same_decision_same_key_other_decision_other_key() -> None:
    again = PoolConfig("chat", dict(NGRAM), (("1", "ngram:4"),))  # other buckets, same config
    assert idempotency_key(again) == idempotency_key(CHAT)
    assert idempotency_key(PoolConfig("chat", {**NGRAM, "num_speculative_tokens": 3}, ())) != (
        idempotency_key(CHAT)
    )
    assert idempotency_key(PoolConfig("code", NGRAM, ())) != idempotency_key(CHAT)
    assert idempotency_key(PoolConfig("chat", None, ())) != idempotency_key(CHAT)


def test_nothing_is_sent_when_one_config_fails_preflight(receiver: Receiver) -> None:
    bad = PoolConfig("code", {"method": "ngram", "num_speculative_tokens": 0}, ())
    hook = actuator(receiver.url, [])
    hook.preflight = Preflight()
    with pytest.raises(PreflightError, match="pool 'code'"):
        asyncio.run(hook.apply([CHAT, bad]))
    assert receiver.received == []
