"""Running the gateway (and small upstreams) on loopback for tests, each in its thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvicorn
import uvloop

from collectors.observations import RequestObservation
from controller.gateway.app import Gateway
from controller.gateway.server import GatewayLimits, GatewayServer
from testbed.server import free_port


class LoopThread:
    """An asyncio event loop in a daemon thread, for test upstreams."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        async def cancel_pending() -> None:
            # Upstream handlers still waiting on a gateway's idle keep-alive connection.
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class RunningGateway:
    """A gateway on a free port, in a thread; ``observations`` is its sink's list.

    ``server`` is the front end: ``"native"`` (what ``specpilot gateway`` runs, on uvloop)
    or ``"uvicorn"`` (the ASGI interface).
    """

    def __init__(
        self, gateway: Gateway, server: str = "native", limits: GatewayLimits | None = None
    ) -> None:
        self.gateway = gateway
        self.observations: list[RequestObservation] = []
        gateway.sink = self.observations.append
        self._native: tuple[asyncio.AbstractEventLoop, GatewayServer] | None = None
        if server == "native":
            loop = uvloop.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, daemon=True)
            self._thread.start()
            started = asyncio.run_coroutine_threadsafe(
                GatewayServer.start(gateway, host="127.0.0.1", port=0, limits=limits), loop
            ).result(30)
            self._native = (loop, started)
            self.port = started.port
            return
        self.port = free_port()
        config = uvicorn.Config(
            gateway,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            server_header=False,
            date_header=False,
            proxy_headers=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, what="gateway start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_observations(self, count: int) -> list[RequestObservation]:
        # The sink runs right after the last byte is sent, so it may trail the client.
        wait_until(lambda: len(self.observations) >= count, what=f"{count} observations")
        return self.observations

    def stop(self) -> None:
        if self._native is not None:
            loop, server = self._native
            # Closes the gateway's upstream connections too, inside their event loop.
            asyncio.run_coroutine_threadsafe(server.close(grace_s=5.0), loop).result(15)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(15)
            return
        self._server.should_exit = True
        self._thread.join(15)
        self.gateway.aclose()


def wait_until(condition: Callable[[], bool], *, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition``; the timeout only guards against a hang, it asserts no speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def gateway_runner(
    server: str, limits: GatewayLimits | None = None
) -> Iterator[Callable[[Gateway], RunningGateway]]:
    """Starts gateways on the ``server`` front end; stops them all afterwards."""
    started: list[RunningGateway] = []

    def start(gateway: Gateway) -> RunningGateway:
        running = RunningGateway(gateway, server, limits)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(params=["native", "uvicorn"])
def run_gateway(request: pytest.FixtureRequest) -> Iterator[Callable[[Gateway], RunningGateway]]:
    """Every gateway test runs on both front ends: they share :meth:`Gateway.handle`."""
    yield from gateway_runner(request.param)


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()
