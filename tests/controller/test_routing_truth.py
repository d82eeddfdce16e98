"""Routing mode tells the truth: the demo's setup (its settings over the simulated
fleet, the real gateway, loop, bandit, store and API in one process) under its
scenario's traffic, then the API, the audit log, /v1/stats and /metrics are held
against where the gateway actually sent each request."""

from __future__ import annotations

import asyncio
import random
import socket
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collectors.observations import RequestObservation
from controller.contexts import Context
from controller.demo import DEMO_SCENARIO, demo_settings
from controller.loop import context_of
from controller.runtime import assemble
from controller.settings import TOKEN_ENV
from policies.reasons import Reason
from simulator.load import LoadOptions, run_load
from simulator.scenario import load_scenario
from simulator.server import SimFleet, default_pools

SPEED = 20.0
LOAD_S = 20.0
"""Wall seconds of traffic: 400 scenario seconds, the quiet start and most of the rush."""
SETTLE_S = 240.0
"""Wall seconds after which more traffic stops, settled or not (then the test fails)."""
CHECKED_CONTEXTS = 3
CHECKED_MIN = 30
"""Contexts that must have had this many requests since their last decision."""
TOKEN = "truth-secret"


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _run(tmp_path: Path) -> dict[str, Any]:
    scenario = load_scenario(DEMO_SCENARIO)
    pools = default_pools(scenario)
    sim = SimFleet(scenario, pools, speed=SPEED)
    await sim.start()
    urls = {pool.name: sim.urls(pool.name) for pool in pools}
    args = SimpleNamespace(data_dir=tmp_path / "data", port=0)
    settings = demo_settings(scenario, pools, urls, args, environ={TOKEN_ENV: TOKEN})
    seen: list[RequestObservation] = []
    runtime = assemble(settings, observe=seen.append)
    api_sock = _socket()
    api_url = f"http://127.0.0.1:{api_sock.getsockname()[1]}"
    await runtime.start(api_sock, _socket(), log_level="warning")
    gateway_url = f"http://127.0.0.1:{runtime.gateway_port}"
    out: dict[str, Any] = {"settings": settings}
    try:
        async with httpx.AsyncClient(base_url=api_url, timeout=30) as api:
            # A loaded machine serves fewer requests in the same wall time, and the
            # bandit is still moving when the traffic stops: more of the scenario runs
            # until enough contexts have settled to check (bounded, for a hang).
            rng = random.Random(scenario.seed)
            settle_by = asyncio.get_running_loop().time() + SETTLE_S
            while True:
                await run_load(
                    gateway_url,
                    scenario,
                    LoadOptions(speed=SPEED, max_requests=1_000_000, max_duration_s=LOAD_S),
                    rng=rng,
                )
                await _taken_in(api, len(seen))
                settled = _since_last_change(list(seen), await _all_decisions(api), settings)
                ready = [n for n, arms in settled.items() if sum(arms.values()) >= CHECKED_MIN]
                if len(ready) >= CHECKED_CONTEXTS or asyncio.get_running_loop().time() > settle_by:
                    break
            out["policy"] = (await api.get("/v1/policy")).json()
            out["decisions"] = await _all_decisions(api)
            out["stats"] = (await api.get("/v1/stats", params={"window_s": 3600})).json()
            out["metrics"] = (await api.get("/metrics")).text
            out["requests"] = list(seen)
            # An override may pin any arm a pool runs (not only off).
            pinned = await api.post(
                "/v1/overrides",
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={
                    "scope": {"class": "creative"},
                    "config": {"method": "ngram", "num_speculative_tokens": 2},
                    "ttl_s": 600,
                    "reason": "test pin",
                },
            )
            out["pinned"] = pinned
            out["refused"] = await api.post(
                "/v1/overrides",
                headers={"Authorization": f"Bearer {TOKEN}"},
                json={
                    "scope": {"class": "creative"},
                    "config": {"method": "ngram", "num_speculative_tokens": 3},
                    "ttl_s": 600,
                    "reason": "no pool runs it",
                },
            )
            await asyncio.sleep(2.5)  # the loop applies the pin at its next iteration
            before = len(seen)
            async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as gateway:
                for _ in range(12):
                    response = await gateway.post(
                        "/v1/completions",
                        json={"model": scenario.model.name, "prompt": "x", "max_tokens": 8},
                        headers={"X-Workload-Class": "creative"},
                    )
                    assert response.status_code == 200, response.text
            out["pinned_requests"] = seen[before:]
            await asyncio.sleep(2.5)
            out["policy_pinned"] = (await api.get("/v1/policy")).json()
            out["decisions_pinned"] = await _all_decisions(api)
    finally:
        await runtime.stop(grace_s=5.0)
        runtime.close()
        await sim.stop()
    return out


