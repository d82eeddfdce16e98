"""The API never waits on the loop: while an iteration is stuck in the policy (planning
takes seconds under load), every read answers, and what ``/v1/policy`` shows is what
the loop published."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from controller.api import create_app
from controller.contexts import Context
from controller.ports import ArmChoice
from controller.serve import _listen
from controller.service import build_service
from tests.controller.conftest import LiveServer, make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy

SPIN_BOUND_S = 20.0
"""How long a stuck ``decide`` spins at most, so that a broken build fails, not hangs."""


class StuckPolicy(ScriptedPolicy):
    """Once ``stick`` is set, ``decide`` spins in pure Python (holding the GIL as
    planning does) until ``release`` is set."""

    def __init__(self, edges: Sequence[int]) -> None:
        super().__init__(edges)
        self.stick, self.release = threading.Event(), threading.Event()
        self.stuck, self.returned = threading.Event(), threading.Event()

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        if self.stick.is_set() and not self.release.is_set():
            self.stuck.set()
            deadline = time.monotonic() + SPIN_BOUND_S
            while not self.release.is_set() and time.monotonic() < deadline:
                pass
            self.returned.set()
        return super().decide(context, allowed_arms, current)


def test_reads_answer_while_an_iteration_is_stuck_in_the_policy(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    policy = StuckPolicy(settings.buckets)
    service = build_service(settings, policy, QueueSource())
    try:
        with (
            LiveServer(create_app(settings, service)) as server,
            httpx.Client(base_url=server.url, timeout=SPIN_BOUND_S * 2) as client,
        ):
            deadline = time.monotonic() + 30
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the loop never ticked"
                time.sleep(0.05)
            policy.stick.set()
            assert policy.stuck.wait(30), "no iteration reached the policy"
            before = service.loop.last_tick_at
            try:
                answers = {
                    path: client.get(path)
                    for path in ("/v1/policy", "/readyz", "/v1/alerts", "/v1/fleet", "/healthz")
                }
                # Answered while the iteration was provably still in the policy.
                assert not policy.returned.is_set()
                assert service.loop.last_tick_at == before
            finally:
                policy.release.set()
            assert {path: r.status_code for path, r in answers.items()} == dict.fromkeys(
                answers, 200
            )
            shown = answers["/v1/policy"].json()["contexts"]
            assert {(c["class"], c["bucket"]) for c in shown} == {
                (c.workload_class, c.bucket) for c in service.fleet.contexts
            }
            assert answers["/readyz"].json()["checks"]["loop"] == "ok"
    finally:
        service.close()


def test_consult_waits_its_turn_behind_the_loop(tmp_path: Path) -> None:
    """Outside callers (the demo's live table) reach the policy in turn with the loop's
    own use of it, never beside it in another thread."""
    settings = make_settings(tmp_path)
    policy = StuckPolicy(settings.buckets)
    service = build_service(settings, policy, QueueSource())

    async def scenario() -> tuple[bool, bool]:
        loop = service.loop
        await loop.start()
        policy.stick.set()
        tick = asyncio.create_task(loop.tick())
        assert await asyncio.to_thread(policy.stuck.wait, 30)
        asked = asyncio.create_task(loop.consult(policy.returned.is_set))
        await asyncio.sleep(0.2)
        waiting = not asked.done()
        policy.release.set()
        await tick
        return waiting, await asked

    try:
        waiting, returned_first = asyncio.run(scenario())
    finally:
        service.close()
    assert waiting and returned_first


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_answers_without_waiting_for_acks(host: str) -> None:
    """Nagle's algorithm is off on the connections ``serve`` accepts: with it on, each
    answer written in two pieces waited for the client's delayed ACK (~40 ms)."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")

    async def accepted_nodelay() -> int:
        try:
            sock = _listen(host, 0)
        except OSError:
            pytest.skip(f"cannot listen on {host}")
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_bench_api_runs_the_service_and_writes_both_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``specpilot bench api`` end to end, briefly: the real ``serve`` over a simulated
    fleet, idle then loaded, each path measured in both."""
    from bench import api

    monkeypatch.chdir(tmp_path)
    argv = ["--classes", "2", "--streams", "4", "--seconds", "2", "--warmup-s", "2"]
    assert api.main(argv) == 0
    result = json.loads((tmp_path / api.RESULT).read_text())
    assert result["contexts"] == 2 * 6
    for phase in ("idle", "loaded"):
        for path in (*api.PATHS, api.FLOOR):
            figures = result[phase][path]
            assert figures["requests"] > 0 and figures["errors"] == 0, (phase, path)
            assert figures["p50_ms"] <= figures["p99_ms"]
    assert result["traffic"]["completed"] > 0
    assert result["loop"]["loaded"]["observations"] > 0
    assert set(result["ratios"]) == {*api.PATHS, api.FLOOR}
    assert "p99 load/idle" in capsys.readouterr().out
