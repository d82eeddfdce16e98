"""`bench gateway --peers`: the peer proxies, their CPU accounting and the goals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.gateway import (
    StreamClient,
    added_interval,
    child,
    nginx_proxy,
    peer_checks,
    process_cpu_s,
    process_tree,
    relay_proxy,
    settled_checks,
)
from bench.peers import LITELLM_PACKAGE, ensure_nginx, installed_nginx, litellm_env
from testbed.server import free_port
from tests.conftest import required


def _row(p50: float, p99: float, cpu: float) -> dict[str, float]:
    return {"added_p50_ms": p50, "added_p99_ms": p99, "cpu_ms_per_request": cpu}


def test_peer_goals_compare_against_nginx_and_litellm() -> None:
    checks = peer_checks(
        {
            "specpilot": _row(0.6, 2.0, 1.0),
            "nginx": _row(0.5, 1.0, 0.4),
            "litellm": _row(3.0, 20.0, 3.0),
        }
    )
    assert checks == {
        "p50_vs_nginx": True,  # 0.6 <= 1.5 × 0.5
        "p50_vs_litellm": True,  # 0.6 <= 0.25 × 3.0
        "p99_vs_nginx": False,  # 2.0 > 1.5 × 1.0
        "p99_vs_litellm": True,  # 2.0 <= 0.25 × 20
        "cpu_vs_litellm": False,  # 1.0 > 0.25 × 3.0
    }


def _timed(
    p50: float, p99: float, p50_90: tuple[float, float], p99_90: tuple[float, float]
) -> dict[str, Any]:
    return {
        "added_p50_ms": p50,
        "added_p99_ms": p99,
        "added_p50_ms_90": list(p50_90),
        "added_p99_ms_90": list(p99_90),
        "cpu_ms_per_request": 1.0,
    }


def test_a_check_is_settled_only_where_the_intervals_keep_its_verdict() -> None:
    settled = settled_checks(
        {
            # p50 clearly within 1.5 × nginx; p99 against nginx's, which straddles zero.
            "specpilot": _timed(0.3, 0.4, (0.28, 0.32), (0.1, 0.7)),
            "nginx": _timed(0.3, 0.0, (0.25, 0.35), (-0.3, 0.3)),
            "litellm": _timed(30.0, 40.0, (29.0, 31.0), (35.0, 45.0)),
        }
    )
    assert settled == {
        "p50_vs_nginx": True,  # 0.32 <= 1.5 × 0.25
        "p99_vs_nginx": False,  # 0.7 > 1.5 × -0.3, and 0.1 <= 1.5 × 0.3
        "p50_vs_litellm": True,
        "p99_vs_litellm": True,
    }
    missed = settled_checks(
        {
            "specpilot": _timed(1.0, 1.0, (0.9, 1.1), (0.9, 1.1)),
            "nginx": _timed(0.3, 0.3, (0.25, 0.35), (0.25, 0.35)),
            "litellm": _timed(30.0, 40.0, (29.0, 31.0), (35.0, 45.0)),
        }
    )
    assert missed["p50_vs_nginx"] and missed["p99_vs_nginx"]  # surely missed: 0.9 > 0.525


def test_added_interval_covers_what_the_hop_adds() -> None:
    rng = np.random.default_rng(1)
    straight = list(0.020 + rng.exponential(0.002, 600))
    same = list(0.020 + rng.exponential(0.002, 600))
    slower = [t + 0.001 for t in same]
    middle = added_interval(straight, same, 0.5)
    assert middle[0] < 0.0 < middle[1]  # same distribution: zero inside
    low, high = added_interval(straight, slower, 0.5)
    assert 0.5 < low < 1.0 < high < 1.5  # one ms added, in ms
    tail = added_interval(straight, same, 0.99)
    assert tail[1] - tail[0] > middle[1] - middle[0]  # a tail quantile is known less well


_FORKING = """
import subprocess, sys
burn = "import time\\nend = time.process_time() + 0.2\\n"
burn += "while time.process_time() < end: pass\\ntime.sleep(60)"
subprocess.run([sys.executable, "-c", burn])
"""


def test_cpu_of_a_proxy_counts_the_workers_it_forked() -> None:
    """nginx serves from a worker its master forked: its CPU must be counted."""
    parent = subprocess.Popen([sys.executable, "-c", _FORKING], start_new_session=True)
    try:
        tree: list[int] = []
        for _ in range(1000):
            tree = process_tree(parent.pid)
            if len(tree) == 2 and process_cpu_s(tree[1]) >= 0.2:
                break
            subprocess.run(["sleep", "0.01"], check=True)
        assert len(tree) == 2 and tree[0] == parent.pid
        worker = process_cpu_s(tree[1])
        assert worker >= 0.2
        assert process_cpu_s(parent.pid) >= worker
    finally:
        os.killpg(parent.pid, signal.SIGTERM)
        parent.wait(timeout=30)


def _nginx() -> Path:
    """nginx as the bench finds it; where the test command requires it (scripts/test-all
    does) a missing one is installed or fails the test, otherwise the test is skipped."""
    if required("NGINX"):
        return ensure_nginx()
    found = installed_nginx()
    if found is None:
        pytest.skip("no nginx (bench.peers.ensure_nginx installs it)")
    return found


def test_litellm_is_pinned_and_kept_apart_from_the_project() -> None:
    # An exact pin, from before the releases known to have been compromised.
    name, _, version = LITELLM_PACKAGE.partition("==")
    assert name == "litellm[proxy]" and version not in {"1.82.7", "1.82.8", "1.107.0"}
    assert ".venv" not in litellm_env().parts and version in litellm_env().name


@contextlib.contextmanager
def _replay() -> Iterator[int]:
    """The replay upstream, events back to back: its port."""
    port = free_port()
    replay = [sys.executable, "-m", "bench.gateway", "--serve-replay", str(port),
              "--chunk-interval-ms", "0"]  # fmt: skip
    with child(replay, f"http://127.0.0.1:{port}/v1/models"):
        yield port


def _stream_through(port: int) -> None:
    """Three streams through the proxy at ``port``, each a complete chunked reply."""
    body = b'{"model": "tiny-llama", "prompt": "x", "stream": true}'

    async def stream() -> None:
        client = StreamClient("127.0.0.1", port, "/v1/completions", body)
        try:
            for _ in range(3):
                timing = await client.run()
                assert 0 < timing.ttfb_s <= timing.total_s
        finally:
            await client.close()

    asyncio.run(stream())


def test_nginx_relays_the_replayed_stream_unbuffered() -> None:
    nginx = _nginx()
    with (
        tempfile.TemporaryDirectory() as root,
        _replay() as port,
        nginx_proxy(nginx, port, Path(root)) as (nginx_port, pid),
    ):
        assert len(process_tree(pid)) == 2  # master and its one worker
        _stream_through(nginx_port)
        assert process_cpu_s(pid) > 0


def test_the_reference_relay_streams_the_replay_through() -> None:
    with (
        tempfile.TemporaryDirectory() as root,
        _replay() as port,
        relay_proxy(port, Path(root)) as (relay_port, pid),
    ):
        _stream_through(relay_port)
        assert process_cpu_s(pid) > 0
