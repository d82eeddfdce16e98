"""`python -m bench.gateway --upstream replay --json` runs and reports every level."""

from __future__ import annotations

import json
import subprocess
import sys


def test_replay_benchmark_reports_each_level() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway",
            "--upstream",
            "replay",
            "--json",
            "--levels",
            "1",
            "4",
            "--requests",
            "8",
            "--chunk-interval-ms",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout)
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    # At least 8 streams per concurrent stream and path, so p99 is not one sample.
    assert [level["requests"] for level in report["levels"]] == [8, 32]
    for level in report["levels"]:
        assert {"added_p50_ms", "added_p99_ms", "upstream_cpu_ms_per_request"} <= level.keys()
        # The gateway as serve runs it (one worker per core) and with one worker.
        assert set(level["by_workers"]) == {"1", str(report["workers"])}
        for measured in level["by_workers"].values():
            assert measured["requests"] == level["requests"] and measured["cpu_ms_per_request"] > 0


def test_bare_relay_floor_runs_in_the_gateways_place() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.gateway", "--upstream", "replay", "--json",
         "--gateway-server", "relay", "--levels", "2", "--requests", "16",
         "--chunk-interval-ms", "0"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert report["gateway_server"] == "relay"
    (level,) = report["levels"]
    assert level["requests"] == 16 and level["cpu_ms_per_request"] > 0
