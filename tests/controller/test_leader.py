"""Leader election on PostgreSQL: exactly one leader, take-over when it dies."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from controller.store.leader import AdvisoryLockLeader, SoleLeader, leadership_for
from tests.controller.conftest import PgDatabase

WORKER = Path(__file__).with_name("leader_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_sqlite_process_is_sole_leader(tmp_path: Path) -> None:
    leadership = leadership_for(f"sqlite:///{tmp_path}/x.db")
    assert isinstance(leadership, SoleLeader) and leadership.check()


def test_one_leader_and_handover_in_process(pg: PgDatabase) -> None:
    first, second = AdvisoryLockLeader(pg.url), AdvisoryLockLeader(pg.url)
    try:
        assert first.check() is True
        assert second.check() is False
        assert first.check() is True  # renewing keeps it
        first.release()
        assert second.check() is True
        assert first.check() is False
    finally:
        first.release()
        second.release()


def test_leader_whose_session_is_killed_takes_the_lock_back(pg: PgDatabase) -> None:
    leader = AdvisoryLockLeader(pg.url)
    try:
        assert leader.check()
        assert pg.terminate_backends() >= 1
        assert leader.check() is True  # reconnects and re-acquires: nobody else wanted it
    finally:
        leader.release()


class Replica:
    """A worker process whose stdout lines arrive on a queue."""

    def __init__(self, url: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), url, "0.2"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def wait_for(self, word: str, timeout_s: float) -> float:
        """Seconds until the worker printed ``word``; fails after ``timeout_s``."""
        start = time.monotonic()
        while True:
            remaining = timeout_s - (time.monotonic() - start)
            assert remaining > 0, f"no {word!r} within {timeout_s} s"
            try:
                if self.lines.get(timeout=remaining) == word:
                    return time.monotonic() - start
            except queue.Empty:
                continue

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


def test_takeover_when_the_leader_is_killed(pg: PgDatabase) -> None:
    first = Replica(pg.url)
    second = None
    try:
        first.wait_for("leader", 30)
        second = Replica(pg.url)
        second.wait_for("follower", 30)
        first.kill()  # kill -9: no clean release, PostgreSQL ends its session
        took = second.wait_for("leader", 10)
        assert took < 10
    finally:
        first.kill()
        if second is not None:
            second.kill()
