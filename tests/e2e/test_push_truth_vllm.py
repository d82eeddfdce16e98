"""What specpilot says is what vLLM reports: ``specpilot serve`` beside a real vLLM that
runs n-gram γ = 4 and that nothing restarts, with the default file actuator.

The operator pins n-gram γ = 2; specpilot decides it and writes the file, but nothing
applies the file, so vLLM goes on with γ = 4. specpilot must say so: the push is
``not_applied`` after ``actuators.confirm_within_s``, ``/v1/fleet`` shows "pushed
ngram:2, running ngram:4", ``SpecpilotPushNotApplied`` fires (not before the deadline),
every window is attributed to γ = 4, and when the operator pins what runs the push is
confirmed at once and the alert resolves. Each action is one JSON log line.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.server import SERVED_MODEL
from testbed.traffic import run_streams
from tests.conftest import VllmServers
from tests.controller.conftest import free_port
from tests.controller.test_serve import AUTH, Serve

pytestmark = pytest.mark.vllm

TUNING = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4, **TUNING}
CONFIRM_WITHIN_S = 12.0
SCOPE = {"model": "*", "class": "code", "bucket": "*"}


def write_config(tmp_path: Path, port: int, url: str) -> Path:
    """The README's first ``serve`` beside a fleet: push mode, scraping, file actuator."""
    config = {
        "data_dir": str(tmp_path / "data"),
        "classes": ["code"],
        "scrape_interval_s": 1.0,
        "api": {"host": "127.0.0.1", "port": port},
        "actuators": {"confirm_within_s": CONFIRM_WITHIN_S},
        "fleet": {
            "pools": {
                "code": {
                    "model": SERVED_MODEL,
                    "instances": [url],
                    "speculative_config": NGRAM4,
                    "proposers": {"ngram": {"method": "ngram", "gamma": [1, 4], "tuning": TUNING}},
                }
            }
        },
    }
    path = tmp_path / "specpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def pin(serve: Serve, gamma: int) -> str:
    body = {
        "scope": SCOPE,
        "config": {"method": "ngram", "num_speculative_tokens": gamma},
        "ttl_s": 600,
        "reason": f"pin γ={gamma}",
    }
    response = serve.client.post("/v1/overrides", json=body, headers=AUTH)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def pool(serve: Serve) -> dict[str, Any]:
    [only] = serve.get("/v1/fleet")["pools"]
    return dict(only)


def push_alerts(serve: Serve) -> list[dict[str, Any]]:
    alerts = serve.get("/v1/alerts")["alerts"]
    return [a for a in alerts if a["name"] == "SpecpilotPushNotApplied"]


def traffic(url: str, requests: int, seed: int) -> None:
    import asyncio

    asyncio.run(run_streams(url, count=1, requests_each=requests, seed=seed, max_tokens=24))


