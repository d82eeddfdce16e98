from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.speedup import (
    conditional_acceptance,
    counterfactual_expected_tokens,
    expected_tokens,
    expected_tokens_from_conditionals,
    speedup,
)


def test_expected_tokens_matches_the_series() -> None:
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.7, 0) == 1.0


@given(st.integers(min_value=0, max_value=16))
def test_alpha_one_limit_is_gamma_plus_one(gamma: int) -> None:
    assert expected_tokens(1.0, gamma) == gamma + 1
    assert expected_tokens(1.0 - 1e-12, gamma) == pytest.approx(gamma + 1)
    assert expected_tokens(0.999999, gamma) == pytest.approx(gamma + 1, rel=1e-4)


def test_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        expected_tokens(1.2, 3)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)
    with pytest.raises(ValueError):
        speedup(2.0, 0.0, 0.0)


def test_speedup_published_shape() -> None:
    # EAGLE-style head: α = 0.81, γ = 4, draft 5 % of a step per token, free verify.
    s = speedup(expected_tokens(0.81, 4), draft=4 * 0.05, verify=1.0)
    assert 2.7 < s < 3.0
    # Low acceptance with an expensive draft loses.
    assert speedup(expected_tokens(0.3, 5), draft=5 * 0.12, verify=1.0) < 1.0


def test_counterfactual_reproduces_every_shorter_gamma() -> None:
    rng = np.random.default_rng(0)
    gamma = 6
    accepted_lengths = rng.integers(0, gamma + 1, size=500)
    per_position = [int((accepted_lengths > i).sum()) for i in range(gamma)]
    expected = counterfactual_expected_tokens(per_position, len(accepted_lengths))
    for shorter in range(gamma + 1):
        truth = float(np.mean(1 + np.minimum(accepted_lengths, shorter)))
        assert expected[shorter] == pytest.approx(truth)


def test_counterfactual_matches_closed_form_in_expectation() -> None:
    rng = np.random.default_rng(1)
    alpha, gamma, steps = 0.7, 5, 200_000
    accepted = (rng.random((steps, gamma)) < alpha).cumprod(axis=1).sum(axis=1)
    per_position = [int((accepted > i).sum()) for i in range(gamma)]
    expected = counterfactual_expected_tokens(per_position, steps)
    for shorter in range(gamma + 1):
        assert expected[shorter] == pytest.approx(expected_tokens(alpha, shorter), rel=0.01)


def test_counterfactual_rejects_non_prefix_counts() -> None:
    with pytest.raises(ValueError):
        counterfactual_expected_tokens([5, 7], 10)
    with pytest.raises(ValueError):
        counterfactual_expected_tokens([11], 10)


def test_conditionals_chain_back_to_expected_tokens() -> None:
    pairs = conditional_acceptance([80, 60, 30], 100)
    assert pairs == ((80, 100), (60, 80), (30, 60))
    rates = [s / t for s, t in pairs]
    assert expected_tokens_from_conditionals(rates) == pytest.approx(1 + 0.8 + 0.6 + 0.3)
    assert math.isclose(expected_tokens_from_conditionals([0.6] * 4), expected_tokens(0.6, 4))
