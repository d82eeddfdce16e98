"""A hostile soak: ``specpilot serve`` in routing mode over simulated pools, on loopback,
while a well-behaved client streams through its gateway, first alone, then for
``ATTACK_S`` beside every attacker at once:

- slow-header and slow-body connections (a byte a second, reopened when closed),
- oversized URLs, header blocks and bodies (declared and chunked),
- ``DISTINCT`` distinct class and model values (a new class on every request of a
  flood, a new model on nearly every one),
- and one instance of the off pool that hangs: it accepts and never answers (before the
  attack it relays to a healthy simulated instance, so the baseline has none of it).

Every well-behaved request must succeed, with its p99 within ``P99_RATIO`` × its p99
without the attackers; the processes' memory and the saved policy state stay under fixed
bounds, the log holds at most ``MAX_LOG_LINES`` lines and the service is alive at the
end (and stops cleanly). Bounded: every attacker has a count and the phase a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.gateway import quantile
from simulator.scenario import load_scenario
from testbed.server import free_port
from tests.actuators.sim_launcher import SCENARIO
from tests.controller.test_serve import ROOT, TOKEN
from tests.gateway.conftest import LoopThread

SPEED = 2.0
"""Simulated seconds per wall second: a well-behaved stream lasts a second or three."""
STREAMS = 4
MAX_TOKENS = 192
BASELINE_S = 30.0
ATTACK_S = 60.0
FLOOD = 52_000
ROUTED_DISTINCT = 2_000
"""Of the flood's requests (each with a class never seen before), how many name a served
model (so they reach a pool): the others name a made-up model too and are refused
before routing."""
DISTINCT = 2 * FLOOD - ROUTED_DISTINCT
"""Distinct class and model values the flood sends: 102,000."""
FLOOD_CONNECTIONS = 8
PIPELINE = 32
SLOW_CONNECTIONS = 150
"""Each of slow-header and slow-body."""
P99_RATIO = 2.0
MAX_LOG_LINES = 300
MAX_PARENT_RSS_MB = 300
MAX_WORKER_RSS_MB = 120
"""Measured: the parent about 115 MB and each worker about 46 MB after the attack (the
made-up values once took a single process from 106 to 228 MB)."""
MAX_STATE_BYTES = 64 * 1024
"""Measured: 6.5 KB (the made-up values once made it 6.6 MB)."""
FIRST_BYTE_S = 1.0
"""An attempt with no answer after this (``gateway.upstream_timeouts``) is hedged on another
instance; the hung one, which never answers, counts a failure each time. Short next to the
p99 the test asserts, and no limit on the healthy instances: one the loaded machine stalls
past it still serves its request, however late it answers."""
MODEL = load_scenario(SCENARIO).model.name


class HangingRelay:
    """Relays TCP to ``target`` until :meth:`hang`; from then on it takes connections and
    reads what they send, and answers nothing on any of them (a hung vLLM instance)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hanging = False
        self.port = free_port()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def hang(self) -> None:
        self.hanging = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.hanging:
                await self._swallow(reader)
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(
                self._pipe(reader, up_writer, hangs=True), self._pipe(up_reader, writer)
            )
            up_writer.close()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, hangs: bool = False
    ) -> None:
        # Once hung, a request arriving on a kept-alive connection is swallowed too; a
        # response already on its way still arrives.
        while data := await source.read(65536):
            if hangs and self.hanging:
                await self._swallow(source)
                return
            sink.write(data)
            await sink.drain()
        sink.close()

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass


class Serve:
    def __init__(self, config: Path) -> None:
        self.log = config.with_suffix(".log")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "controller.cli", "serve", "--config", str(config)],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), SPECPILOT_API_TOKEN=TOKEN),
        )

    def rss_mb(self) -> dict[int, float]:
        """Resident memory of the serve process and of each of its children, MB."""
        pids = [self.process.pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids += [int(p) for p in children.read_text().split()]
        out = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) / 1024
        return out


