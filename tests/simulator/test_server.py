"""The simulated fleet over real HTTP on loopback, against recorded real vLLM 0.32 output.

One fleet serves the module (time runs ``SPEED`` times faster than the wall clock);
tests that count on fresh counters restart their instance first, which is itself the
behaviour under test (a restart resets counters like a new vLLM process).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.exposition import WorkerSnapshot, parse_exposition
from collectors.observations import RequestObservation
from collectors.per_request import (
    final_usage_chunk,
    observation_from_response,
    observation_from_stream,
    summed_spec,
)
from collectors.window import worker_window
from simulator.load import LoadOptions, run_load
from simulator.scenario import Scenario, parse_scenario
from simulator.server import FleetThread, PoolSpec, parse_pools

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
SPEED = 40.0
"""Simulated seconds per wall second: a 30 ms step takes under 1 ms here."""

SCENARIO: dict[str, Any] = {
    "seed": 7,
    "duration_s": 3600,
    "model": {"name": "sim-llama", "step_ms": 30, "knee_tokens": 64},
    "proposers": {"ngram": {"draft_cost": 0.005, "gammas": [2, 4]}},
    "classes": {
        "code": {"share": 0.5, "output_tokens": 40, "acceptance": {"ngram": 0.9}},
        "creative": {"share": 0.5, "output_tokens": 40, "acceptance": {"ngram": 0.05}},
    },
}
POOLS = "plain=off ngram=ngram:4 counted=ngram:4 tabled=ngram:4@1-1=4,2-1024=0"


def scenario(**changes: Any) -> Scenario:
    return parse_scenario({**SCENARIO, **changes})


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread(scenario(), parse_pools(POOLS), speed=SPEED) as running:
        yield running


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as http:
        yield http


def url(fleet: FleetThread, pool: str) -> str:
    return fleet.urls(pool)[0]


def recorded(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def recorded_chunks(name: str) -> list[dict[str, Any]]:
    text = (FIXTURES / name).read_text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def shape(value: Any) -> Any:
    """Keys (recursively) and JSON types, without the values."""
    if isinstance(value, Mapping):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, int | float) else type(value).__name__


def post(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(base + path, json={"model": "sim-llama", **body})
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def stream(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> list[str]:
    with client.stream("POST", base + path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        return response.read().decode().split("\n")


def scrape(client: httpx.Client, base: str) -> WorkerSnapshot:
    return parse_exposition(client.get(base + "/metrics").text)


def restart(client: httpx.Client, base: str, body: dict[str, Any] | None = None) -> None:
    client.post(base + "/sim/restart", json=body or {}).raise_for_status()


# -- shapes against the recorded real vLLM ---------------------------------------------


@pytest.mark.parametrize(
    ("pool", "path", "fixture"),
    [
        ("ngram", "/v1/completions", "completion-ngram.json"),
        ("ngram", "/v1/chat/completions", "chat-ngram.json"),
        ("plain", "/v1/completions", "completion-off.json"),
        ("plain", "/v1/chat/completions", "chat-off.json"),
    ],
)
def test_non_streaming_bodies_have_the_recorded_shape(
    fleet: FleetThread, client: httpx.Client, pool: str, path: str, fixture: str
) -> None:
    if path.endswith("chat/completions"):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "def f(x):"}]}
    else:
        body = {"prompt": "def f(x):"}
    got = post(client, url(fleet, pool), path, {**body, "max_tokens": 32})
    assert shape(got) == shape(recorded(fixture))
    assert got["usage"]["completion_tokens"] == 32
    assert got["choices"][0]["finish_reason"] == "length"


def test_speculative_decoding_figures_are_consistent_like_vllm(
    fleet: FleetThread, client: httpx.Client
) -> None:
    body = {"prompt": "x", "max_tokens": 16, "metadata": {"workload_class": "code"}}
    got = post(client, url(fleet, "ngram"), "/v1/completions", body)
    spec = got["metrics"]["speculative_decoding"]
    steps, accepted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
    assert spec["num_spec_tokens"] == 4
    assert len(spec["acceptance_histogram"]) == 5
    assert sum(spec["acceptance_histogram"]) == steps == len(spec["per_step_accepted"])
    assert sum(spec["per_step_accepted"]) == accepted
    assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"] == 4 * steps
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    timing = got["metrics"]
    assert got["usage"]["completion_tokens"] == 16
    assert timing["mean_itl_ms"] == pytest.approx(timing["generation_time_ms"] / 15)
    # One step emits accepted + 1 tokens, so the request needs fewer steps than tokens.
    assert accepted > 0 and steps < 16


@pytest.mark.parametrize(
    ("path", "fixture", "body"),
    [
        ("/v1/completions", "completion-ngram-stream-usage.sse", {"prompt": "x"}),
        (
            "/v1/chat/completions",
            "chat-ngram-stream-usage.sse",
            {"messages": [{"role": "user", "content": "hello"}]},
        ),
    ],
)
def test_streams_have_the_recorded_framing_and_metrics_on_the_usage_chunk_only(
    fleet: FleetThread, client: httpx.Client, path: str, fixture: str, body: dict[str, Any]
) -> None:
    lines = stream(
        client,
        url(fleet, "ngram"),
        path,
        {**body, "max_tokens": 24, "stream_options": {"include_usage": True}},
    )
    # SSE framing: "data: <json>" lines each followed by a blank line, ending in [DONE].
    assert lines[-3:] == ["data: [DONE]", "", ""]
    events = lines[:-1:2]
    assert all(line.startswith("data: ") for line in events)
    assert all(line == "" for line in lines[1::2])
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    want = recorded_chunks(fixture)
    assert [shape(c) for c in (chunks[0], chunks[-2], chunks[-1])] == [
        shape(c) for c in (want[0], want[-2], want[-1])
    ]
    assert all("metrics" not in chunk for chunk in chunks[:-1])
    usage = final_usage_chunk(lines)
    assert usage is not None and usage == chunks[-1]
    assert usage["usage"]["completion_tokens"] == 24
    # One content chunk per engine step (chat streams start with a role-only chunk).
    content = [
        c for c in chunks[:-1] if c["choices"] and "role" not in c["choices"][0].get("delta", {})
    ]
    assert len(content) == usage["metrics"]["speculative_decoding"]["num_spec_steps"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_without_include_usage_has_no_usage_chunk(
    fleet: FleetThread, client: httpx.Client
) -> None:
    lines = stream(client, url(fleet, "ngram"), "/v1/completions", {"prompt": "x", "max_tokens": 8})
    assert lines[-3] == "data: [DONE]"
    assert final_usage_chunk(lines) is None


# -- /metrics ------------------------------------------------------------------------


def test_counters_reconcile_exactly_with_the_per_request_metrics(
    fleet: FleetThread, client: httpx.Client
) -> None:
    base = url(fleet, "counted")
    restart(client, base)
    observations: list[RequestObservation] = []
    for i, cls in enumerate(["code", "creative"] * 3):
        body = {"prompt": "p", "max_tokens": 20 + 7 * i, "metadata": {"workload_class": cls}}
        if i % 2:
            lines = stream(
                client, base, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
            )
            found = observation_from_stream(lines)
            assert found is not None
            observations.append(found)
        else:
            observations.append(
                observation_from_response(post(client, base, "/v1/completions", body))
            )
    window = worker_window(None, scrape(client, base)).total

    assert window.spec is not None and summed_spec(observations) == window.spec
    assert window.spec.accepted_per_position and len(window.spec.accepted_per_position) == 4
    assert window.generation_tokens == sum(o.output_tokens or 0 for o in observations)
    steps = sum(o.spec.num_drafts or 0 for o in observations if o.spec is not None)
    itl = window.inter_token_latency
    assert itl is not None and itl.count == steps - len(observations)
    # Per engine step, not per token: far fewer observations than tokens.
    assert itl.count < (window.generation_tokens or 0) - len(observations)
    assert itl.sum_s == pytest.approx(sum(o.generation_time_s or 0 for o in observations))
    ttft = window.time_to_first_token
    assert ttft is not None and ttft.count == len(observations)
    assert ttft.sum_s == pytest.approx(sum(o.ttft_s or 0 for o in observations))
    tpot = window.time_per_output_token
    assert tpot is not None and tpot.count == len(observations)


def test_restart_resets_counters_and_changes_the_process_start_time(
    fleet: FleetThread, client: httpx.Client
) -> None:
    base = url(fleet, "counted")
    post(client, base, "/v1/completions", {"prompt": "p", "max_tokens": 16})
    before = scrape(client, base)
    restart(client, base, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    after = scrape(client, base)

    assert before.process_start_time_s is not None and after.process_start_time_s is not None
    assert after.process_start_time_s > before.process_start_time_s
    (engine,) = after.engines.values()
    assert engine.spec is not None and engine.spec.drafts == 0 and engine.generation_tokens == 0
    assert len(engine.spec.accepted_per_position) == 2
    assert worker_window(before, after).reset
    info = client.get(base + "/sim/info").json()
    assert info["config"] == "ngram:2" and info["restarts"] >= 1
    restart(client, base, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})


def test_speculation_off_shows_no_spec_series(fleet: FleetThread, client: httpx.Client) -> None:
    base = url(fleet, "plain")
    post(client, base, "/v1/completions", {"prompt": "p", "max_tokens": 8})
    (engine,) = scrape(client, base).engines.values()
    assert engine.spec is None
    assert engine.running == 0 and engine.waiting == 0 and engine.kv_cache_usage == 0
    assert engine.inter_token_latency is not None and engine.inter_token_latency.count > 0


def test_metric_families_and_buckets_match_a_recorded_page(
    fleet: FleetThread, client: httpx.Client
) -> None:
    ours = client.get(url(fleet, "ngram") + "/metrics").text
    real = (FIXTURES / "metrics-ngram-after.txt").read_text()

    def headers(text: str) -> set[str]:
        return {line for line in text.splitlines() if line.startswith("# TYPE ")}

    def buckets(text: str, family: str) -> list[str]:
        return [
            line.split("le=")[1].split('"')[1]
            for line in text.splitlines()
            if line.startswith(family + "_bucket{")
        ]

    assert headers(ours) <= headers(real)
    for family in (
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert buckets(ours, family) == buckets(real, family)


# -- workload classes and configs ----------------------------------------------------


def test_code_is_accepted_far_more_than_creative_as_the_scenario_says(
    fleet: FleetThread, client: httpx.Client
) -> None:
    base = url(fleet, "ngram")
    rates: dict[str, list[float]] = {"code": [], "creative": []}
    for _ in range(4):
        for cls in rates:
            response = client.post(
                base + "/v1/completions",
                json={"prompt": "p", "max_tokens": 40},
                headers={"X-Workload-Class": cls},
            )
            spec = response.json()["metrics"]["speculative_decoding"]
            rates[cls].append(spec["draft_acceptance_rate"])
    code = sum(rates["code"]) / len(rates["code"])
    creative = sum(rates["creative"]) / len(rates["creative"])
    assert code > 0.6 > 0.2 > creative


def test_batch_size_table_turns_speculation_off_when_the_batch_grows(
    fleet: FleetThread,
) -> None:
    base = url(fleet, "tabled")

    async def burst(n: int) -> list[dict[str, Any]]:
        # Open the connections first so that the requests arrive together; creative
        # requests (about one token per step) stay in the batch long enough to overlap.
        body = {"prompt": "p", "max_tokens": 200, "metadata": {"workload_class": "creative"}}
        async with httpx.AsyncClient(timeout=30) as http:
            await asyncio.gather(*(http.get(base + "/health") for _ in range(n)))
            responses = await asyncio.gather(
                *(http.post(base + "/v1/completions", json=body) for _ in range(n))
            )
        return [r.json()["metrics"]["speculative_decoding"] for r in responses]

    (alone,) = asyncio.run(burst(1))
    assert alone is not None and alone["num_spec_tokens"] == 4
    together = asyncio.run(burst(4))
    assert any(spec is None for spec in together)


def test_errors_look_like_vllm_errors(fleet: FleetThread, client: httpx.Client) -> None:
    base = url(fleet, "plain")
    wrong = client.post(base + "/v1/completions", json={"model": "nope", "prompt": "p"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == 404
    several = client.post(base + "/v1/completions", json={"prompt": "p", "n": 2})
    assert several.status_code == 400
    models = client.get(base + "/v1/models").json()
    assert [card["id"] for card in models["data"]] == ["sim-llama"]
    assert client.get(base + "/health").status_code == 200


def test_a_prompt_longer_than_the_context_or_one_token_leave_the_instance_serving(
    fleet: FleetThread, client: httpx.Client
) -> None:
    base = url(fleet, "plain")
    context = client.get(base + "/v1/models").json()["data"][0]["max_model_len"]
    prompt = "x" * (4 * context + 4)  # four characters a token
    for path, body in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    ):
        refused = client.post(base + path, json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "BadRequestError",
            "input_tokens",
            400,
        )
        assert error["message"].startswith(f"This model's maximum context length is {context}")
    # One token (its generation has no interval) is served too, streamed or not.
    for stream in (False, True):
        one = client.post(
            base + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream": stream}
        )
        assert one.status_code == 200, one.text
    # The instance was not held up by either: the next request is served as usual.
    served = client.post(base + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4


def test_an_instance_is_down_during_a_restart_with_downtime(
    fleet: FleetThread, client: httpx.Client
) -> None:
    base = url(fleet, "plain")
    started = client.get(base + "/sim/info").json()["process_start_time_seconds"]
    # 40 simulated seconds: one wall second to check it is down (a slow machine may
    # take a good part of that for three requests).
    answer = client.post(base + "/sim/restart", json={"downtime_s": 40.0})
    assert answer.status_code == 202
    assert client.get(base + "/health").status_code == 503
    assert client.post(base + "/v1/completions", json={"prompt": "p"}).status_code == 503
    assert client.get(base + "/metrics").status_code == 503
    for _ in range(500):
        if client.get(base + "/health").status_code == 200:
            break
        time.sleep(0.01)
    assert client.get(base + "/health").status_code == 200
    assert client.get(base + "/sim/info").json()["process_start_time_seconds"] > started


# -- the load generator --------------------------------------------------------------


def test_load_generator_stops_at_its_request_budget(fleet: FleetThread) -> None:
    options = LoadOptions(speed=SPEED, max_requests=6, max_duration_s=30, max_tokens=12)
    report = asyncio.run(run_load(url(fleet, "ngram"), scenario(), options, rng=random.Random(1)))
    assert report.stopped_by == "max_requests"
    assert report.sent == report.completed == 6 and report.failed == 0
    assert report.output_tokens == 6 * 12
    assert all(r.observation is not None and r.observation.spec for r in report.results)


def test_load_generator_follows_phases_and_stops_when_streams_end(fleet: FleetThread) -> None:
    # Two streams, then none from 30 simulated seconds on: the run ends by itself.
    phased = scenario(phases=[{"at_s": 0, "concurrency": 2}, {"at_s": 30, "concurrency": 0}])
    options = LoadOptions(speed=SPEED, max_requests=10_000, max_duration_s=30, stream=True)
    report = asyncio.run(run_load(url(fleet, "plain"), phased, options, rng=random.Random(2)))
    assert report.stopped_by == "scenario_end"
    assert report.completed > 2 and report.failed == 0
    assert set(report.by_class) <= {"code", "creative"}
    assert report.elapsed_s * SPEED < phased.duration_s


def test_load_generator_stops_at_its_time_bound(fleet: FleetThread) -> None:
    options = LoadOptions(speed=1.0, max_requests=10_000, max_duration_s=0.3)
    report = asyncio.run(run_load(url(fleet, "plain"), scenario(), options, rng=random.Random(3)))
    assert report.stopped_by == "max_duration"
    assert report.sent >= 1


# -- pure parts ----------------------------------------------------------------------


def test_pools_parse_with_counts_and_tables() -> None:
    pools = parse_pools("a=off*2; b=ngram:4@1-8=4,9-1024=0")
    assert pools[0] == PoolSpec("a", pools[0].config, 2) and str(pools[0].config) == "off"
    assert str(pools[1].config) == "ngram:4@1-8=4,9-1024=0"
    assert pools[1].config.arm_for(3).gamma == 4 and pools[1].config.arm_for(9).is_off
    assert pools[1].config.to_vllm() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 1024, 0]],
    }


@pytest.mark.parametrize(
    "text", ["a", "a=ngram", "a=ngram:0", "a=off*0", "a=off a=off", "a=ngram:2@1-4=3"]
)
def test_bad_pools_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_pools(text)


def test_unknown_proposer_is_rejected_naming_it() -> None:
    with pytest.raises(ValueError, match="eagle3"):
        FleetThread(scenario(), parse_pools("x=eagle3:4"))


def test_drift_hits_requests_issued_after_it_on_the_fleet_clock(client: httpx.Client) -> None:
    # The fleet's clock is injected: it only moves when the test moves it (and while a
    # request runs, since the driver sleeps in real time), so the drift is crossed
    # exactly, whatever the machine's load.
    now = [1000.0]
    drifting = scenario(drift=[{"at_s": 60, "class": "code", "proposer": "ngram", "acceptance": 0}])
    with FleetThread(drifting, parse_pools("n=ngram:4"), speed=SPEED, clock=lambda: now[0]) as f:
        base = url(f, "n")
        body = {"prompt": "p", "max_tokens": 24, "metadata": {"workload_class": "code"}}
        before = post(client, base, "/v1/completions", body)
        now[0] += 61 / SPEED
        after = post(client, base, "/v1/completions", body)
    assert before["metrics"]["speculative_decoding"]["draft_acceptance_rate"] > 0.5
    assert after["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] == 0


def test_counters_and_gauges_move_while_requests_run(client: httpx.Client) -> None:
    # One long class and room for one sequence: the second request must wait.
    long_outputs = scenario(
        classes={"essay": {"share": 1.0, "output_tokens": 4000, "acceptance": {"ngram": 0.5}}}
    )
    pools = parse_pools("n=ngram:4")
    with FleetThread(long_outputs, pools, speed=SPEED, max_num_seqs=1) as f:
        base = url(f, "n")
        body = {"prompt": "p" * 400, "stream": True}
        with (
            client.stream("POST", base + "/v1/completions", json=body) as first,
            client.stream("POST", base + "/v1/completions", json=body),
        ):
            next(first.iter_lines())  # the first step is out
            (engine,) = scrape(client, base).engines.values()
    assert engine.running == 1 and engine.waiting == 1
    assert engine.kv_cache_usage is not None and 0 < engine.kv_cache_usage < 1
    # Counted per step as it happens, not when the request ends.
    assert engine.generation_tokens and engine.spec and engine.spec.drafts >= 1
    assert engine.time_to_first_token is not None and engine.time_to_first_token.count == 1
