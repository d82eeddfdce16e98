"""Gateway overhead: the same streams straight to the upstream and through the gateway.

``python -m bench.gateway [--upstream vllm|replay] [--gateway-server native|uvicorn]
[--workers N] [--json]``

For each concurrency level (1, 16, 64 streams) every stream alternates between going
straight to the upstream and going through a gateway (``specpilot gateway`` in its own
processes) in front of the same upstream, half the streams starting on each path, so
both paths always see the same upstream load. The native gateway is measured twice per
level, as ``serve`` runs it (``--workers``, default one worker process per core: the
level's figures) and with one worker (``by_workers``: ``{"1": ..., "N": ...}``, each
with the keys below). It reports

- ``added_p50_ms`` / ``added_p99_ms``: the quantile of end-to-end stream time through the
  gateway minus the same quantile straight to the upstream (a difference of quantiles,
  both from the same interleaved run), with ``added_p50_ms_90`` / ``added_p99_ms_90``
  their 90 % bootstrap intervals: at one stream chance alone moves a p99 difference by
  tenths of a millisecond either way;
- ``added_ttfb_p50_ms``: the same for the time to the first body byte;
- ``cpu_ms_per_request``: CPU time (user + system) of the gateway's processes (its
  workers and the process that supervises them) over its phases, per request.

Upstreams:

- ``vllm`` (default, what the issue asks for): a real vLLM (n-gram γ=4) from the testbed.
  A tiny-model request takes hundreds of ms on this CPU and the gateway shares the two
  cores with it, so the noise there is far larger than a sub-millisecond overhead;
- ``replay``: a minimal local SSE server that replays a recorded real vLLM 0.32 stream
  (``tests/fixtures/vllm-0.32``) with a fixed interval between events, so the gateway's
  own cost is what differs between the two paths.

``--gateway-server`` picks the gateway's front end (``specpilot gateway --server``): its
own HTTP/1.1 server (``native``, the default) or uvicorn over the ASGI interface, so the
two can be compared on the same machine.

``--peers`` also puts the proxies users would run instead in front of the same upstream
(see :mod:`bench.peers`, which installs them once): nginx, a C reverse proxy and so the
floor for any HTTP hop, and the LiteLLM proxy, an OpenAI-compatible Python gateway with
the upstream as its ``hosted_vllm`` backend. At each level every proxy is measured the
same way as the gateway, right after it: streams alternating between it and straight
to the upstream, so each has a direct baseline taken beside it. The level then carries
``proxies: {specpilot, nginx, litellm, python_relay}`` (added p50 / p99, CPU per request
of the proxy's whole process tree; with more than one worker also ``specpilot_1_worker``;
``python_relay`` is the bare relay of ``--gateway-server relay``, there to show what any
Python hop on uvloop pays here, so that specpilot's own cost reads as the gap to it) and
``peer_checks``: specpilot's added p50 and p99 at most 1.5 × nginx's and 0.25 ×
LiteLLM's, its CPU per request at most 0.25 × LiteLLM's (``peer_checks_1_worker``: the
same for one worker), and ``peer_checks_settled``: per latency check, whether its
verdict holds at every end of the intervals (False: the samples cannot tell met from
missed, as where a peer's added p99 is within noise of zero). nginx runs one worker
process, LiteLLM one.

The load generator is a raw asyncio HTTP/1.1 client with one keep-alive connection per
stream, so the client itself costs little CPU on a machine the three processes share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np

from testbed.server import free_port

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32"
RESULTS = Path(__file__).resolve().parent / "results"
LEVELS = (1, 16, 64)
GOAL_P50_MS = 0.5
GOAL_P99_MS = 3.0


# --- replay upstream ----------------------------------------------------------------


def sse_events(path: Path) -> list[bytes]:
    """The events of a recorded stream, each with its ``\\n\\n`` terminator."""
    text = path.read_bytes()
    return [event + b"\n\n" for event in text.split(b"\n\n") if event.strip()]


class ReplayUpstream:
    """Speaks just enough HTTP/1.1 to stand in for vLLM's streaming endpoints.

    ``POST /v1/completions`` and ``/v1/chat/completions`` with ``"stream": true`` replay
    ``with_usage`` when the body asks for ``include_usage`` and ``plain`` otherwise, one
    chunked-encoding chunk per event, token chunks ``interval_s`` apart. Anything else gets a small
    JSON body. Keep-alive; one request at a time per connection.
    """

    def __init__(self, plain: list[bytes], with_usage: list[bytes], interval_s: float) -> None:
        self.plain = plain
        self.with_usage = with_usage
        self.interval_s = interval_s
        self.requests = 0
        """Requests answered so far (tests check which upstream served)."""
        self.connections = 0
        """Connections accepted so far (tests check keep-alive reuse)."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                self.requests += 1
                if b'"stream":true' in body.replace(b" ", b""):
                    usage = b'"include_usage":true' in body.replace(b" ", b"")
                    await self._stream(writer, self.with_usage if usage else self.plain)
                else:
                    payload = b'{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
                    )
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, events: list[bytes]) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in events:
            # vLLM sends the usage chunk and [DONE] right after the last token chunk, in
            # the same engine step: only token chunks are paced.
            if (
                self.interval_s
                and not event.startswith(b"data: [DONE]")
                and b'"choices":[]' not in event
            ):
                await asyncio.sleep(self.interval_s)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def serve_replay(port: int, interval_s: float, fixture: str) -> None:
    upstream = ReplayUpstream(
        sse_events(FIXTURES / f"{fixture}-stream.sse"),
        sse_events(FIXTURES / f"{fixture}-stream-usage.sse"),
        interval_s,
    )
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --- load generator -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    ttfb_s: float
    total_s: float


