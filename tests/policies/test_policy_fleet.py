from __future__ import annotations

import itertools

import numpy as np
import pytest

from policies.arms import OFF, Arm, ConcurrencyBuckets, Context
from policies.baselines import UCB1, BatchSizeTable, EpsilonGreedy, OraclePolicy, Truth
from policies.fleet import (
    CostParams,
    best_assignment,
    split_streams,
    steady_goodput,
    steady_state,
)
from policies.speedup import expected_tokens

COST = CostParams(step_s=0.02, knee_tokens=48, draft_cost={"eagle3": 0.04, "ngram": 0.005})
ARMS = (OFF, Arm("eagle3", 1), Arm("eagle3", 3), Arm("eagle3", 6), Arm("ngram", 2), Arm("ngram", 5))
ALPHA = {
    ("code", "eagle3"): 0.6,
    ("code", "ngram"): 0.9,
    ("chat", "eagle3"): 0.8,
    ("chat", "ngram"): 0.1,
    ("prose", "eagle3"): 0.4,
    ("prose", "ngram"): 0.02,
}
SHARES = {"code": 100.0, "chat": 150.0, "prose": 60.0}


def tokens(cls: str, arm: Arm) -> float:
    if arm.proposer is None:
        return 1.0
    return expected_tokens(ALPHA[(cls, arm.proposer)], arm.gamma)


def test_step_time_memory_then_compute_bound() -> None:
    assert COST.step_time(10, {}) == pytest.approx(0.02)
    assert COST.step_time(96, {}) == pytest.approx(0.04)
    assert COST.batch_step_time([Arm("eagle3", 3), OFF]) == pytest.approx(0.02 + 0.04 * 0.02 * 3)


def test_all_off_goodput_is_streams_over_step_time() -> None:
    goodput, steps = steady_state(8, SHARES, tokens, {}, COST)
    assert steps == pytest.approx(dict.fromkeys(SHARES, 0.02))
    assert goodput == pytest.approx(8 / 0.02)


@pytest.mark.parametrize("concurrency", [1, 4, 16, 48, 96])
def test_coordinate_ascent_finds_the_exhaustive_optimum(concurrency: int) -> None:
    classes = sorted(SHARES)
    best_value = max(
        steady_goodput(concurrency, SHARES, tokens, dict(zip(classes, combo, strict=True)), COST)
        for combo in itertools.product(ARMS, repeat=len(classes))
    )
    found = best_assignment(concurrency, SHARES, tokens, ARMS, COST)
    assert steady_goodput(concurrency, SHARES, tokens, found, COST) >= 0.99 * best_value


def test_best_assignment_follows_load_and_class() -> None:
    quiet = best_assignment(1, SHARES, tokens, ARMS, COST)
    assert quiet["code"].proposer == "ngram" and quiet["chat"].proposer == "eagle3"
    busy = best_assignment(200, SHARES, tokens, ARMS, COST)
    assert all(arm == OFF for arm in busy.values())


def test_oracle_serves_the_best_assignment() -> None:
    truth = Truth(("p", 0), 2, SHARES, tokens, COST)
    oracle = OraclePolicy(ARMS, lambda: truth)
    assert (
        oracle.select(Context("m", "chat", "2-3"))
        == best_assignment(2, SHARES, tokens, ARMS, COST)["chat"]
    )


def test_batch_size_table_tapers_to_off() -> None:
    buckets = ConcurrencyBuckets()
    table = BatchSizeTable.tapering("eagle3", [1, 2, 4, 6], buckets.labels)
    gammas = [table.select(Context("m", "c", b)).gamma for b in buckets.labels]
    assert gammas[0] == 6 and gammas == sorted(gammas, reverse=True)
    assert gammas[-1] == 0 and gammas[-2] == 0


