"""Probes of stale class × proposer estimates: priced in the batch the plan expects, paid
from a per-class budget, counted as exploration; and drifts of idle proposers get
caught."""

from __future__ import annotations

import json

import numpy as np
import pytest
from policy_sim import run_specpilot, scenario

from bench.policy import drift_report
from policies.arms import OFF, Arm, Context
from policies.bandit import BanditConfig, SpecPilotPolicy, _Commitment, _Plan
from policies.fleet import CostDraws, CostParams

MODEL = "m"
BUCKET = "32+"
EAGLE1 = Arm("eagle3", 1)
NGRAM2 = Arm("ngram", 2)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(
    *,
    in_flight: int,
    tokens: dict[tuple[str, Arm], float],
    seen: bool = True,
    **config: float,
) -> SpecPilotPolicy:
    """A policy at a fixed point: a plan expecting ``in_flight`` other sequences off in
    one batch, with a known cost model (step 20 ms, knee 64, drafting eagle3 0.1 /
    ngram 0.005) and known tokens per step, its probes priced, and ``code`` committed
    to off. ``seen``: ``code`` ran both proposers before (on ``first_probes``
    requests each), so its estimates are stale rather than missing."""
    arms = [EAGLE1, Arm("eagle3", 3), NGRAM2, Arm("ngram", 4)]
    settings = BanditConfig(**config)  # type: ignore[arg-type]
    policy = SpecPilotPolicy(arms, clock=_Clock(), rng=np.random.default_rng(0), config=settings)
    if seen:
        for proposer in ("eagle3", "ngram"):
            estimate = policy.learning.acceptance_model((MODEL, "code", proposer))
            estimate.update([5.0], 10.0, 0.0, requests=settings.first_probes)
    cost = CostParams(step_s=0.02, knee_tokens=64, draft_cost={"eagle3": 0.1, "ngram": 0.005})
    plan = policy.planner.plans[(MODEL, BUCKET)] = _Plan(
        0.0,
        0,
        {},
        concurrency=in_flight + 1.0,
        worlds=CostDraws.stack([cost] * 4),
        tokens=dict(tokens),
        shares={"code": 1.0},
        batch={OFF: float(in_flight)},
    )
    policy.commitment.commitments[Context(MODEL, "code", BUCKET)] = _Commitment(OFF, 0.0, "best")
    policy.exploration.price_probes(MODEL, plan, {"code": OFF})
    return policy


def _probes(policy: SpecPilotPolicy, requests: int) -> list[Arm]:
    """Serve ``requests`` of ``code`` one at a time, each finishing at once; the arms
    probed."""
    probed = []
    context = Context(MODEL, "code", BUCKET)
    for _ in range(requests):
        decision = policy.choose(context)
        policy.learning.tracker(MODEL, decision.arm).remove(decision.arm, 0.0)
        if decision.reason == "probe":
            assert decision.explored
            probed.append(decision.arm)
        else:
            assert decision.arm == OFF
    return probed


def test_a_probe_that_pays_for_itself_needs_no_budget() -> None:
    # Below the knee n-gram's drafting is almost free and at α ≈ 0.85 the probe emits
    # 2.6 tokens a step: it raises the batch's goodput, so it runs whenever due.
    policy = _policy(
        in_flight=20,
        tokens={(("code", NGRAM2)): 2.6, ("code", EAGLE1): 1.05},
        probe_budget=0.0,
    )
    # Every probe_every (25) requests; EAGLE-3 at α ≈ 0.05 only costs: with no budget
    # it is never probed.
    assert _probes(policy, 100) == [NGRAM2] * 4


