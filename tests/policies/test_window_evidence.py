"""The policy learns the same from a worker's windows as from the requests they sum,
and, where a move is a push, keeps the running arm until evidence says otherwise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from collectors.observations import RequestObservation, SpecDecodeRequestStats, WindowObservation
from policies.arms import OFF, Arm, ConcurrencyBuckets, Context
from policies.bandit import BanditConfig, SpecPilotPolicy

MODEL, CLASS = "m", "code"
NGRAM4 = Arm("ngram", 4)
CONDITIONALS = (0.8, 0.7, 0.6, 0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def requests(
    rng: np.random.Generator, count: int, conditionals: tuple[float, ...], step_s: float = 0.02
) -> list[RequestObservation]:
    """Requests of γ = 4 whose every decode step drafts, with prefix acceptance."""
    out = []
    for _ in range(count):
        steps = int(rng.integers(8, 16))
        per_position = [0] * len(conditionals)
        emitted = 1  # the prefill's token
        for _ in range(steps):
            accepted = 0
            while accepted < len(conditionals) and rng.random() < conditionals[accepted]:
                per_position[accepted] += 1
                accepted += 1
            emitted += 1 + accepted
        accepted_total = sum(per_position)
        out.append(
            RequestObservation(
                model=MODEL,
                prompt_tokens=32,
                output_tokens=emitted,
                ttft_s=0.05,
                mean_itl_s=None,
                generation_time_s=steps * step_s,
                spec=SpecDecodeRequestStats(
                    num_drafts=steps,
                    num_draft_tokens=4 * steps,
                    num_accepted_tokens=accepted_total,
                    accepted_per_position=tuple(per_position),
                ),
                workload_class=CLASS,
                arm=str(NGRAM4),
                concurrency=1,
            )
        )
    return out


def as_window(
    batch: list[RequestObservation], at: float, step_s: float = 0.02
) -> WindowObservation:
    """What the worker's counters say over the window these requests finished in."""
    specs = [r.spec for r in batch if r.spec is not None]
    return WindowObservation(
        model=MODEL,
        started_at=at - 15.0,
        finished_at=at,
        duration_s=15.0,
        requests=float(len(batch)),
        generation_tokens=float(sum(r.output_tokens or 0 for r in batch)),
        drafts=float(sum(s.num_drafts or 0 for s in specs)),
        draft_tokens=float(sum(s.num_draft_tokens or 0 for s in specs)),
        accepted_per_position=tuple(
            float(sum(s.accepted_per_position[i] for s in specs if s.accepted_per_position))
            for i in range(4)
        ),
        step_s=step_s,
        tpot_s=None,
        running=1.0,
        workload_class=CLASS,
        pool="code",
        instance="http://w:8000",
        arm=str(NGRAM4),
    )


def off_window(at: float) -> WindowObservation:
    """A window of the pool once it runs off: plain steps, no spec-decode series."""
    return WindowObservation(
        model=MODEL,
        started_at=at - 15,
        finished_at=at,
        duration_s=15.0,
        requests=20.0,
        generation_tokens=600.0,
        drafts=0.0,
        draft_tokens=0.0,
        accepted_per_position=(),
        step_s=0.02,
        tpot_s=0.02,
        running=1.0,
        workload_class=CLASS,
        arm="off",
    )


def policy(clock: Clock, **config: object) -> SpecPilotPolicy:
    return SpecPilotPolicy(
        [Arm("ngram", g) for g in range(1, 5)],
        clock=clock,
        rng=np.random.default_rng(0),
        config=BanditConfig(buckets=ConcurrencyBuckets((1, 2, 4, 8, 16, 32)), **config),  # type: ignore[arg-type]
    )


def test_windows_and_their_requests_give_estimates_that_agree() -> None:
    rng = np.random.default_rng(7)
    traffic = requests(rng, 300, CONDITIONALS)
    clock = Clock()
    per_request, per_window = policy(clock), policy(clock)
    for index in range(0, len(traffic), 20):
        batch = traffic[index : index + 20]
        clock.now += 15.0
        for observation in batch:
            per_request.observe(observation)
        per_window.observe_window(as_window(batch, clock.now))
    a = per_request.learning.acceptance[(MODEL, CLASS, "ngram")]
    b = per_window.learning.acceptance[(MODEL, CLASS, "ngram")]
    assert a.requests == pytest.approx(b.requests)
    draws_a = a.sample_conditionals(np.random.default_rng(1), 4000)
    draws_b = b.sample_conditionals(np.random.default_rng(2), 4000)
    low_a, high_a = np.quantile(draws_a, [0.05, 0.95], axis=0)
    low_b, high_b = np.quantile(draws_b, [0.05, 0.95], axis=0)
    mean_a, mean_b = a.mean_conditionals(), b.mean_conditionals()
    # Each estimate lies inside the other's 90 % interval, position by position, and
    # both cover the truth.
    assert np.all((low_a <= mean_b) & (mean_b <= high_a)), (mean_a, mean_b)
    assert np.all((low_b <= mean_a) & (mean_a <= high_b)), (mean_a, mean_b)
    assert np.all((low_b <= CONDITIONALS) & (np.array(CONDITIONALS) <= high_b))
    # Token mix and concurrency: the same generated tokens, the same bucket.
    assert per_window.learning.token_shares[MODEL][CLASS] == pytest.approx(
        per_request.learning.token_shares[MODEL][CLASS]
    )
    assert per_window.learning.bucket_concurrency[(MODEL, "1")] == pytest.approx(1.0)


