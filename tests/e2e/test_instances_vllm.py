"""Instance health beside a real vLLM: specpilot as ``serve`` assembles it, with three
pools on one real vLLM 0.32 server: ``code`` on it, ``chat`` on a URL where nothing
listens (until a proxy to the same vLLM starts there), ``rag`` on it under a model name
it does not serve.

Checked: ``specpilot_instance_up`` per instance; ``SpecpilotInstanceDown`` raised for the
dead and the wrong-model instance once they stayed down for the bound, stored, counted,
and resolved when the dead URL answers; ``/readyz`` degraded (200) while a pool has no
healthy instance; one ``instance_down`` line per instance with its reason (the wrong
model's names what the server serves), one ``instance_up`` when it comes back; the
wrong-model instance's windows stored unhealthy with the reason.
The loop is ticked by the test, a second apart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from controller.actions import ACTIONS
from controller.api import create_app
from controller.instances import INSTANCE_DOWN
from controller.runtime import assemble
from controller.settings import Settings
from testbed.server import SERVED_MODEL, free_port
from tests.conftest import VllmServers

pytestmark = pytest.mark.vllm

TUNING = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4, **TUNING}
PROPOSERS = {"ngram": {"method": "ngram", "gamma": [1, 4], "tuning": TUNING}}
WRONG = f"not-{SERVED_MODEL}"
DOWN_AFTER_S = 2.0


def settings_for(vllm: str, dead: str, data_dir: Path) -> Settings:
    def pool(model: str, url: str, cls: str) -> dict[str, Any]:
        return {
            "model": model,
            "instances": [url],
            "classes": [cls],
            "speculative_config": NGRAM4,
            "proposers": PROPOSERS,
        }

    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": ["code", "chat", "rag"],
            "scrape_interval_s": 1.0,
            "collect": "scrape",
            "alerting": {"instance_down_after_s": DOWN_AFTER_S},
            "fleet": {
                "pools": {
                    "code": pool(SERVED_MODEL, vllm, "code"),
                    "chat": pool(SERVED_MODEL, dead, "chat"),
                    "rag": pool(WRONG, vllm, "rag"),
                }
            },
        }
    )


class Proxy:
    """What comes up at the dead URL: GETs relayed to the real vLLM as they are."""

    def __init__(self, port: int, upstream: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    with urllib.request.urlopen(upstream + self.path, timeout=10) as answer:
                        status, body = answer.status, answer.read()
                        kind = answer.headers.get("content-type", "text/plain")
                except urllib.error.HTTPError as error:
                    status, body, kind = error.code, error.read(), "text/plain"
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def actions_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=ACTIONS.name):
        yield caplog


def test_dead_and_wrong_model_instances_beside_a_real_vllm(
    vllm_servers: VllmServers, tmp_path: Path, actions_log: pytest.LogCaptureFixture
) -> None:
    server = vllm_servers.get("ngram:4")
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    settings = settings_for(server.base_url, dead, tmp_path / "data")
    registry = CollectorRegistry()
    runtime = assemble(settings, registry=registry, tracing=None)
    service, loop = runtime.service, runtime.service.loop
    proxy: Proxy | None = None

    def up(pool: str, url: str) -> float | None:
        return registry.get_sample_value("specpilot_instance_up", {"pool": pool, "url": url})

    def raised() -> float | None:
        return registry.get_sample_value("specpilot_alerts_total", {"alert": INSTANCE_DOWN})

    def logged(action: str, pool: str) -> list[str]:
        return [
            r.getMessage()
            for r in actions_log.records
            if getattr(r, "action", None) == action and r.fields.get("pool") == pool  # type: ignore[attr-defined]
        ]

    async def scenario() -> None:
        nonlocal proxy
        transport = httpx.ASGITransport(app=create_app(settings, service))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:

            async def instance_alerts() -> list[Any]:
                alerts = (await api.get("/v1/alerts")).json()["alerts"]
                return [a for a in alerts if a["name"] == INSTANCE_DOWN]

            await loop.start()
            await loop.tick()
            assert (up("code", server.base_url), up("chat", dead)) == (1, 0)
            assert up("rag", server.base_url) == 0
            ready = await api.get("/readyz")
            assert ready.status_code == 200, ready.text
            body = ready.json()
            assert body["status"] == "degraded", body
            assert body["checks"]["instances"].startswith(
                f"pool chat: no healthy instance ({dead} unreachable: "
            ), body
            assert (
                f"pool rag: no healthy instance ({server.base_url} serves {SERVED_MODEL}, "
                in (body["checks"]["instances"])
            )
            assert "pool code" not in body["checks"]["instances"]
            # Down for the bound, then raised: once each, stored and counted.
            started = time.monotonic()
            while len(await instance_alerts()) < 2:
                assert time.monotonic() - started < 30 * DOWN_AFTER_S, "no alert raised"
                await asyncio.sleep(1.0)
                await loop.tick()
            for _ in range(2):  # firing on: not raised again
                await asyncio.sleep(1.0)
                await loop.tick()
            alerts = await instance_alerts()
            assert sorted((a["name"], a["context"], a["resolved_at"]) for a in alerts) == [
                (INSTANCE_DOWN, f"pool=chat,url={dead}", None),
                (INSTANCE_DOWN, f"pool=rag,url={server.base_url}", None),
            ]
            assert raised() == 2
            # The dead URL comes up (the same vLLM behind it): resolved, up again.
            proxy = Proxy(port, server.base_url)
            await loop.tick()
            assert up("chat", dead) == 1
            alerts = await instance_alerts()
            resolved = {a["context"]: a["resolved_at"] for a in alerts}
            assert resolved[f"pool=chat,url={dead}"] is not None, alerts
            assert resolved[f"pool=rag,url={server.base_url}"] is None, alerts
            assert raised() == 2
            body = (await api.get("/readyz")).json()
            assert body["status"] == "degraded"  # rag still serves nothing of its own
            assert "pool chat" not in body["checks"]["instances"]
            await loop.tick()
            windows = {w.pool: w for w in service.store.latest_window_stats()}
            assert windows["rag"].healthy is False
            assert windows["rag"].status == f"serves {SERVED_MODEL}, not {WRONG}"
            assert windows["code"].healthy is True, windows["code"]
            await loop.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        if proxy is not None:
            proxy.close()
        runtime.close()
    [chat_down] = logged("instance_down", "chat")
    assert chat_down.startswith(f"instance_down: pool chat: {dead} unreachable: "), chat_down
    [rag_down] = logged("instance_down", "rag")
    assert rag_down.startswith(
        f"instance_down: pool rag: {server.base_url} serves {SERVED_MODEL}, not {WRONG}"
    ), rag_down
    [chat_up] = logged("instance_up", "chat")
    assert chat_up.startswith(f"instance_up: pool chat: {dead} answers again after "), chat_up
    assert logged("instance_down", "code") == logged("instance_up", "code") == []