def test_a_push_nothing_applies_is_reported_not_applied_and_windows_stay_gamma_4(
    vllm_servers: VllmServers, tmp_path: Path
) -> None:
    server = vllm_servers.get("ngram:4")
    port = free_port()
    serve = Serve(
        write_config(tmp_path, port, server.base_url), port, args=["--log-format", "json"]
    )
    try:
        serve.until(serve.readyz, 60)
        # Only the operator decides here: the policy's own moves are other tests' subject.
        frozen = serve.client.post("/v1/policy/freeze", headers=AUTH)
        assert frozen.json() == {"frozen": True}
        # The first push writes what vLLM runs: confirmed by its first scrape.
        first = serve.until(lambda: pool(serve)["push_state"] == "confirmed" and pool(serve))
        assert first["running_arm"] == "ngram:4" and first["summary"] == "runs ngram:4"
        traffic(server.base_url, 6, seed=0)

        pinned_2 = pin(serve, 2)
        decided = serve.until(
            lambda: [d for d in serve.get("/v1/decisions")["decisions"] if d["arm"] == "ngram:2"]
        )
        pushed_at = min(d["ts"] for d in decided)
        pending = serve.until(lambda: pool(serve)["pushed_arm"] == "ngram:2" and pool(serve))
        assert pending["pushed_arm"] == "ngram:2" and pending["running_arm"] == "ngram:4"
        assert pending["effective_config"]["num_speculative_tokens"] == 2
        written = json.loads((tmp_path / "data" / "speculative-configs" / "code.json").read_text())
        assert written["num_speculative_tokens"] == 2  # handed over; nothing applies it

        seed = 1
        while not push_alerts(serve):
            assert time.time() - pushed_at < CONFIRM_WITHIN_S + 120, pool(serve)
            traffic(server.base_url, 3, seed=seed)  # vLLM keeps drafting with γ = 4
            seed += 1
        [alert] = push_alerts(serve)
        assert alert["ts"] - pushed_at >= CONFIRM_WITHIN_S - 1.0  # not before the deadline
        assert alert["resolved_at"] is None and alert["context"] == "pool=code"
        assert "pushed ngram:2, running ngram:4" in alert["message"]
        stuck = pool(serve)
        assert stuck["push_state"] == "not_applied"
        assert stuck["summary"] == "pushed ngram:2, running ngram:4 (not_applied)"
        [instance] = stuck["instances"]
        assert instance["arm"] == "ngram:4"
        contexts = serve.get("/v1/policy")["contexts"]
        assert {(c["arm"], c["decided_arm"]) for c in contexts} == {("ngram:4", "ngram:2")}
        metrics = serve.client.get("/metrics").text
        assert 'specpilot_push_applied{pool="code"} 0.0' in metrics

        # The operator pins what runs: that push is confirmed at once, the alert resolves.
        pinned_4 = pin(serve, 4)
        resolved = serve.until(lambda: push_alerts(serve)[0]["resolved_at"], 30)
        assert resolved >= alert["ts"]
        assert pool(serve)["push_state"] == "confirmed"
        assert 'specpilot_push_applied{pool="code"} 1.0' in serve.client.get("/metrics").text
        for override in (pinned_2, pinned_4):
            deleted = serve.client.delete(f"/v1/overrides/{override}", headers=AUTH)
            assert deleted.status_code == 204
        time.sleep(2.5)  # the loop notices the overrides ended
        assert serve.kill(signal.SIGTERM) == 0
    finally:
        serve.kill()

    with sqlite3.connect(tmp_path / "data" / "specpilot.db") as db:
        arms = db.execute(
            "SELECT arm, COUNT(*), SUM(requests) FROM window_stats WHERE arm IS NOT NULL "
            "GROUP BY arm"
        ).fetchall()
        rows = db.execute(
            "SELECT ts, model, arm, status, requests, healthy, instance FROM window_stats"
        ).fetchall()
    assert [arm for arm, _, _ in arms] == ["ngram:4"], [r for r in rows if r[2] != "ngram:4"]
    assert arms[0][2] >= 6  # the windows carried the traffic

    lines = [
        json.loads(line) for line in serve.log.read_text().splitlines() if line.startswith("{")
    ]
    acted = [line for line in lines if "action" in line]
    kinds = [line["action"] for line in acted]
    for kind in (
        "override_set",
        "decision",
        "push",
        "push_not_applied",
        "alert_raised",
        "push_confirmed",
        "alert_resolved",
        "override_ended",
    ):
        assert kind in kinds, (kind, kinds)
    not_applied = next(line for line in acted if line["action"] == "push_not_applied")
    assert (not_applied["pushed"], not_applied["running"]) == ("ngram:2", "ngram:4")
    raised = [line["alert"] for line in acted if line["action"] == "alert_raised"]
    assert raised.count("SpecpilotPushNotApplied") == 1, raised  # once, not per iteration
    # Scrapes are not logged at the default level: one line per action, not per scrape.
    assert not [line for line in lines if line["logger"] in ("httpx", "httpcore")]
