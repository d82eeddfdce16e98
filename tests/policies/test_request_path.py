"""The request path (``select``) reads routes and counts; it never plans and never
re-publishes a bucket's routes. A plan takes milliseconds: a bucket's first request
and a knee trial's last one would otherwise carry one."""

from __future__ import annotations

from typing import Any

import numpy as np
from policy_sim import run_specpilot, scenario

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm, Context
from policies.bandit import BanditConfig, SpecPilotPolicy
from policies.bandit.exploration import _Trial

MODEL = "sim-model"


def _count_plans(policy: SpecPilotPolicy) -> list[tuple[str, str]]:
    """Every bucket the planner plans from now on, in order."""
    planned: list[tuple[str, str]] = []
    plan = policy.planner.plan

    def counting(model: str, bucket: str, *args: Any) -> None:
        planned.append((model, bucket))
        plan(model, bucket, *args)

    policy.planner.plan = counting  # type: ignore[method-assign]
    return planned


def _learned() -> SpecPilotPolicy:
    """A policy that ran two minutes of two streams: buckets 1 and 2-3 planned."""
    policy, _ = run_specpilot(scenario(duration_s=120, phases=[{"at_s": 0, "concurrency": 2}]))
    assert policy.learning.cost[MODEL].ready
    return policy


def _finished(context: Context, at: float) -> RequestObservation:
    return RequestObservation(
        model=context.model,
        prompt_tokens=None,
        output_tokens=10,
        ttft_s=0.1,
        mean_itl_s=0.02,
        generation_time_s=0.2,
        spec=None,
        workload_class=context.workload_class,
        arm=str(OFF),
        concurrency=40,
        finished_at=at,
    )


def test_a_new_buckets_first_requests_go_unplanned_until_the_next_observation() -> None:
    policy = _learned()
    rush = Context(MODEL, "code", "32+")
    assert (MODEL, "32+") not in policy.planner.plans
    planned = _count_plans(policy)
    decisions = [policy.choose(rush) for _ in range(5)]
    assert planned == []
    # No commitment in the bucket yet: off, as for any context without evidence.
    assert {(d.arm, d.reason) for d in decisions} == {(OFF, "learning")}
    policy.observe(_finished(rush, policy.clock()))
    assert (MODEL, "32+") in planned
    # Off the request path, a router of its own asking for a new bucket's route has
    # the bucket planned first.
    planned.clear()
    assert policy.route(Context(MODEL, "code", "16-31")).reason != "learning"
    assert planned == [(MODEL, "16-31")]
    assert Context(MODEL, "code", "32+") in policy.commitment.commitments
    assert policy.routes()[rush].arm == policy.decide(rush).arm


def test_a_knee_trial_ending_on_the_request_path_is_published_off_it() -> None:
    policy = _learned()
    context = Context(MODEL, "code", "2-3")
    committed = policy.decide(context).arm
    bolder = next(arm for arm in policy.arms if arm != committed and arm != OFF)
    policy.exploration.trials[(MODEL, "2-3")] = _Trial({"code": bolder}, remaining=2)
    policy._publish(MODEL, "2-3")  # as a plan that starts a trial does
    planned = _count_plans(policy)
    published: list[tuple[str, str]] = []
    publish = policy._publish

    def counting(model: str, bucket: str) -> None:
        published.append((model, bucket))
        publish(model, bucket)

    policy._publish = counting  # type: ignore[method-assign]
    served = [policy.choose(context) for _ in range(4)]
    assert [(d.arm, d.explored) for d in served[:2]] == [(bolder, True)] * 2
    # The trial is over: its bucket serves the committed arm (no exploration) until
    # the routes are re-published.
    assert {(d.arm, d.explored) for d in served[2:]} == {(committed, False)}
    assert planned == [] and published == []
    routes = policy.routes()
    assert published == [(MODEL, "2-3")]
    assert all(why != "trial" for _, _, why in routes[context].explore)


def test_a_class_without_a_plan_speculates_with_the_model_free_proposer_only_in_small_batches() -> (
    None
):
    """``cold_proposer`` at its smallest γ where the bucket's whole batch verifies at most
    ``cold_max_positions`` a step (1 to 15 streams at γ = 2), off elsewhere and without
    one."""
    arms = scenario(duration_s=10).arms

    def policy(config: BanditConfig | None = None) -> SpecPilotPolicy:
        return SpecPilotPolicy(arms, clock=lambda: 0.0, rng=np.random.default_rng(0), config=config)

    cold = policy(BanditConfig(cold_proposer="ngram"))
    smallest = min(arm.gamma for arm in arms if arm.proposer == "ngram")
    assert cold.choose(Context(MODEL, "code", "1")).arm == Arm("ngram", smallest)
    assert cold.choose(Context(MODEL, "code", "2-3")).arm == Arm("ngram", smallest)
    assert cold.choose(Context(MODEL, "code", "4-7")).arm == Arm("ngram", smallest)
    assert cold.choose(Context(MODEL, "code", "8-15")).arm == Arm("ngram", smallest)
    assert cold.choose(Context(MODEL, "code", "16-31")).arm == OFF
    assert cold.choose(Context(MODEL, "code", "32+")).arm == OFF
    assert policy().choose(Context(MODEL, "code", "1")).arm == OFF


def test_a_class_whose_n_gram_requests_accepted_below_the_prior_starts_off() -> None:
    """The cold start bets on the prior's acceptance (0.5 at the first position): in a
    bucket it enters later, a class whose n-gram requests accepted less waits off for
    its bucket's plan, and one whose requests accepted more starts on n-gram."""
    arms = scenario(duration_s=10).arms
    policy = SpecPilotPolicy(
        arms,
        clock=lambda: 0.0,
        rng=np.random.default_rng(0),
        config=BanditConfig(cold_proposer="ngram"),
    )
    smallest = min(arm.gamma for arm in arms if arm.proposer == "ngram")
    for cls, accepted in (("prose", 0.1), ("json", 0.9)):
        policy.learning.acceptance_model((MODEL, cls, "ngram")).update(
            [100 * accepted, 100 * accepted**2], 100, 0.0
        )
    assert policy.choose(Context(MODEL, "prose", "4-7")).arm == OFF
    assert policy.choose(Context(MODEL, "json", "4-7")).arm == Arm("ngram", smallest)
    assert policy.choose(Context(MODEL, "code", "4-7")).arm == Arm("ngram", smallest)


def test_a_class_that_finishes_its_first_request_has_its_bucket_planned_at_once() -> None:
    """A plan gives a class its probes; one made before the class finished a request
    left it out, and the class would wait off for the next refresh (its long requests
    finish last). Its first finished request re-plans the bucket, the next does not."""
    policy = _learned()
    newcomer = Context(MODEL, "rare", "2-3")
    assert "rare" not in policy.planner.plans[(MODEL, "2-3")].thompson
    planned = _count_plans(policy)
    policy.choose(newcomer)
    policy.observe(_finished(newcomer, policy.clock()))
    assert planned == [(MODEL, "2-3")]
    assert "rare" in policy.planner.plans[(MODEL, "2-3")].thompson
    policy.choose(newcomer)
    policy.observe(_finished(newcomer, policy.clock()))
    assert planned == [(MODEL, "2-3")]