def test_a_proposer_a_class_never_ran_is_probed_while_its_price_is_a_guess() -> None:
    # 60 sequences off at a knee of 64: at the prior's acceptance an EAGLE-3 probe is
    # priced at about 10 % of the batch while it runs, and there is no budget. Never
    # having run, it is probed on half of the class's requests all the same (within
    # the exploration cap), and n-gram, priced by the same guess, too, until their
    # evidence is in.
    tokens = {("code", EAGLE1): 1.05, ("code", NGRAM2): 1.02}
    policy = _policy(in_flight=60, tokens=tokens, seen=False, probe_budget=0.0)
    plan = policy.planner.plans[(MODEL, BUCKET)]
    assert plan.probe_costs[("code", "eagle3")] > 0.05
    # Each earns half a request per request and takes its turn when it has a whole one
    # (n-gram one request behind EAGLE-3, then the two take turns).
    assert _probes(policy, 12) == [EAGLE1, NGRAM2] * 5 + [EAGLE1]
    # Once it ran on ``first_probes`` requests its price is evidence: no budget, no
    # probe.
    policy.learning.acceptance_model((MODEL, "code", "eagle3")).update(
        [0.5], 10.0, 0.0, requests=policy.config.first_probes
    )
    policy.learning.acceptance_model((MODEL, "code", "ngram")).update(
        [0.2], 10.0, 0.0, requests=policy.config.first_probes
    )
    policy._publish(MODEL, BUCKET)
    assert _probes(policy, 100) == []
    # A first probe predicted to cost more than ``first_probe_max_cost`` never runs.
    dear = _policy(in_flight=60, tokens=tokens, seen=False, first_probe_max_cost=0.05)
    assert EAGLE1 not in _probes(dear, 100)


def test_a_costly_probe_waits_until_the_class_has_earned_it() -> None:
    # 60 sequences off at a knee of 64: an EAGLE-3 probe makes every step wait for its
    # drafting (+10 %) and verifies past the knee, for almost nothing accepted.
    tokens = {("code", EAGLE1): 1.05, ("code", NGRAM2): 1.02}
    probe = _policy(in_flight=60, tokens=tokens)
    context = Context(MODEL, "code", BUCKET)
    plan = probe.planner.plans[(MODEL, BUCKET)]
    cost = probe.exploration.probe_cost(context, OFF, EAGLE1, plan, {OFF: 60.0})
    assert 0.09 < cost < 0.12
    assert plan.probe_costs[("code", "eagle3")] == cost
    # A probe costing more than 4 requests' worth of a full batch at a budget of 1 %
    # never runs.
    cheap = _policy(in_flight=60, tokens=tokens, probe_budget=0.01, probe_burst=4.0)
    assert EAGLE1 not in _probes(cheap, 2000)
    # A budget that can pay pays for about one probe per `cost / (budget / 61)`
    # requests of the class (probe_every permitting), and no more; cheaper n-gram
    # probes, due as often, are paid from the same budget.
    policy = _policy(in_flight=60, tokens=tokens, probe_budget=0.05, probe_burst=4.0)
    probed = _probes(policy, 2000)
    ngram_cost = policy.exploration.probe_cost(
        Context(MODEL, "code", BUCKET),
        OFF,
        NGRAM2,
        policy.planner.plans[(MODEL, BUCKET)],
        {OFF: 60},
    )
    earned = 2000 * 0.05 / 61 + 0.05 * 4.0
    spent = probed.count(EAGLE1) * cost + probed.count(NGRAM2) * ngram_cost
    assert probed.count(EAGLE1) >= 5
    assert spent <= earned


def test_probes_of_one_proposer_share_its_drafting() -> None:
    # 30 sequences off, below the knee: a step takes 20 ms plus drafting (EAGLE-3:
    # 2 ms per draft position); an EAGLE-3 probe emits 1.5 tokens a step.
    tokens = {("code", EAGLE1): 1.5, ("code", NGRAM2): 1.02}
    policy = _policy(in_flight=30, tokens=tokens)
    context = Context(MODEL, "code", BUCKET)
    plan = policy.planner.plans[(MODEL, BUCKET)]
    # Alone it pays all its drafting: 31.5 tokens in 22 ms against 31 in 20 ms.
    alone = policy.exploration.probe_cost(context, OFF, EAGLE1, plan, {OFF: 30.0})
    assert alone == pytest.approx(1 - (31.5 / 0.022) / (31 / 0.020))
    # Beside one other EAGLE-3 sequence it pays half of it (23 ms), not nothing (22 ms).
    shared = policy.exploration.probe_cost(context, OFF, EAGLE1, plan, {OFF: 30.0, EAGLE1: 1.0})
    assert shared == pytest.approx(1 - (33 / 0.023) / (32.5 / 0.022))
    free_ride = 1 - (33 / 0.022) / (32.5 / 0.022)
    assert free_ride < shared < alone