class StreamClient:
    """One keep-alive HTTP/1.1 connection that posts a body and reads a chunked reply."""

    def __init__(self, host: str, port: int, path: str, body: bytes) -> None:
        self.host, self.port = host, port
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            "content-type: application/json\r\naccept: text/event-stream\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def run(self) -> Timing:
        try:
            return await self._run()
        except (asyncio.IncompleteReadError, ConnectionError):
            # The server closed an idle keep-alive connection: one retry on a fresh one.
            await self.close()
            return await self._run()

    async def _run(self) -> Timing:
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        start = time.perf_counter()
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"upstream answered {head[:60]!r}")
        if b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError("expected a chunked streaming response")
        ttfb = 0.0
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if not ttfb:
                ttfb = time.perf_counter() - start
            await reader.readexactly(size + 2)
            if size == 0:
                break
        return Timing(ttfb, time.perf_counter() - start)


async def run_mixed(
    pairs: Sequence[tuple[StreamClient, StreamClient]], requests: int
) -> tuple[list[Timing], list[Timing]]:
    """At least ``requests`` streams on each path (rounded up to a multiple of the
    concurrency), ``len(pairs)`` at a time.

    Each stream alternates between going straight to the upstream and going through the
    gateway, half of them starting on each path, so at every moment both paths share the
    upstream's load and the machine's: noise from either hits both alike.
    """
    straight: list[Timing] = []
    through: list[Timing] = []
    per_stream = -(-requests // len(pairs))  # ceil: every stream does as many per path

    async def worker(index: int, direct: StreamClient, gateway: StreamClient) -> None:
        use_gateway = index % 2 == 1
        for _ in range(2 * per_stream):
            if use_gateway:
                through.append(await gateway.run())
            else:
                straight.append(await direct.run())
            use_gateway = not use_gateway

    await asyncio.gather(*(worker(i, d, g) for i, (d, g) in enumerate(pairs)))
    return straight, through


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process's threads and of its descendants', from
    /proc/PID/task/*/schedstat (nginx serves from a worker its master forked).

    Nanosecond resolution: /proc/PID/stat counts clock ticks (10 ms), a sizeable share of
    a phase's total at one stream (64 streams of about 1 ms each on the vllm upstream).
    """
    total = 0
    for member in process_tree(pid):
        for stat in Path(f"/proc/{member}/task").glob("*/schedstat"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += int(stat.read_text().split()[0])
    return total / 1e9


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (from each task's /proc children list)."""
    tree, queue = [], [pid]
    while queue:
        member = queue.pop()
        tree.append(member)
        for children in Path(f"/proc/{member}/task").glob("*/children"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                queue.extend(int(c) for c in children.read_text().split())
    return tree


def runqueue_wait_s(pid: int) -> float:
    """Seconds a process spent runnable but waiting for a CPU (/proc/PID/schedstat).

    On an oversubscribed machine this is where a proxy's added latency goes: each hop
    through one more process waits for a core.
    """
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def added_interval(
    straight: Sequence[float], through: Sequence[float], q: float, *, resamples: int = 1000
) -> tuple[float, float]:
    """A 90 % bootstrap interval, in ms, of what the hop adds to the ``q`` quantile
    (through minus straight, each path resampled on its own; a fixed seed, so a report
    is reproducible from its samples).

    Why: a quantile's difference over a few hundred requests moves by tenths of a
    millisecond from chance alone (at one stream nginx's added p99 came out -0.29 ms in
    one run, +0.28 in the next), so a ratio to a peer's figure means something only
    where the intervals keep it on one side of the goal."""
    rng = np.random.default_rng(0)
    a = np.asarray(straight, dtype=np.float64)
    b = np.asarray(through, dtype=np.float64)
    pick_a = rng.integers(0, len(a), size=(resamples, len(a)))
    pick_b = rng.integers(0, len(b), size=(resamples, len(b)))
    # Nearest rank, as :func:`quantile` takes the reported figure.
    added = np.quantile(b[pick_b], q, axis=1, method="nearest") - np.quantile(
        a[pick_a], q, axis=1, method="nearest"
    )
    low, high = np.quantile(added, [0.05, 0.95]) * 1000.0
    return (round(float(low), 3), round(float(high), 3))


@dataclass(frozen=True, slots=True)
class LevelResult:
    concurrency: int
    requests: int
    added_p50_ms: float
    added_p99_ms: float
    added_p50_ms_90: tuple[float, float]
    """90 % bootstrap interval of ``added_p50_ms`` (see :func:`added_interval`)."""
    added_p99_ms_90: tuple[float, float]
    added_ttfb_p50_ms: float
    cpu_ms_per_request: float
    runqueue_wait_ms_per_request: float
    """Time the gateway process waited for a CPU while runnable, per request."""
    upstream_cpu_ms_per_request: float | None
    """Replay mode: CPU of the replay server per request, a yardstick for what merely
    writing the same events costs a minimal asyncio server on this machine."""
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float


async def measure_level(
    concurrency: int,
    requests: int,
    direct: tuple[str, int],
    gateway: tuple[str, int],
    gateway_pid: int,
    upstream_pid: int | None,
    path: str,
    body: bytes,
) -> LevelResult:
    direct_clients = [StreamClient(*direct, path, body) for _ in range(concurrency)]
    gateway_clients = [StreamClient(*gateway, path, body) for _ in range(concurrency)]
    pairs = list(zip(direct_clients, gateway_clients, strict=True))
    try:
        # Warm-up opens every connection on both paths (and the gateway's upstream pool).
        await run_mixed(pairs, concurrency)
        cpu = process_cpu_s(gateway_pid)
        waited = runqueue_wait_s(gateway_pid)
        upstream_cpu = process_cpu_s(upstream_pid) if upstream_pid else 0.0
        straight, through = await run_mixed(pairs, requests)
        cpu_s = process_cpu_s(gateway_pid) - cpu
        wait_s = runqueue_wait_s(gateway_pid) - waited
        upstream_cpu_s = process_cpu_s(upstream_pid) - upstream_cpu if upstream_pid else 0.0
    finally:
        for client in (*direct_clients, *gateway_clients):
            await client.close()

    def ms(values: list[float], q: float) -> float:
        return quantile(values, q) * 1000.0

    d_total = [t.total_s for t in straight]
    g_total = [t.total_s for t in through]
    return LevelResult(
        concurrency=concurrency,
        requests=len(through),
        added_p50_ms=round(ms(g_total, 0.5) - ms(d_total, 0.5), 3),
        added_p99_ms=round(ms(g_total, 0.99) - ms(d_total, 0.99), 3),
        added_p50_ms_90=added_interval(d_total, g_total, 0.5),
        added_p99_ms_90=added_interval(d_total, g_total, 0.99),
        added_ttfb_p50_ms=round(
            ms([t.ttfb_s for t in through], 0.5) - ms([t.ttfb_s for t in straight], 0.5), 3
        ),
        cpu_ms_per_request=round(cpu_s * 1000.0 / len(through), 3),
        runqueue_wait_ms_per_request=round(wait_s * 1000.0 / len(through), 3),
        upstream_cpu_ms_per_request=(
            round(upstream_cpu_s * 1000.0 / (len(straight) + len(through)), 3)
            if upstream_pid
            else None
        ),
        direct_p50_ms=round(ms(d_total, 0.5), 3),
        direct_p99_ms=round(ms(d_total, 0.99), 3),
        gateway_p50_ms=round(ms(g_total, 0.5), 3),
        gateway_p99_ms=round(ms(g_total, 0.99), 3),
    )


# --- processes ------------------------------------------------------------------------


@contextlib.contextmanager
def child(
    command: list[str],
    ready_url: str,
    timeout_s: float = 60.0,
    *,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    cwd: Path | None = None,
) -> Iterator[int]:
    """A child process in its own group, yielded (its pid) once ``ready_url`` answers 200.

    ``log``: where its output goes (default: inherited); its tail is in the error if
    the process does not come up."""
    out = log.open("ab") if log is not None else None
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
        env=env,
        cwd=cwd,
    )

    def tail() -> str:
        if log is None:
            return ""
        return "\n" + log.read_text(errors="replace")[-2000:]

    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited with {process.returncode}{tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[:4]} not ready after {timeout_s:.0f} s{tail()}")
            time.sleep(0.1)
        yield process.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if out is not None:
            out.close()


class _Pipe(asyncio.Protocol):
    """One side of a bare relay: whatever arrives is written to the other side."""

    def __init__(self, other: asyncio.Transport | None = None) -> None:
        self.other = other
        self.waiting: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            self.other.write(data)
        else:
            self.waiting.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None:
            self.other.close()


async def serve_relay(port: int, upstream_port: int) -> None:
    """The floor any Python proxy pays here: uvloop copying bytes both ways, no HTTP."""
    loop = asyncio.get_running_loop()

    class Client(_Pipe):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.connecting = loop.create_task(self._connect())

        async def _connect(self) -> None:
            upstream, _ = await loop.create_connection(
                lambda: _Pipe(self.transport), "127.0.0.1", upstream_port
            )
            self.other = upstream
            for data in self.waiting:
                self.other.write(data)
            self.waiting.clear()

    server = await loop.create_server(Client, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def gateway_command(
    port: int, upstream_url: str, server: str = "native", workers: int | None = None
) -> list[str]:
    if server == "relay":
        upstream_port = upstream_url.rsplit(":", 1)[1]
        return [sys.executable, "-m", "bench.gateway", "--serve-relay", str(port),
                "--relay-to", upstream_port]  # fmt: skip
    return [
        sys.executable,
        "-m",
        "controller.cli",
        "gateway",
        "--port",
        str(port),
        "--pool",
        f"bench={upstream_url}",
        "--server",
        server,
        # Observing, as `serve` does: every finished request's usage chunk decoded into an
        # observation and batched to the supervising process (here written to nowhere).
        "--observations",
        os.devnull,
        *(["--workers", str(workers)] if workers is not None else []),
    ]


@contextlib.contextmanager
def upstream(args: argparse.Namespace) -> Iterator[tuple[int, int | None, bytes]]:
    """The upstream's port, its pid when it is one process, and the body to stream."""
    if args.upstream == "replay":
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "bench.gateway",
            "--serve-replay",
            str(port),
            "--chunk-interval-ms",
            str(args.chunk_interval_ms),
        ]
        body = json.dumps({"model": "tiny-llama", "prompt": "x", "stream": True}).encode()
        with child(command, f"http://127.0.0.1:{port}/v1/models") as pid:
            yield port, pid, body
        return
    from testbed.environment import ModelSet, VllmEnvironment
    from testbed.server import VllmServer, parse_spec
    from testbed.traffic import code_prompt, completion_body

    env = VllmEnvironment.default().ensure()
    models = ModelSet.default().ensure(env)
    with VllmServer(env, models, parse_spec("ngram:4", models)) as server:
        request = completion_body(code_prompt(0), args.max_tokens, stream=True)
        yield server.port, None, json.dumps(request).encode()


NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    upstream bench {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""
"""One worker (the gateway is one process too), no access log, keep-alive to the
upstream and no response buffering, so tokens stream through as they come."""

LITELLM_CONF = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: hosted_vllm/{model}
      api_base: {upstream_url}/v1
      api_key: none
litellm_settings:
  telemetry: false
"""

PEER_GOALS = {
    "vs_nginx_latency": 1.5,
    "vs_litellm_latency": 0.25,
    "vs_litellm_cpu": 0.25,
}


@contextlib.contextmanager
def nginx_proxy(nginx: Path, upstream_port: int, root: Path) -> Iterator[tuple[int, int]]:
    """nginx (one worker) in front of the upstream: (port, master pid)."""
    port = free_port()
    for folder in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "nginx.conf"
    conf.write_text(NGINX_CONF.format(root=root, upstream_port=upstream_port, port=port))
    command = [str(nginx), "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")]
    with child(command, f"http://127.0.0.1:{port}/v1/models", log=root / "nginx.out") as pid:
        yield port, pid


@contextlib.contextmanager
def litellm_proxy(
    litellm: Path, upstream_port: int, model: str, root: Path
) -> Iterator[tuple[int, int]]:
    """The LiteLLM proxy (one worker) with the upstream as its backend: (port, pid)."""
    port = free_port()
    conf = root / "litellm.yaml"
    conf.write_text(
        LITELLM_CONF.format(model=model, upstream_url=f"http://127.0.0.1:{upstream_port}")
    )
    # The model price list ships with the package: no fetch at start-up (no network).
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    command = [str(litellm), "--config", str(conf), "--host", "127.0.0.1",
               "--port", str(port), "--num_workers", "1"]  # fmt: skip
    ready = f"http://127.0.0.1:{port}/health/liveliness"
    with child(command, ready, 240.0, env=env, log=root / "litellm.out", cwd=root) as pid:
        yield port, pid


@contextlib.contextmanager
def relay_proxy(upstream_port: int, root: Path) -> Iterator[tuple[int, int]]:
    """The bare uvloop relay (:func:`serve_relay`) in front of the upstream: (port, pid)."""
    port = free_port()
    command = gateway_command(port, f"http://127.0.0.1:{upstream_port}", "relay")
    with child(command, f"http://127.0.0.1:{port}/v1/models", log=root / "relay.out") as pid:
        yield port, pid


@contextlib.contextmanager
def peer_proxies(
    upstream_port: int, model: str, root: Path
) -> Iterator[dict[str, tuple[int, int]]]:
    """nginx and the LiteLLM proxy in front of the upstream (installed once if missing,
    see :mod:`bench.peers`), and the bare Python relay as a reference: name → (port, pid)."""
    from bench.peers import ensure_litellm, ensure_nginx

    nginx, litellm = ensure_nginx(), ensure_litellm()
    with (
        nginx_proxy(nginx, upstream_port, root) as nginx_at,
        litellm_proxy(litellm, upstream_port, model, root) as litellm_at,
        relay_proxy(upstream_port, root) as relay_at,
    ):
        yield {"nginx": nginx_at, "litellm": litellm_at, "python_relay": relay_at}


def _proxy_summary(result: LevelResult) -> dict[str, Any]:
    return {
        "added_p50_ms": result.added_p50_ms,
        "added_p99_ms": result.added_p99_ms,
        "added_p50_ms_90": list(result.added_p50_ms_90),
        "added_p99_ms_90": list(result.added_p99_ms_90),
        "added_ttfb_p50_ms": result.added_ttfb_p50_ms,
        "cpu_ms_per_request": result.cpu_ms_per_request,
        "direct_p50_ms": result.direct_p50_ms,
        "through_p50_ms": result.gateway_p50_ms,
        "requests": result.requests,
    }


def _latency_goals() -> Iterator[tuple[str, str, str, float]]:
    """Each latency goal as (check name, quantile, peer, factor): added quantile at most
    factor × the peer's."""
    for q in ("p50", "p99"):
        for peer in ("nginx", "litellm"):
            yield f"{q}_vs_{peer}", q, peer, PEER_GOALS[f"vs_{peer}_latency"]


def peer_checks(proxies: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The issue's goals for one level: specpilot's added latency against nginx's and
    LiteLLM's, its CPU per request against LiteLLM's."""
    ours, litellm = proxies["specpilot"], proxies["litellm"]
    out = {}
    for check, q, peer, factor in _latency_goals():
        key = f"added_{q}_ms"
        out[check] = ours[key] <= factor * proxies[peer][key]
    out["cpu_vs_litellm"] = (
        ours["cpu_ms_per_request"] <= PEER_GOALS["vs_litellm_cpu"] * litellm["cpu_ms_per_request"]
    )
    return out


def settled_checks(proxies: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Per latency goal of :func:`peer_checks`: whether its verdict holds at every end
    of the two figures' 90 % intervals (False: chance alone could turn it)."""
    ours = proxies["specpilot"]
    out = {}
    for check, q, peer, factor in _latency_goals():
        key = f"added_{q}_ms_90"
        (ours_low, ours_high), (peer_low, peer_high) = ours[key], proxies[peer][key]
        met_surely = ours_high <= factor * peer_low
        missed_surely = ours_low > factor * peer_high
        out[check] = met_surely or missed_surely
    return out


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from controller.gateway.workers import default_workers

    levels: list[dict[str, Any]] = []
    many = args.workers or default_workers()
    counts = [many] if args.gateway_server != "native" else sorted({1, many}, reverse=True)
    with contextlib.ExitStack() as stack:
        upstream_port, upstream_pid, body = stack.enter_context(upstream(args))
        gateways: dict[int, tuple[int, int]] = {}
        for workers in counts:
            port = free_port()
            command = gateway_command(
                port, f"http://127.0.0.1:{upstream_port}", args.gateway_server, workers
            )
            gateways[workers] = (
                port,
                stack.enter_context(child(command, f"http://127.0.0.1:{port}/v1/models")),
            )
        peers: dict[str, tuple[int, int]] = {}
        if args.peers:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-peers-")))
            model = json.loads(body).get("model", "tiny-llama")
            peers = stack.enter_context(peer_proxies(upstream_port, model, root))
        for concurrency in args.levels:
            requests = max(args.requests, 8 * concurrency)

            def measure(
                port: int, proxy_pid: int, concurrency: int = concurrency, requests: int = requests
            ) -> LevelResult:
                return asyncio.run(
                    measure_level(
                        concurrency,
                        requests,
                        ("127.0.0.1", upstream_port),
                        ("127.0.0.1", port),
                        proxy_pid,
                        upstream_pid,
                        "/v1/completions",
                        body,
                    )
                )

            # The default (one worker per core) first: its figures are the level's.
            by_workers = {workers: measure(*gateways[workers]) for workers in counts}
            result = by_workers[many]
            level: dict[str, Any] = asdict(result)
            if args.gateway_server == "native":
                level["by_workers"] = {str(w): _proxy_summary(r) for w, r in by_workers.items()}
            if not args.json:
                for workers, measured in by_workers.items():
                    print(_row(measured, workers), flush=True)
            if peers:
                proxies = {"specpilot": _proxy_summary(result)}
                if 1 in by_workers and many != 1:
                    proxies["specpilot_1_worker"] = _proxy_summary(by_workers[1])
                for name, (port, proxy_pid) in peers.items():
                    proxies[name] = _proxy_summary(measure(port, proxy_pid))
                level["proxies"] = proxies
                level["peer_checks"] = peer_checks(proxies)
                level["peer_checks_settled"] = settled_checks(proxies)
                if 1 in by_workers and many != 1:
                    one = {**proxies, "specpilot": proxies["specpilot_1_worker"]}
                    level["peer_checks_1_worker"] = peer_checks(one)
                if not args.json:
                    print(
                        _peer_rows(
                            concurrency,
                            proxies,
                            level["peer_checks"],
                            level["peer_checks_settled"],
                        ),
                        flush=True,
                    )
            levels.append(level)
    return {
        "upstream": args.upstream,
        "chunk_interval_ms": args.chunk_interval_ms if args.upstream == "replay" else None,
        "gateway_server": args.gateway_server,
        "workers": many,
        "goal": {"added_p50_ms": GOAL_P50_MS, "added_p99_ms": GOAL_P99_MS},
        **({"peer_goals": PEER_GOALS, "peers": _peer_versions()} if args.peers else {}),
        "levels": levels,
    }


def _peer_versions() -> dict[str, str]:
    from bench.peers import LITELLM_PACKAGE, ensure_nginx

    nginx = subprocess.run([str(ensure_nginx()), "-v"], capture_output=True, text=True, check=False)
    return {
        "nginx": nginx.stderr.strip().removeprefix("nginx version: "),
        "litellm": LITELLM_PACKAGE,
    }


def _peer_rows(
    concurrency: int,
    proxies: dict[str, dict[str, Any]],
    checks: dict[str, bool],
    settled: dict[str, bool],
) -> str:
    def interval(pair: Sequence[float]) -> str:
        return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"

    lines = []
    for name, row in proxies.items():
        lines.append(
            f"  {concurrency:>3} streams, {name:<9}: added p50 {row['added_p50_ms']:+.3f} ms "
            f"{interval(row['added_p50_ms_90'])}, p99 {row['added_p99_ms']:+.3f} ms "
            f"{interval(row['added_p99_ms_90'])}, CPU {row['cpu_ms_per_request']:.3f} ms/request"
        )
    lines.append(
        "  goals: "
        + ", ".join(
            f"{k} {'ok' if v else 'MISSED'}{'' if settled.get(k, True) else ' (within noise)'}"
            for k, v in checks.items()
        )
    )
    return "\n".join(lines)


def _row(r: LevelResult, workers: int) -> str:
    return (
        f"concurrency {r.concurrency:>3}, {workers} worker{'s' if workers > 1 else ''}: "
        f"added p50 {r.added_p50_ms:+.3f} ms, "
        f"p99 {r.added_p99_ms:+.3f} ms, ttfb p50 {r.added_ttfb_p50_ms:+.3f} ms, "
        f"gateway CPU {r.cpu_ms_per_request:.3f} ms/request"
        f" (waited for a CPU {r.runqueue_wait_ms_per_request:.3f})"
        + (
            f" (replay server {r.upstream_cpu_ms_per_request:.3f})"
            if r.upstream_cpu_ms_per_request is not None
            else ""
        )
        + " "
        f"(direct p50 {r.direct_p50_ms:.2f} ms, through {r.gateway_p50_ms:.2f} ms; "
        f"ratio {r.gateway_p50_ms / r.direct_p50_ms:.4f})"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", choices=("vllm", "replay"), default="vllm")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument(
        "--requests", type=int, default=None, help="per path and level (default by upstream)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="vllm upstream only")
    parser.add_argument(
        "--gateway-server",
        choices=("native", "uvicorn", "relay"),
        default="native",
        help="the gateway's HTTP front end (`specpilot gateway --server`), or 'relay': a "
        "bare byte-copying TCP relay in its place, the floor for any Python proxy",
    )
    parser.add_argument("--chunk-interval-ms", type=float, default=2.0, help="replay only")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="the gateway's N (default: one per core); each level is also measured with 1",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also measure nginx and the LiteLLM proxy in front of the same upstream "
        "(installed once by bench.peers: apt-get nginx, LiteLLM in its own venv)",
    )
    parser.add_argument("--serve-replay", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--fixture", default="completion-ngram", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--relay-to", type=int, metavar="PORT", help=argparse.SUPPRESS)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gateway`` to the ``bench`` sub-command group."""
    parser = subparsers.add_parser("gateway", help="gateway overhead vs. going straight to vLLM")
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.serve_relay:
        import uvloop

        uvloop.run(serve_relay(args.serve_relay, args.relay_to))
        return 0
    if args.serve_replay:
        asyncio.run(serve_replay(args.serve_replay, args.chunk_interval_ms / 1000.0, args.fixture))
        return 0
    if args.requests is None:
        args.requests = 600 if args.upstream == "replay" else 64
    result = run_benchmark(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gateway-{args.upstream}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        worst = max(result["levels"], key=lambda level: level["added_p99_ms"])
        print(
            f"worst p99 added {worst['added_p99_ms']:+.3f} ms at concurrency "
            f"{worst['concurrency']} (goal ≤ {GOAL_P99_MS} ms p99, ≤ {GOAL_P50_MS} ms p50)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