async def _taken_in(api: httpx.AsyncClient, requests: int) -> None:
    """Wait until the loop has taken in ``requests`` (it ticks every second; the
    deadline only guards against a hang), then one more iteration for its decisions."""
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        rows = (await api.get("/v1/stats", params={"window_s": 3600})).json()["rows"]
        if sum(r["requests"] for r in rows) >= requests:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.5)


def _since_last_change(
    requests: list[RequestObservation], decisions: list[dict[str, Any]], settings: Any
) -> dict[tuple[str, str, str], Counter[str]]:
    """Per context, the arms of the requests that finished after its last decision."""
    last_change: dict[tuple[str, str, str], float] = {}
    for decision in decisions:
        last_change[key(decision)] = max(decision["ts"], last_change.get(key(decision), 0.0))
    since: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
    for request in requests:
        context: Context = context_of(request, settings.buckets)
        name = (context.model, context.workload_class, context.bucket)
        assert request.arm is not None and request.finished_at is not None
        if request.finished_at > last_change.get(name, float("-inf")):
            since[name][request.arm] += 1
    return since


async def _all_decisions(api: httpx.AsyncClient) -> list[dict[str, Any]]:
    decisions: list[dict[str, Any]] = []
    before = None
    while True:
        params: dict[str, Any] = {"limit": 500}
        if before is not None:
            params["before"] = before
        page = (await api.get("/v1/decisions", params=params)).json()
        decisions.extend(page["decisions"])
        before = page["next_before"]
        if before is None:
            return decisions[::-1]  # oldest first


def key(row: dict[str, Any]) -> tuple[str, str, str]:
    return (row["model"], row["class"], row["bucket"])