def test_ucb1_tries_every_arm_then_exploits() -> None:
    from collectors.observations import RequestObservation

    buckets = ConcurrencyBuckets()
    policy = UCB1(ARMS, buckets.bucket)
    context = Context("m", "code", "1")
    seen = []
    for _ in range(len(ARMS)):
        arm = policy.select(context)
        seen.append(arm)
        speed = 100.0 if arm == Arm("ngram", 5) else 50.0
        policy.observe(
            RequestObservation(
                "m", 1, 100, 0.01, None, 100 / speed, None, "code", None, str(arm), 1
            )
        )
    assert set(seen) == set(ARMS)
    assert policy.best_guess(context) == Arm("ngram", 5)


def test_epsilon_greedy_explores_about_epsilon() -> None:
    buckets = ConcurrencyBuckets()
    policy = EpsilonGreedy(ARMS, buckets.bucket, np.random.default_rng(0), epsilon=0.2)
    context = Context("m", "code", "1")
    picks = [policy.select(context) for _ in range(2000)]
    # Greedy with no data is off; random picks land on off 1/len(ARMS) of the time.
    not_off = sum(arm != OFF for arm in picks) / len(picks)
    assert not_off == pytest.approx(0.2 * (1 - 1 / len(ARMS)), abs=0.03)


# -- one engine per arm (routing mode) -------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 6, 40, 300])
def test_per_arm_split_satisfies_its_equations(concurrency: int) -> None:
    """Streams per engine n_e = λ W_e step_e sum to the concurrency, and every engine's
    step is what its own n_e streams cost."""
    slots = np.array([[100.0, 40.0, 5.0]])
    per_stream = np.array([[1.0, 4.0, 6.0]])
    drafting = np.array([[0.0, 0.002, 0.004]])
    step_s, knee = np.array([[0.02]]), np.array([[48.0]])
    lam, steps = split_streams(concurrency, slots, slots * per_stream, drafting, step_s, knee)
    held = lam[:, None] * slots * steps
    assert held.sum() == pytest.approx(concurrency, rel=1e-9)
    expected = 0.02 * np.maximum(1.0, held * per_stream / 48.0) + np.maximum(drafting, 2e-11)
    assert steps == pytest.approx(expected, rel=1e-9)


def test_per_arm_with_one_arm_in_use_is_the_shared_batch() -> None:
    everyone = dict.fromkeys(SHARES, Arm("eagle3", 3))
    for concurrency in (1, 30, 200):
        shared = steady_state(concurrency, SHARES, tokens, everyone, COST)
        split = steady_state(concurrency, SHARES, tokens, everyone, COST, "per_arm")
        assert split[0] == pytest.approx(shared[0])
        assert split[1] == pytest.approx(shared[1])


def test_per_arm_engines_do_not_pay_for_each_other() -> None:
    """Off and n-gram in separate pools: the off pool's steps carry no drafting, and at
    high load the separate pools beat one batch that must draft for everyone."""
    assignment = {"code": Arm("ngram", 5), "chat": OFF, "prose": OFF}
    _, shared_steps = steady_state(4, SHARES, tokens, assignment, COST)
    _, split_steps = steady_state(4, SHARES, tokens, assignment, COST, "per_arm")
    assert split_steps["chat"] == pytest.approx(0.02)
    assert shared_steps["chat"] > split_steps["chat"]
    assert steady_goodput(200, SHARES, tokens, assignment, COST, "per_arm") > steady_goodput(
        200, SHARES, tokens, assignment, COST
    )


@pytest.mark.parametrize("concurrency", [1, 4, 16, 48, 96])
def test_per_arm_coordinate_ascent_finds_the_exhaustive_optimum(concurrency: int) -> None:
    classes = sorted(SHARES)
    best_value = max(
        steady_goodput(
            concurrency, SHARES, tokens, dict(zip(classes, combo, strict=True)), COST, "per_arm"
        )
        for combo in itertools.product(ARMS, repeat=len(classes))
    )
    found = best_assignment(concurrency, SHARES, tokens, ARMS, COST, topology="per_arm")
    assert steady_goodput(concurrency, SHARES, tokens, found, COST, "per_arm") >= 0.99 * best_value