@pytest.fixture
def simulated() -> Iterator[dict[str, list[str]]]:
    """The simulated pools, in a process of their own (the client's load must not slow
    them): off with two instances, n-gram with one. Their URLs per pool."""
    process = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", "simulate", "serve", "--scenario",
         str(SCENARIO), "--pools", "off=off*2 ngram=ngram:4", "--speed", str(SPEED),
         "--json"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        instances = json.loads(process.stdout.readline())["instances"]
        urls: dict[str, list[str]] = {}
        for instance in instances:
            urls.setdefault(instance["pool"], []).append(instance["url"])
        yield urls
    finally:
        process.terminate()
        process.wait(30)


def settings(tmp_path: Path, urls: dict[str, list[str]], api: int, gateway: int) -> Path:
    config = {
        "data_dir": str(tmp_path / "data"),
        "scrape_interval_s": 1.0,
        "classes": ["code", "chat"],
        "buckets": [1, 4],
        "api": {"host": "127.0.0.1", "port": api},
        "actuators": {"mode": "routing"},
        "store": {"snapshot_interval_s": 5},
        "gateway": {
            "host": "127.0.0.1",
            "port": gateway,
            "default_class": "chat",
            "limits": {"header_timeout_s": 5, "body_timeout_s": 10, "max_body_bytes": 1 << 20},
            "upstream_timeouts": {"first_byte_s": FIRST_BYTE_S},
        },
        "fleet": {
            "pools": {
                "off": {"model": MODEL, "instances": urls["off"]},
                "ngram": {
                    "model": MODEL,
                    "instances": urls["ngram"],
                    "proposers": {"ngram": {"method": "ngram", "gamma": [4, 4]}},
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
                },
            }
        },
    }
    path = tmp_path / "specpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# --- the well-behaved client ---------------------------------------------------------------


async def well_behaved(url: str, until: Callable[[], bool]) -> list[float]:
    """``STREAMS`` streams of code completions until ``until()``; each request's seconds.
    Raises on any request that does not succeed whole."""
    body = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": MAX_TOKENS, "stream": True}
    seconds: list[float] = []

    async def stream(client: httpx.AsyncClient) -> None:
        while not until():
            started = time.perf_counter()
            async with client.stream(
                "POST", "/v1/completions", json=body, headers={"X-Workload-Class": "code"}
            ) as response:
                text = (await response.aread()).decode()
            assert response.status_code == 200, text
            events = [e for e in text.split("\n\n") if e.strip()]
            assert events[-1] == "data: [DONE]", text[-500:]
            assert not any('"error"' in e for e in events), text[-500:]
            seconds.append(time.perf_counter() - started)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(stream(client) for _ in range(STREAMS)))
    return seconds


# --- the attackers -----------------------------------------------------------------------


