"""What the gateway lets through to vLLM and what it shows of an instance: only the
paths specpilot serves go upstream, and an instance URL's credentials are neither sent
as ``Host`` nor logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import pytest

from controller.gateway.app import Gateway
from controller.gateway.routing import Fleet, Instance, Pool
from testbed.server import free_port
from tests.gateway.conftest import LoopThread, RunningGateway
from tests.gateway.test_gateway_fakes import FakeClock


def start_recording(loop_thread: LoopThread, status: int = 200) -> tuple[list[bytes], int]:
    """Answers every request with ``status`` and a small JSON body; keeps each head."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
                    b"\r\n{}" % status
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    port = free_port()
    loop_thread.run(asyncio.start_server(handle, "127.0.0.1", port))
    return heads, port


@pytest.mark.parametrize(
    "path", ["/metrics", "/tokenize", "/v1/../metrics", "/v1/load_lora_adapter"]
)
def test_paths_specpilot_does_not_serve_are_404_from_the_gateway(
    loop_thread: LoopThread, run_gateway: Callable[[Gateway], RunningGateway], path: str
) -> None:
    heads, port = start_recording(loop_thread)
    fleet = Fleet([Pool("p", "off", [f"http://127.0.0.1:{port}"])], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))
    with httpx.Client(timeout=30) as client:
        refused = client.post(f"{gateway.base_url}{path}", content=b"{}")
        assert client.get(f"{gateway.base_url}/v1/models").status_code == 200
        assert client.get(f"{gateway.base_url}/health").status_code == 200
    assert refused.status_code == 404
    assert refused.json()["error"]["type"] == "NotFoundError"
    assert [head.split(b" ")[1] for head in heads] == [b"/v1/models", b"/health"]


def test_instance_credentials_are_not_sent_as_host_nor_logged(
    loop_thread: LoopThread,
    run_gateway: Callable[[Gateway], RunningGateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    heads, port = start_recording(loop_thread)
    _, failing = start_recording(loop_thread, status=503)
    urls = [f"http://ops:s3cret@127.0.0.1:{failing}", f"http://ops:s3cret@127.0.0.1:{port}"]
    fleet = Fleet([Pool("p", "off", urls)], clock=FakeClock())
    gateway = run_gateway(Gateway(fleet))
    with caplog.at_level(logging.WARNING, logger="controller.gateway"):
        response = httpx.post(
            f"{gateway.base_url}/v1/completions", json={"model": "m", "prompt": "p"}, timeout=30
        )
    assert response.status_code == 200
    [head] = heads
    assert f"\r\nhost: 127.0.0.1:{port}\r\n".encode() in head
    assert b"s3cret" not in head
    assert f"ops:***@127.0.0.1:{failing}" in caplog.text, "the failure was logged, redacted"
    assert "s3cret" not in caplog.text
    assert "s3cret" not in repr(fleet.pools["p"].instances[0])


@pytest.mark.parametrize(
    "url",
    ["https://127.0.0.1:8000", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000?x=1", "ftp://h"],
)
def test_instance_urls_the_upstream_client_cannot_reach_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="instance"):
        Instance(url)
