"""The real bandit behind the loop's policy port (no fakes: ``SpecPilotPolicy`` itself)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from controller.contexts import Context
from controller.ports import Route, Routed
from controller.wiring import BanditControlPolicy, QueuedObservations, bandit_policy, fleet_arms
from policies.arms import Arm, ConcurrencyBuckets
from policies.bandit import BanditConfig, SpecPilotPolicy
from tests.controller.conftest import make_settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def code_request(arm: str, at: float, *, tpot_s: float) -> RequestObservation:
    """A code request at concurrency 1 whose n-gram drafts were mostly accepted."""
    spec = None
    if arm != "off":
        spec = SpecDecodeRequestStats(
            num_drafts=20, num_draft_tokens=80, num_accepted_tokens=72,
            accepted_per_position=(20, 19, 17, 16),
        )  # fmt: skip
    return RequestObservation(
        model="m", prompt_tokens=100, output_tokens=101, ttft_s=0.05, mean_itl_s=tpot_s,
        generation_time_s=tpot_s * 100, spec=spec, workload_class="code", pool="p",
        arm=arm, concurrency=1, finished_at=at,
    )  # fmt: skip


@pytest.fixture
def policy(tmp_path: Path) -> tuple[BanditControlPolicy, Clock]:
    clock = Clock()
    settings = make_settings(tmp_path)
    return bandit_policy(settings, clock=clock, rng=np.random.default_rng(7)), clock


def test_arms_come_from_the_pools_proposers(tmp_path: Path) -> None:
    arms = [str(a) for a in fleet_arms(make_settings(tmp_path))]
    assert arms == ["ngram:1", "ngram:2", "ngram:3", "ngram:4", "tiny:1", "tiny:2", "tiny:3"]


def test_decisions_stay_among_allowed_arms_and_pins_win(
    policy: tuple[BanditControlPolicy, Clock],
) -> None:
    control, clock = policy
    context = Context("m", "code", "1-3")
    for _ in range(300):
        clock.now += 1.0
        arm = str(control.policy.select(context))
        fast = 0.010 if arm == "off" else 0.006
        control.observe(code_request(arm, clock.now, tpot_s=fast))
    allowed = ["off", "ngram:4"]
    choice = control.decide(context, allowed, current="off")
    assert choice.arm in allowed
    assert control.decide(context, ["off"], current="off").arm == "off"

    control.set_pins({context: "tiny:2"})
    pinned = control.decide(context, ["off", "tiny:2", "ngram:4"], current="off")
    assert (pinned.arm, pinned.reason) == ("tiny:2", "override")
    control.set_pins({})
    assert control.decide(context, allowed, current="off").reason != "override"


def test_one_contexts_estimates_are_its_predictions_and_its_class_acceptance(
    policy: tuple[BanditControlPolicy, Clock],
) -> None:
    """``estimates(context)`` (``/v1/policy``, every iteration, per context) reads its
    own context's predictions and class, not the whole policy each time: every arm's
    predicted speed-up as the bucket's plan has it, and the class's acceptance as
    ``SpecPilotPolicy.estimates()`` says."""
    control, clock = policy
    learned = Context("m", "code", "1-3")
    for _ in range(120):
        clock.now += 1.0
        arm = str(control.policy.select(learned))
        control.observe(code_request(arm, clock.now, tpot_s=0.010 if arm == "off" else 0.006))
    contexts = [Context("m", c, b) for c in ("code", "chat") for b in ("1-3", "4+")]
    for context in contexts:
        control.decide(context, ["off", "ngram:4"], current="off")
    whole = control.policy.estimates()
    assert whole["acceptance"]
    predicted_any = False
    for context in contexts:
        predictions = control.policy.predictions(context)
        seen = {
            a["proposer"]: a
            for a in whole["acceptance"]
            if a["workload_class"] == context.workload_class
        }
        for estimate in control.estimates(context):
            arm = Arm.parse(estimate.arm)
            predicted = predictions.get(arm)
            assert estimate.speedup == (predicted.speedup if predicted else None)
            assert estimate.speedup_interval == (predicted.interval if predicted else None)
            predicted_any |= predicted is not None
            expected = seen.get(arm.proposer) if arm.proposer else None
            assert estimate.observations == (int(expected["requests"]) if expected else 0)
            assert estimate.first_position_acceptance == (
                expected["first_position_acceptance"] if expected else None
            )
    assert predicted_any


def test_learned_state_survives_a_new_process(
    policy: tuple[BanditControlPolicy, Clock], tmp_path: Path
) -> None:
    control, clock = policy
    context = Context("m", "code", "1-3")
    for _ in range(120):
        clock.now += 1.0
        control.observe(code_request("ngram:4", clock.now, tpot_s=0.006))
    before = control.estimates(context)
    assert any(e.arm == "ngram:4" and e.observations > 0 for e in before)

    restarted = bandit_policy(make_settings(tmp_path), clock=clock, rng=np.random.default_rng(1))
    restarted.load_state(control.state_dict())
    assert restarted.estimates(context) == before


def test_bad_policy_params_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"policy.params: unknown \['explore'\]"):
        bandit_policy(make_settings(tmp_path, params={"explore": 0.5}))


def test_queued_observations_are_bounded_and_drained() -> None:
    queue = QueuedObservations(limit=2)
    for at in (1.0, 2.0, 3.0):
        queue.put(code_request("off", at, tpot_s=0.01))
    assert queue.dropped == 1
    drained = asyncio.run(queue.collect()).observations
    assert [o.finished_at for o in drained] == [2.0, 3.0]
    assert asyncio.run(queue.collect()).observations == ()


def test_routed_requests_count_as_the_policys_own_choices_and_routes_change_nothing() -> None:
    """The gateway's workers sample ``route`` and report what they routed: the bandit
    (as routing mode builds it) counts those requests as ``choose`` counts its own, and
    asking for routes counts nothing (that it explores as ``choose`` does is
    ``test_routing_truth``'s: ``explored_share``)."""
    clock = Clock()
    config = BanditConfig(buckets=ConcurrencyBuckets((1, 4)), topology="per_arm")
    bandit = SpecPilotPolicy([Arm("ngram", 4)], clock=clock, rng=np.random.default_rng(3),
                             config=config)  # fmt: skip
    control = BanditControlPolicy(bandit)
    context = Context("m", "code", "1-3")
    draws = np.random.default_rng(11)
    for _ in range(400):
        clock.now += 1.0
        route = control.route(context)
        arm, reason = route.arm, route.reason
        for other, share, why in route.explore:
            assert 0 < share <= 1 and other != route.arm
            if draws.random() < share:
                arm, reason = other, why
        control.routed(Routed(context, arm, reason, clock.now))
        fast = 0.010 if arm == "off" else 0.006
        control.observe(code_request(arm, clock.now + 0.5, tpot_s=fast))
    exploration = bandit.exploration
    assert exploration.selected == 400
    assert exploration.class_requests[("m", "code")] == 400
    assert exploration.explored <= 2 * config.explore_cap * 400
    # Asking for routes is not serving: nothing is counted, no exploring turn taken.
    counted = (exploration.selected, dict(exploration.class_requests))
    credits = dict(exploration.credits)
    for _ in range(50):
        control.route(context)
    assert (exploration.selected, dict(exploration.class_requests)) == counted
    assert exploration.credits == credits
    # An override is the route, and explores nothing.
    control.set_pins({context: "off"})
    assert control.route(context) == Route("off", "override")