async def raw(port: int, data: bytes, *, read: bool = True) -> bytes:
    """Send ``data`` on a new connection; what the server answered before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30) if read else b""
    finally:
        writer.close()


async def slow(port: int, head: bytes, drip: bytes, stop: Callable[[], bool]) -> Counter[str]:
    """Keep ``SLOW_CONNECTIONS`` connections dripping a byte a second after ``head``;
    count how each ended."""
    ended: Counter[str] = Counter()

    async def one() -> None:
        while not stop():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head)
                while not stop() and not reader.at_eof():
                    writer.write(drip)
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        answer = await asyncio.wait_for(reader.read(4096), 1.0)
                        if answer:
                            ended[answer.split(b"\r\n", 1)[0].decode()] += 1
                        await reader.read()
                        break
            except ConnectionError:
                ended["reset"] += 1
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(SLOW_CONNECTIONS)))
    return ended


async def oversized(port: int, stop: Callable[[], bool]) -> Counter[int]:
    """One oversized request after another, by turns; the statuses they got."""
    statuses: Counter[int] = Counter()
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
    kinds = [
        b"GET /v1/models?" + b"q" * 16_384 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"h" * 100_000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunk * 24,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n" + body,
    ]
    turn = 0
    while not stop():
        with contextlib.suppress(ConnectionError, TimeoutError):
            answer = await raw(port, kinds[turn % len(kinds)])
            statuses[int(answer.split(b" ", 2)[1]) if answer else 0] += 1
        turn += 1
        await asyncio.sleep(0.05)
    return statuses


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response whole (by its length or its chunks); its status."""
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    if b"transfer-encoding: chunked" in head:
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            await reader.readexactly(size + 2)
        await reader.readexactly(2)
    else:
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def distinct_values(port: int, deadline: float) -> Counter[int]:
    """``FLOOD`` requests, each with a class never seen before and all but
    ``ROUTED_DISTINCT`` with a model never seen before too (``DISTINCT`` values in all),
    pipelined ``PIPELINE`` at a time; the statuses they got."""
    statuses: Counter[int] = Counter()
    per = FLOOD // FLOOD_CONNECTIONS
    every = FLOOD // ROUTED_DISTINCT

    def request(i: int) -> bytes:
        model = MODEL if i % every == 0 else f"made-up-{i}"
        body = json.dumps({"model": model, "prompt": "x", "max_tokens": 1, "stream": True})
        return (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\nx-workload-class: tenant-%d\r\ncontent-length: %d\r\n\r\n%s"
            % (i, len(body), body.encode())
        )

    async def connection(offset: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for start in range(offset, offset + per, PIPELINE):
                if time.monotonic() > deadline:
                    return
                batch = range(start, min(start + PIPELINE, offset + per))
                writer.write(b"".join(request(i) for i in batch))
                try:
                    for _ in batch:
                        statuses[await read_response(reader)] += 1
                except (asyncio.IncompleteReadError, ConnectionError):
                    statuses[0] += 1  # closed on it: counted, and on with a new connection
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                # Paced: the flood spreads over the phase instead of saturating the CPUs.
                await asyncio.sleep(FLOOD_CONNECTIONS * len(batch) * ATTACK_S / FLOOD / 2)
        finally:
            writer.close()

    await asyncio.gather(*(connection(k * per) for k in range(FLOOD_CONNECTIONS)))
    return statuses


# --- the run -----------------------------------------------------------------------------


def latest_state_bytes(data_dir: Path) -> int:
    with sqlite3.connect(data_dir / "specpilot.db") as db:
        (state,) = db.execute(
            "SELECT state FROM policy_snapshots ORDER BY id DESC LIMIT 1"
        ).fetchone()
    return len(state)


def test_the_gateway_holds_against_hostile_clients_and_a_hung_instance(
    simulated: dict[str, list[str]], tmp_path: Path
) -> None:
    off_a, off_b = simulated["off"]
    relay = HangingRelay(int(off_b.rsplit(":", 1)[1]))
    relaying = LoopThread()
    relaying.run(relay.start())
    urls = {"off": [off_a, f"http://127.0.0.1:{relay.port}"], "ngram": simulated["ngram"]}
    api_port, gateway_port = free_port(), free_port()
    serve = Serve(settings(tmp_path, urls, api_port, gateway_port))
    gateway = f"http://127.0.0.1:{gateway_port}"
    attacker: subprocess.Popen[str] | None = None
    try:
        # A guard against a hang, not a speed claim: on a machine others load, serve's
        # start (its spawned gateway workers importing everything) took over 120 s.
        deadline = time.monotonic() + 600
        while True:
            assert serve.process.poll() is None, serve.log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{api_port}/readyz", timeout=2).is_success:
                    break
            assert time.monotonic() < deadline, serve.log.read_text()
            time.sleep(0.2)

        warm_until = time.monotonic() + 5
        asyncio.run(well_behaved(gateway, lambda: time.monotonic() > warm_until))
        base_until = time.monotonic() + BASELINE_S
        baseline = asyncio.run(well_behaved(gateway, lambda: time.monotonic() > base_until))
        rss_before = serve.rss_mb()

        relay.hang()
        attacker = subprocess.Popen(
            [sys.executable, "-m", "tests.gateway.test_hostile_soak", str(gateway_port)],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        running = attacker
        good = asyncio.run(well_behaved(gateway, lambda: running.poll() is not None))
        out, _ = attacker.communicate(timeout=60)
        attack: dict[str, Any] = json.loads(out)
        assert attacker.returncode == 0
        assert serve.process.poll() is None, serve.log.read_text()[-3000:]
        rss_after = serve.rss_mb()
        time.sleep(6)  # a snapshot of the learned state after the attack
        state_bytes = latest_state_bytes(tmp_path / "data")
        metrics = httpx.get(f"http://127.0.0.1:{api_port}/metrics", timeout=10).text
        serve.process.send_signal(signal.SIGTERM)
        code = serve.process.wait(60)
    finally:
        for process in (serve.process, attacker):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)
        relaying.stop()
    log = serve.log.read_text()
    lines = log.splitlines()
    report = {
        "baseline_p99_s": quantile(baseline, 0.99),
        "attack_p99_s": quantile(good, 0.99),
        "baseline_requests": len(baseline),
        "attack_requests": len(good),
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_after,
        "state_bytes": state_bytes,
        "log_lines": len(lines),
        **attack,
    }
    print(json.dumps(report, indent=1))
    assert code == 0, log[-3000:]
    assert report["attack_p99_s"] <= P99_RATIO * report["baseline_p99_s"], report
    distinct = attack["distinct"]
    assert DISTINCT >= 100_000 and sum(distinct.values()) == FLOOD, report
    assert distinct["404"] == FLOOD - ROUTED_DISTINCT, report  # refused before the policy
    # The routed ones reached a pool; a 503 where every instance of it was slow at once
    # (a loaded machine stalls the simulated fleet now and then): never a dropped one.
    assert distinct["200"] + distinct.get("503", 0) == ROUTED_DISTINCT, report
    # What the attackers were answered: the limits said no.
    assert {"414", "431", "413", "411"} <= set(attack["oversized"]), report
    assert any("408" in ended for ended in attack["slow_header"]), report
    assert any("408" in ended for ended in attack["slow_body"]), report
    parent = serve.process.pid
    assert rss_after[parent] < MAX_PARENT_RSS_MB, report
    workers = [rss for pid, rss in rss_after.items() if pid != parent]
    assert workers and max(workers) < MAX_WORKER_RSS_MB, report
    assert state_bytes < MAX_STATE_BYTES, report
    assert len(lines) <= MAX_LOG_LINES, "\n".join(lines[-100:])
    assert "Traceback" not in log
    # The hung instance failed attempts (retried elsewhere) and was ejected.
    assert 'specpilot_gateway_ejections_total{pool="off"}' in metrics


async def attack(port: int) -> dict[str, Any]:
    """Every attacker at once for ``ATTACK_S`` (the distinct values until all are sent,
    within four times that)."""
    started = time.monotonic()
    deadline = started + 4 * ATTACK_S
    flood = asyncio.create_task(distinct_values(port, deadline))

    def over() -> bool:
        return (time.monotonic() - started > ATTACK_S and flood.done()) or (
            time.monotonic() > deadline
        )

    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    body_head = head + b"content-type: application/json\r\ncontent-length: 4096\r\n\r\n{"
    slow_header, slow_body, big = await asyncio.gather(
        slow(port, head, b"x", over),
        slow(port, body_head, b" ", over),
        oversized(port, over),
    )
    return {
        "distinct": {str(k): v for k, v in (await flood).items()},
        "slow_header": dict(slow_header),
        "slow_body": dict(slow_body),
        "oversized": {str(k): v for k, v in big.items()},
        "attack_s": time.monotonic() - started,
    }


if __name__ == "__main__":
    # The attackers' own process: their load must not slow the well-behaved client.
    print(json.dumps(asyncio.run(attack(int(sys.argv[1])))))