def test_api_audit_log_stats_and_metrics_agree_with_where_requests_went(tmp_path: Path) -> None:
    out = asyncio.run(_run(tmp_path))
    settings = out["settings"]
    requests: list[RequestObservation] = out["requests"]
    # Enough traffic to reach several contexts (about 450 requests on a quiet machine;
    # a loaded one serves fewer in the same wall time, and the checks hold for any).
    assert len(requests) > 100
    policy = {key(c): c for c in out["policy"]["contexts"]}
    decisions: list[dict[str, Any]] = out["decisions"]

    # The audit log is a chain per context that starts where the gateway starts (off,
    # until the policy commits) and ends at the arm /v1/policy reports.
    by_context: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for decision in decisions:
        by_context[key(decision)].append(decision)
    for context, chain in by_context.items():
        assert chain[0]["previous_arm"] == "off", chain[0]
        for earlier, later in pairwise(chain):
            assert later["previous_arm"] == earlier["arm"]
            assert later["arm"] != earlier["arm"]
        assert policy[context]["arm"] == chain[-1]["arm"]
        # Each says why in the vocabulary, and what it weighed: off at 1, every
        # prediction inside its interval.
        assert all(d["reason"] in set(Reason) for d in chain), chain
        for d in chain:
            weighed = {a["arm"]: a for a in d["alternatives"]}
            if d["actor"] == "policy" and d["reason"] != "learning":
                assert weighed["off"]["predicted_speedup"] == 1.0, d
                assert d["arm"] in weighed, d
            for a in weighed.values():
                assert a["interval"]["low"] <= a["predicted_speedup"] <= a["interval"]["high"]
    assert any(d["alternatives"] for d in decisions), decisions
    for context, row in policy.items():
        if context not in by_context:
            assert row["arm"] == "off"

    # Where requests went, from the gateway's own tap.
    routed: Counter[tuple[tuple[str, str, str], str]] = Counter()
    for request in requests:
        context: Context = context_of(request, settings.buckets)
        assert request.arm is not None
        routed[((context.model, context.workload_class, context.bucket), request.arm)] += 1
    since = _since_last_change(requests, decisions, settings)
    # The policy moved off `off` somewhere (the demo's point). Wherever a context had
    # traffic since its last decision, /v1/policy's arm and explored share are what the
    # gateway did: the share of those requests not on the arm is the explored share
    # (requests finishing across the loop's one-second tick may land on either side).
    assert any(row["arm"] != "off" for row in policy.values()), policy
    checked = 0
    for name, arms in since.items():
        total = sum(arms.values())
        row = policy[name]
        if total < CHECKED_MIN:
            continue
        checked += 1
        elsewhere = 1.0 - arms[row["arm"]] / total
        assert abs(row["routed_requests"] - total) <= max(5, total // 10), (name, arms, row)
        assert row["explored_share"] is not None
        assert abs(row["explored_share"] - elsewhere) <= 0.1, (name, arms, row)
        if row["explored_share"] < 0.4:
            assert arms.most_common(1)[0][0] == row["arm"], (name, arms, row)
    assert checked >= CHECKED_CONTEXTS, since

    # /v1/stats holds every request, on the arm that served it.
    stats = Counter({(key(r), r["arm"]): r["requests"] for r in out["stats"]["rows"]})
    assert stats == routed

    # The metrics say the same: each context's arm, and the gateway's request counts.
    families = {f.name: f for f in text_string_to_metric_families(out["metrics"])}
    shown = {
        (s.labels["model_name"], s.labels["workload_class"], s.labels["bucket"]): s.labels["arm"]
        for s in families["specpilot_context_arm"].samples
        if s.value == 1
    }
    assert shown == {name: row["arm"] for name, row in policy.items()}
    served = Counter[tuple[str, str]]()
    for sample in families["specpilot_gateway_requests"].samples:
        if sample.name.endswith("_total") and sample.labels["status"] == "200":
            served[(sample.labels["workload_class"], sample.labels["arm"])] += int(sample.value)
    tapped = Counter((r.workload_class or "", r.arm or "") for r in requests)
    assert served == tapped
    # vLLM's acceptance of each context's arm, as /v1/policy shows it.
    acceptance = families["specpilot_context_acceptance_ratio"].samples
    speculating = {name for name, row in policy.items() if row["arm"] != "off"}
    assert {
        (s.labels["model_name"], s.labels["workload_class"], s.labels["bucket"]) for s in acceptance
    } == {name for name in speculating if policy[name]["estimate"]["acceptance"] is not None}
    assert all(0.0 <= s.value <= 1.0 for s in acceptance)

    # An operator pins creative to n-gram γ=2, which one pool runs; γ=3 none runs.
    assert out["pinned"].status_code == 201, out["pinned"].text
    assert out["pinned"].json()["arm"] == "ngram:2"
    assert out["refused"].status_code == 422
    assert "no pool runs" in out["refused"].json()["detail"]
    assert {r.arm for r in out["pinned_requests"]} == {"ngram:2"}
    for name, row in {key(c): c for c in out["policy_pinned"]["contexts"]}.items():
        if name[1] == "creative":
            assert (row["arm"], row["actor"]) == ("ngram:2", "operator"), row
            assert row["override_id"] == out["pinned"].json()["id"]
    pins = [d for d in out["decisions_pinned"] if d["actor"] == "operator"]
    assert pins and all(
        d["arm"] == "ngram:2" and d["reason"] == "override" and "test pin" in d["detail"]
        for d in pins
    )
