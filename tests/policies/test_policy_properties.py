"""Properties that hold whatever the policy has seen."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from policies.arms import Arm, ConcurrencyBuckets, Context, arms_from_proposers
from policies.bandit import SpecPilotPolicy

ARMS = arms_from_proposers({"eagle3": [1, 3, 5], "ngram": [2, 4]})
BUCKETS = ConcurrencyBuckets()
CLASSES = ("code", "chat", "creative")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@st.composite
def _events(draw: st.DrawFn) -> list[tuple[str, int, Arm, float, list[int], int, float]]:
    count = draw(st.integers(1, 60))
    events = []
    for _ in range(count):
        cls = draw(st.sampled_from(CLASSES))
        concurrency = draw(st.integers(1, 80))
        arm = draw(st.sampled_from(ARMS))
        drafts = draw(st.integers(2, 200))
        per_position = []
        previous = drafts
        for _ in range(arm.gamma):
            previous = draw(st.integers(0, previous))
            per_position.append(previous)
        step_s = draw(st.floats(0.005, 0.2))
        advance = draw(st.floats(0.0, 30.0))
        events.append((cls, concurrency, arm, step_s, per_position, drafts, advance))
    return events


def _replay(policy: SpecPilotPolicy, clock: _Clock, events: list) -> list[Arm]:  # type: ignore[type-arg]
    chosen = []
    for cls, concurrency, arm, step_s, per_position, drafts, advance in events:
        context = Context("m", cls, BUCKETS.bucket(concurrency))
        chosen.append(policy.select(context))
        chosen.append(policy.decide(context).arm)
        clock.now += advance
        steps = drafts if arm.proposer else 100
        policy.observe(
            RequestObservation(
                model="m",
                prompt_tokens=10,
                output_tokens=steps + sum(per_position),
                ttft_s=step_s,
                mean_itl_s=step_s,
                generation_time_s=step_s * (steps - 1),
                spec=SpecDecodeRequestStats(
                    drafts, drafts * arm.gamma, sum(per_position), tuple(per_position)
                )
                if arm.proposer
                else None,
                workload_class=cls,
                arm=str(arm),
                concurrency=concurrency,
                finished_at=clock.now,
            )
        )
    return chosen


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_events(), st.integers(0, 2**16))
def test_decisions_are_always_available_arms(events: list, seed: int) -> None:  # type: ignore[type-arg]
    clock = _Clock()
    policy = SpecPilotPolicy(ARMS, clock=clock, rng=np.random.default_rng(seed))
    for arm in _replay(policy, clock, events):
        assert arm in ARMS
    for cls in CLASSES:
        for label in BUCKETS.labels:
            decision = policy.decide(Context("m", cls, label))
            assert decision.arm in ARMS
            if decision.interval is not None and decision.predicted_speedup is not None:
                low, high = decision.interval
                assert low <= high


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_events(), st.integers(0, 2**16))
def test_state_round_trips_through_json(events: list, seed: int) -> None:  # type: ignore[type-arg]
    clock = _Clock()
    policy = SpecPilotPolicy(ARMS, clock=clock, rng=np.random.default_rng(seed))
    _replay(policy, clock, events)
    policy.set_override(Arm("ngram", 2), workload_class="code", bucket="32+")
    state = json.loads(json.dumps(policy.state_dict()))
    clone = SpecPilotPolicy(ARMS, clock=clock, rng=np.random.default_rng(seed))
    clone.load_state_dict(state)
    assert clone.state_dict() == state
    override = Context("m", "code", "32+")
    assert clone.decide(override) == policy.decide(override)
