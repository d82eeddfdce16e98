from __future__ import annotations

import itertools

import numpy as np
import pytest

from policies.arms import OFF, Arm, ConcurrencyBuckets, Context
from policies.baselines import UCB1, BatchSizeTable, EpsilonGreedy, OraclePolicy, Truth
from policies.fleet import CostParams, best_assignment, steady_goodput, steady_state
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
    goodput, step = steady_state(8, SHARES, tokens, {}, COST)
    assert step == pytest.approx(0.02)
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