def test_a_pushed_arm_stands_without_evidence_and_moves_on_its_collapse() -> None:
    clock = Clock()
    push = policy(clock, moves_need_evidence=True, draft_cost_prior=0.05, dwell_s=0.0)
    context = Context(MODEL, CLASS, "1")
    # No evidence at all: the running arm is committed, not off.
    decision = push.decide(context, running=NGRAM4)
    assert decision.arm == NGRAM4 and decision.reason == "incumbent"
    rng = np.random.default_rng(3)
    for _ in range(10):
        clock.now += 15.0
        push.observe_window(as_window(requests(rng, 20, CONDITIONALS), clock.now))
        assert push.decide(context, running=NGRAM4).arm.proposer == "ngram"
    healthy = push.decide(context, running=NGRAM4)
    assert healthy.predicted_speedup is not None and healthy.predicted_speedup > 1.5, healthy
    # Acceptance collapses (text with nothing to copy): off, on the running arm's evidence.
    collapsed = (0.02, 0.02, 0.02, 0.02)
    arms = []
    for _ in range(12):
        clock.now += 15.0
        push.observe_window(as_window(requests(rng, 20, collapsed), clock.now))
        arms.append(push.decide(context, running=NGRAM4).arm)
    assert arms[-1] == OFF, arms
    assert push.change_events, "the drift was not detected"


def test_an_off_pool_does_not_start_speculating_on_priors() -> None:
    clock = Clock()
    push = policy(clock, moves_need_evidence=True, draft_cost_prior=0.05)
    context = Context(MODEL, CLASS, "1")
    for _ in range(10):
        clock.now += 15.0
        window = off_window(clock.now)
        push.observe_window(window)
        assert push.decide(context, running=OFF).arm == OFF


def test_state_saved_for_other_arms_keeps_what_still_holds() -> None:
    clock = Clock()
    narrow = policy(clock)
    rng = np.random.default_rng(5)
    for _ in range(5):
        clock.now += 15.0
        narrow.observe_window(as_window(requests(rng, 20, CONDITIONALS), clock.now))
    state = narrow.state_dict()
    wider = SpecPilotPolicy(
        [Arm("ngram", g) for g in range(1, 7)] + [Arm("eagle3", 3)],
        clock=clock,
        rng=np.random.default_rng(0),
    )
    wider.load_state_dict(state)
    kept = wider.learning.acceptance[(MODEL, CLASS, "ngram")]
    before = narrow.learning.acceptance[(MODEL, CLASS, "ngram")]
    assert kept.positions == 6
    assert kept.trials[:4] == pytest.approx(before.trials)
    assert kept.trials[4:] == pytest.approx([0.0, 0.0])
    assert MODEL not in wider.learning.cost  # a cost fit over other proposers is learned again
    assert wider.learning.token_shares == narrow.learning.token_shares


def test_windows_that_draft_nothing_teach_one_token_per_step() -> None:
    """Sampled text gives n-gram no match: the worker speculates, drafts nothing, and
    each step emits one token. That is what the arm gets from this traffic, so the
    policy relearns it and turns off; but drafting nothing is no fall of acceptance
    (there was none to measure), so it reports no drift."""
    clock = Clock()
    push = policy(clock, moves_need_evidence=True, draft_cost_prior=0.05, dwell_s=0.0)
    context = Context(MODEL, CLASS, "1")
    rng = np.random.default_rng(4)
    for _ in range(10):
        clock.now += 15.0
        push.observe_window(as_window(requests(rng, 20, CONDITIONALS), clock.now))
    assert push.decide(context, running=NGRAM4).arm.proposer == "ngram"
    arms = []
    for _ in range(12):
        clock.now += 15.0
        window = as_window(requests(rng, 20, (0.0, 0.0, 0.0, 0.0)), clock.now)
        nothing = dataclasses.replace(window, drafts=0.0, draft_tokens=0.0)
        push.observe_window(nothing)
        arms.append(push.decide(context, running=NGRAM4).arm)
    assert arms[-1] == OFF, arms
    assert push.change_events == []
    # It read only the windows that drafted (0.8 at position 0), never a 0.
    drift = push.learning.drift_detectors[(MODEL, CLASS, "ngram")]
    assert drift.recent == pytest.approx(0.8, abs=0.1)
