from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from policies.arms import OFF, Arm
from policies.estimators import AcceptanceModel, BatchTracker, ChangeDetector, StepCostModel
from policies.fleet import CostParams
from policies.speedup import expected_tokens


def _per_position(rng: np.random.Generator, alpha: float, gamma: int, steps: int) -> list[int]:
    accepted = (rng.random((steps, gamma)) < alpha).cumprod(axis=1).sum(axis=1)
    return [int((accepted > i).sum()) for i in range(gamma)]


def test_one_run_at_long_gamma_teaches_every_shorter_gamma() -> None:
    rng = np.random.default_rng(0)
    model = AcceptanceModel(8, trials_per_request=1e9)
    for t in range(30):
        model.update(_per_position(rng, 0.7, 8, 200), 200, float(t))
    expected = AcceptanceModel.expected_tokens(model.mean_conditionals())
    for gamma in (1, 3, 8):
        assert expected[gamma] == pytest.approx(expected_tokens(0.7, gamma), rel=0.03)


def test_untried_deep_positions_borrow_from_shallower_ones() -> None:
    rng = np.random.default_rng(1)
    model = AcceptanceModel(6, trials_per_request=1e9)
    for t in range(30):
        model.update(_per_position(rng, 0.8, 2, 200), 200, float(t))
    conditionals = model.mean_conditionals()
    assert conditionals[5] == pytest.approx(0.8, abs=0.05)
    samples = model.sample_conditionals(np.random.default_rng(2), 500)
    assert samples[:, 0].std() < samples[:, 5].std()  # less evidence, wider posterior


def test_discounting_forgets_old_evidence() -> None:
    model = AcceptanceModel(1, half_life_s=10.0, trials_per_request=1e9)
    model.update([90], 100, 0.0)
    model.update([10], 100, 100.0)  # ten half-lives later
    assert model.mean_conditionals()[0] < 0.15


def test_change_detector_fires_on_a_shift_not_on_noise() -> None:
    rng = np.random.default_rng(3)
    detector = ChangeDetector()
    assert not any(detector.update(float(x)) for x in rng.normal(0.8, 0.1, 20_000))
    fired_after = next(
        i for i, x in enumerate(rng.normal(0.45, 0.1, 50)) if detector.update(float(x))
    )
    assert fired_after < 10


def test_change_detector_catches_a_one_sigma_shift_within_a_few_dozen_requests() -> None:
    # Per-request acceptance varies between requests (a Beta around the class mean),
    # so a real drift can be as small as one standard deviation.
    rng = np.random.default_rng(5)
    detector = ChangeDetector()
    quiet = rng.beta(0.26 * 20, 0.74 * 20, 20_000)
    assert not any(detector.update(float(x)) for x in quiet)
    shifted = rng.beta(0.37 * 20, 0.63 * 20, 200)
    fired_after = next(i for i, x in enumerate(shifted) if detector.update(float(x)))
    assert fired_after < 80


def test_change_detector_judges_a_big_shift_from_a_handful_of_probes() -> None:
    # A proposer a class does not use is only seen through sparse probes: a few
    # requests make the baseline, and a collapse must show within a few more, while
    # the same handful of ordinary requests must not look like a shift.
    rng = np.random.default_rng(6)
    for _ in range(200):
        detector = ChangeDetector()
        assert not any(detector.update(float(x)) for x in rng.beta(13, 7, 60))
    detector = ChangeDetector()
    for x in rng.beta(13, 7, 5):
        assert not detector.update(float(x))
    fired_after = next(i for i, x in enumerate(rng.beta(1, 15, 20)) if detector.update(float(x)))
    assert fired_after < 6


def test_change_detector_judges_a_collapse_from_three_or_four_probes() -> None:
    # Probes of an idle proposer are rare, so every one counts: a collapse of four or
    # more standard deviations fires the gross CUSUM after a median of three or four
    # of them, while long quiet streams (per-request α ~ Beta around the mean, binomial
    # over the drafts) never do, however skewed near 0 or 1.
    rng = np.random.default_rng(7)

    def requests(alpha: float, n: int) -> npt.NDArray[np.float64]:
        drafts = int(rng.integers(20, 300))
        values: npt.NDArray[np.float64] = (
            rng.binomial(drafts, rng.beta(20 * alpha, 20 * (1 - alpha), n)) / drafts
        )
        return values

    for alpha in (0.02, 0.05, 0.2, 0.45, 0.7, 0.88, 0.95, 0.98):
        for _ in range(4):
            detector = ChangeDetector()
            assert not any(detector.update(float(x)) for x in requests(alpha, 3000))
    for before, after in ((0.88, 0.40), (0.74, 0.25), (0.66, 0.06)):
        fired, without_gross = [], []
        for _ in range(20):
            detector = ChangeDetector()
            coarse_and_fine = ChangeDetector(gross_threshold=float("inf"))
            for x in requests(before, 30):
                assert not detector.update(float(x))
                assert not coarse_and_fine.update(float(x))
            shifted = requests(after, 20)
            fired.append(next(i + 1 for i, x in enumerate(shifted) if detector.update(float(x))))
            without_gross.append(
                next(i + 1 for i, x in enumerate(shifted) if coarse_and_fine.update(float(x)))
            )
        assert sorted(fired)[len(fired) // 2] <= 4
        assert max(fired) <= 6
        assert all(a <= b for a, b in zip(fired, without_gross, strict=True))
        assert sum(fired) < sum(without_gross)


def test_step_cost_model_recovers_the_engine() -> None:
    truth = CostParams(step_s=0.03, knee_tokens=64, draft_cost={"eagle3": 0.05, "ngram": 0.01})
    model = StepCostModel(["eagle3", "ngram"])
    tracker = BatchTracker(model)
    rng = np.random.default_rng(4)
    arms = [OFF, Arm("eagle3", 1), Arm("eagle3", 4), Arm("ngram", 3)]
    for t in range(400):
        batch = [arms[i] for i in rng.integers(0, len(arms), size=int(rng.integers(1, 60)))]
        verify = sum(a.verify_tokens for a in batch)
        depth: dict[str, int] = {}
        for arm in batch:
            if arm.proposer:
                depth[arm.proposer] = max(depth.get(arm.proposer, 0), arm.gamma)
        model.update(model.features(verify, depth), truth.batch_step_time(batch), float(t))
    fitted = model.mean_params()
    assert fitted.step_s == pytest.approx(0.03, rel=0.02)
    assert fitted.knee_tokens == pytest.approx(64, rel=0.15)
    assert fitted.draft_cost["eagle3"] == pytest.approx(0.05, abs=0.01)
    assert tracker.in_flight == 0


def test_batch_tracker_averages_over_a_requests_life() -> None:
    model = StepCostModel(["eagle3"])
    tracker = BatchTracker(model)
    tracker.add(OFF, 0.0)
    tracker.add(Arm("eagle3", 4), 5.0)  # present for the second half only
    tracker.remove(Arm("eagle3", 4), 10.0)
    rows = tracker.mean_rows(0.0, 10.0)
    assert rows is not None
    assert rows[0, 1] == pytest.approx(2.0)  # depth 4 for half the time
    assert tracker.mean_rows(-5.0, 10.0) is None
