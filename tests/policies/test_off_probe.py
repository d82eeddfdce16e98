"""Push mode has no one-way door to off: a context on off probes speculation now and
then, for a bounded time at a priced spacing; and every arm of a planned context has a
prediction with an interval, off exactly 1."""

from __future__ import annotations

import numpy as np
import pytest

from collectors.observations import WindowObservation
from policies.arms import OFF, Arm, Context
from policies.bandit import SpecPilotPolicy
from policies.reasons import Reason
from tests.policies.test_window_evidence import (
    CONDITIONALS,
    NGRAM4,
    Clock,
    as_window,
    off_window,
    policy,
    requests,
)

CONTEXT = Context("m", "code", "1")
COLLAPSED = (0.02, 0.02, 0.02, 0.02)
SPEC_STEP_S = 0.026
"""A γ = 4 verify step costs 30 % more than a plain one (0.02 s): speculation that
accepts nothing loses."""


def spec_window(
    rng: np.random.Generator, conditionals: tuple[float, ...], at: float
) -> WindowObservation:
    return as_window(requests(rng, 20, conditionals, SPEC_STEP_S), at, SPEC_STEP_S)


def turned_off(
    clock: Clock, **config: object
) -> tuple[SpecPilotPolicy, np.random.Generator, float]:
    """A push-mode policy whose n-gram context ran well, then collapsed and went off;
    and when it went off."""
    push = policy(clock, moves_need_evidence=True, draft_cost_prior=0.05, dwell_s=0.0, **config)
    rng = np.random.default_rng(3)
    for _ in range(10):
        clock.now += 15.0
        push.observe_window(spec_window(rng, CONDITIONALS, clock.now))
        push.decide(CONTEXT, running=NGRAM4)
    went_off = None
    for _ in range(12):
        clock.now += 15.0
        push.observe_window(spec_window(rng, COLLAPSED, clock.now))
        if push.decide(CONTEXT, running=NGRAM4).arm == OFF and went_off is None:
            went_off = clock.now
    assert went_off is not None and push.decide(CONTEXT, running=NGRAM4).arm == OFF
    return push, rng, went_off


def run_off(push: SpecPilotPolicy, clock: Clock, seconds: float) -> list[tuple[float, str]]:
    """Feed off windows for ``seconds``; the (time, reason) of each decision that probes."""
    probes = []
    end = clock.now + seconds
    while clock.now < end:
        clock.now += 15.0
        push.observe_window(off_window(clock.now))
        decision = push.decide(CONTEXT, running=OFF)
        if decision.arm != OFF:
            probes.append((clock.now, decision.reason))
            assert decision.arm == Arm("ngram", 1)  # the proposer's smallest γ
            return probes
    return probes


def test_a_context_on_off_probes_after_the_spacing_and_the_probe_is_bounded() -> None:
    clock = Clock()
    push, rng, went_off = turned_off(clock, push_probe_every_s=600.0, push_probe_s=120.0)
    probes = run_off(push, clock, 900.0)
    assert probes, "no probe back from off within 900 s"
    at, reason = probes[0]
    assert reason == Reason.PROBE
    assert 600.0 <= at - went_off <= 600.0 + 15.0
    decision = push.decide(CONTEXT, running=Arm("ngram", 1))
    # The probe carries what the plan predicts for it, with its interval.
    assert decision.predicted_speedup is not None and decision.interval is not None
    # It holds for push_probe_s whatever the plans say, even on bad evidence…
    started = clock.now
    while clock.now - started < 105.0:
        clock.now += 15.0
        push.observe_window(spec_window(rng, COLLAPSED, clock.now))
        assert push.decide(CONTEXT, running=Arm("ngram", 1)).reason == Reason.PROBE
    # …then the evidence it gathered (still collapsed) turns it off again.
    arms = []
    for _ in range(4):
        clock.now += 15.0
        push.observe_window(spec_window(rng, COLLAPSED, clock.now))
        arms.append(push.decide(CONTEXT, running=Arm("ngram", 1)).arm)
    assert arms[-1] == OFF, arms


def test_a_probe_that_finds_acceptance_back_returns_the_context_to_speculation() -> None:
    clock = Clock()
    push, rng, _ = turned_off(clock, push_probe_every_s=600.0, push_probe_s=120.0)
    assert run_off(push, clock, 900.0)
    arms = []
    for _ in range(16):
        clock.now += 15.0
        push.observe_window(spec_window(rng, CONDITIONALS, clock.now))
        arms.append(push.decide(CONTEXT, running=NGRAM4))
    assert arms[-1].arm.proposer == "ngram" and arms[-1].reason != Reason.PROBE, arms[-1]


def test_without_probes_off_is_one_way() -> None:
    """What the probe is for: the same run with probes spaced past it never returns."""
    clock = Clock()
    push, _, _ = turned_off(clock, push_probe_every_s=10_000.0)
    assert run_off(push, clock, 3000.0) == []


def test_the_spacing_is_priced_by_the_probes_predicted_cost() -> None:
    clock = Clock()
    push = policy(
        clock,
        moves_need_evidence=True,
        push_probe_every_s=600.0,
        push_probe_s=120.0,
        push_probe_budget=0.02,
    )
    probes = push.off_probes
    assert probes.spacing(-0.3) == 600.0  # pays for itself: the floor
    assert probes.spacing(0.05) == 600.0  # 120 × 0.05 / 0.02 = 300 < 600
    assert probes.spacing(0.2) == pytest.approx(1200.0)  # 120 × 0.2 / 0.02


def test_a_probe_predicted_to_cost_more_than_the_cap_never_starts() -> None:
    clock = Clock()
    push, _, _ = turned_off(
        clock, push_probe_every_s=600.0, push_probe_s=120.0, push_probe_max_cost=0.0
    )
    assert push.predictions(CONTEXT)[Arm("ngram", 1)].speedup < 1.0  # it would cost
    assert run_off(push, clock, 1500.0) == []


def test_every_arm_has_a_prediction_off_is_one_and_the_committed_one_matches() -> None:
    clock = Clock()
    push = policy(clock, moves_need_evidence=True, draft_cost_prior=0.05, dwell_s=0.0)
    rng = np.random.default_rng(3)
    for _ in range(10):
        clock.now += 15.0
        push.observe_window(spec_window(rng, CONDITIONALS, clock.now))
        decision = push.decide(CONTEXT, running=NGRAM4)
    predictions = push.predictions(CONTEXT)
    assert set(predictions) == set(push.arms)
    assert predictions[OFF].speedup == 1.0 and predictions[OFF].interval == (1.0, 1.0)
    for arm, predicted in predictions.items():
        low, high = predicted.interval
        assert low <= predicted.speedup <= high, (arm, predicted)
    assert decision.predicted_speedup == predictions[decision.arm].speedup
    # Longer drafts gain more at this acceptance on a quiet engine.
    assert predictions[Arm("ngram", 4)].speedup > predictions[Arm("ngram", 1)].speedup > 1.0
