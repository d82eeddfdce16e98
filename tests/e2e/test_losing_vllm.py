"""A running arm that loses raises ``SpeculationLosing``, on real vLLM.

``specpilot serve`` beside two real vLLM servers of one model, clients straight to
them: pool ``json`` runs the testbed's draft model with γ = 3 on sampled JSON, pool
``code`` runs without speculation. On this CPU each drafted token costs a model pass
through vLLM's per-step Python, so the draft model loses to no speculation even at one
stream (docs/testbed.md: 0.66× off's goodput on sampled JSON). The off pool's windows
give the policy the plain step's cost, the draft pool's what its steps cost; the test
measures the loss itself from vLLM's own counters (time per output token of each
server) and checks that specpilot raises ``SpeculationLosing`` for the json contexts
running ``draft:3``, with the running arm's prediction below 1 on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed.server import SERVED_MODEL, VllmServer, parse_spec
from testbed.traffic import run_streams
from tests.conftest import VllmServers
from tests.controller.conftest import free_port
from tests.controller.test_serve import Serve

pytestmark = pytest.mark.vllm

JSON_SAMPLED = (("json", 0.7),)
CODE_GREEDY = (("code", 0.0),)


def write_config(tmp_path: Path, port: int, draft: VllmServer, off: VllmServer) -> Path:
    draft_config = dict(draft.speculative_config or {})
    config: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "classes": ["json", "code"],
        "buckets": [1, 2, 4],
        "scrape_interval_s": 1.0,
        "api": {"host": "127.0.0.1", "port": port},
        "policy": {"params": {"refresh_s": 5.0}},
        "fleet": {
            "pools": {
                "json": {
                    "model": SERVED_MODEL,
                    "instances": [draft.base_url],
                    "classes": ["json"],
                    "speculative_config": draft_config,
                    "proposers": {
                        "draft": {
                            "method": "draft_model",
                            "model": draft_config["model"],
                            "gamma": [1, 3],
                        }
                    },
                },
                "code": {
                    "model": SERVED_MODEL,
                    "instances": [off.base_url],
                    "classes": ["code"],
                    "speculative_config": {"method": "off"},
                },
            }
        },
    }
    path = tmp_path / "specpilot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def tpot(server: VllmServer) -> tuple[float, float]:
    """vLLM's own sum and count of time per output token on this server."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    name = "vllm:request_time_per_output_token_seconds"
    return (
        sum(v for _, v in samples(text, f"{name}_sum")),
        sum(v for _, v in samples(text, f"{name}_count")),
    )


async def both(draft: str, off: str, requests: int, seed: int) -> None:
    await asyncio.gather(
        run_streams(draft, 1, requests, seed=seed, mix=JSON_SAMPLED, max_tokens=32),
        run_streams(off, 1, requests, seed=seed, mix=CODE_GREEDY, max_tokens=32),
    )


def losing(serve: Serve) -> list[dict[str, Any]]:
    alerts = serve.get("/v1/alerts")["alerts"]
    return [a for a in alerts if a["name"] == "SpeculationLosing"]


def test_a_draft_model_that_loses_on_this_cpu_raises_speculation_losing(
    vllm_servers: VllmServers, tmp_path: Path, testbed: Any
) -> None:
    _, models = testbed
    assert parse_spec("draft:3", models) is not None
    draft = vllm_servers.get("draft:3")
    off = vllm_servers.get("off")
    port = free_port()
    serve = Serve(write_config(tmp_path, port, draft, off), port)
    try:
        serve.until(serve.readyz, 60)
        start = {s: tpot(s) for s in (draft, off)}
        deadline = time.monotonic() + 600
        seed = 0
        while not losing(serve):
            assert time.monotonic() < deadline, serve.get("/v1/policy")
            asyncio.run(both(draft.base_url, off.base_url, 3, seed))
            seed += 1
        [alert] = losing(serve)
        assert alert["context"].startswith("model_name=")
        assert "workload_class=json" in alert["context"], alert
        assert "draft:3 runs for json" in alert["message"], alert
        # It is true: vLLM's own time per output token, over the same run, on the draft
        # pool against the pool without speculation.
        end = {s: tpot(s) for s in (draft, off)}
        per_token = {
            s: (end[s][0] - start[s][0]) / max(end[s][1] - start[s][1], 1) for s in (draft, off)
        }
        assert per_token[draft] > per_token[off], per_token
        # The running arm's prediction is exported, below 1, for the json contexts only.
        predicted = {
            labels["workload_class"]: value
            for labels, value in samples(
                serve.client.get("/metrics").text, "specpilot_context_predicted_speedup"
            )
        }
        assert predicted.get("json", 1.0) < 1.0, predicted
        assert predicted.get("code") == 1.0, predicted
    finally:
        serve.kill()