def test_probe_credits_round_trip_through_state() -> None:
    policy = _policy(
        in_flight=20,
        tokens={("code", NGRAM2): 2.6, ("code", EAGLE1): 1.05},
        probe_budget=0.0,
    )
    assert _probes(policy, 40) == [NGRAM2]
    state = json.loads(json.dumps(policy.state_dict()))
    restored = SpecPilotPolicy(policy.arms, clock=_Clock(), rng=np.random.default_rng(0))
    restored.load_state_dict(state)
    assert restored.exploration.credits == pytest.approx(policy.exploration.credits)
    assert restored.exploration.credits[(Context(MODEL, "code", BUCKET), NGRAM2)] > 0.5


def _saturated_drift(budget: float) -> tuple[SpecPilotPolicy, list[int | None]]:
    # At 64 streams, twice the knee, nothing speculates; code's n-gram (α 0.9, cheap
    # to draft) is idle when it collapses mid-phase.
    scn = scenario(
        duration_s=900,
        model={"step_ms": 20, "knee_tokens": 32},
        phases=[{"at_s": 0, "concurrency": 2}, {"at_s": 200, "concurrency": 64}],
        drift=[{"at_s": 500, "class": "code", "proposer": "ngram", "acceptance": 0.3}],
    )
    policy, result = run_specpilot(scn, config=BanditConfig(probe_budget=budget))
    late = [a for a in result.admissions if a.at_s >= 450 and not a.explored]
    assert late and all(a.arm == OFF for a in late)
    report = drift_report(scn, result, policy.change_events)
    assert report.false_alarms == 0
    # Reported apart: the drifting proposer did not serve its class (off did).
    assert report.delays == [] and [d["serving_arm"] for d in report.idle] == ["off"]
    assert policy.explore_fraction <= 0.1
    return policy, [d["delay_requests"] for d in report.idle]


def test_a_probe_budget_buys_detection_of_an_idle_proposers_drift() -> None:
    # Past the knee an n-gram probe costs its batch about 1 % while it runs: with no
    # budget it waits, with 5 % of goodput to spend it runs every 25 code requests and
    # the collapse shows within 200 of them.
    _, delays = _saturated_drift(0.05)
    assert delays[0] is not None and delays[0] <= 200
    _, unpaid = _saturated_drift(0.0)
    assert unpaid[0] is None or unpaid[0] > delays[0]


def test_at_a_pinned_knee_a_probe_must_surely_pay_for_itself() -> None:
    """A batch of 62 off, the knee somewhere between 56 and 72 (its grid cell): an
    n-gram probe verifies past 64 in half the draws. On average it pays for itself;
    if the knee lies low in the cell it costs the batch. While the knee estimate may
    still rise (a probe past it is evidence) the mean prices it; once the data pins
    the knee to its cell, no probe settles where in the cell it lies, and a probe
    with no budget runs only if it pays in all but ``guard_quantile`` of the draws."""
    tokens = {("code", NGRAM2): 2.6, ("code", EAGLE1): 1.05}
    draws = [
        CostParams(step_s=0.02, knee_tokens=k, draft_cost={"eagle3": 0.1, "ngram": 0.005})
        for k in np.linspace(56, 72, 16)
    ]
    costs = []
    probed = []
    for pinned in (False, True):
        policy = _policy(in_flight=62, tokens=tokens, probe_budget=0.0)
        plan = policy.planner.plans[(MODEL, BUCKET)]
        plan.worlds = CostDraws.stack(draws)
        plan.knee_pinned = pinned
        policy.exploration.price_probes(MODEL, plan, {"code": OFF})
        costs.append(plan.probe_costs[("code", "ngram")])
        probed.append(_probes(policy, 100))
    mean, sure = costs
    assert mean < 0.0 < sure
    assert probed == [[NGRAM2] * 4, []]
