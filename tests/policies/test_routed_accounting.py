"""The batch the bandit believes it saw, where a router of its own serves the requests
(routing mode): the gateway reports what it routed and what finished in batches, a loop
interval later. A request counts in flight from when it was routed to when it
finished, not to when its observation arrived; one the gateway failed over leaves the
batch it was counted in."""

from __future__ import annotations

import numpy as np

from collectors.observations import RequestObservation
from policies.arms import OFF, Arm, ConcurrencyBuckets, Context
from policies.bandit import BanditConfig, SpecPilotPolicy

NGRAM = Arm("ngram", 2)
BUSY = Context("m", "code", "4-15")


def finished(arm: Arm, at: float, *, routed: Arm | None = None) -> RequestObservation:
    return RequestObservation(
        model="m", prompt_tokens=20, output_tokens=20, ttft_s=0.005, mean_itl_s=0.005,
        generation_time_s=0.095, spec=None, workload_class="code", arm=str(arm),
        routed_arm=str(routed if routed is not None else arm), concurrency=4,
        finished_at=at, e2e_s=0.1,
    )  # fmt: skip


def policy(clock: list[float]) -> SpecPilotPolicy:
    config = BanditConfig(buckets=ConcurrencyBuckets((1, 4, 16)), topology="per_arm")
    return SpecPilotPolicy([NGRAM], clock=lambda: clock[0], rng=np.random.default_rng(1),
                           config=config)  # fmt: skip


def test_requests_reported_a_second_late_count_in_flight_only_until_they_finished() -> None:
    """Four streams, each request 0.1 s long, reported at the end of each second (as
    the loop takes in a gateway's batches): the bucket runs at four in flight. Held in
    flight until the report arrived, forty requests a second read as up to forty."""
    clock = [100.0]
    bandit = policy(clock)
    for _ in range(10):
        start = clock[0]
        served, done = [], []
        for step in range(10):
            for stream in range(4):
                at = start + 0.1 * step + 0.001 * stream
                served.append(at)
                done.append(finished(OFF, at + 0.0995))
        clock[0] = start + 1.0
        for at in served:  # the loop counts what was routed first, then what came back
            bandit.served(BUSY, OFF, False, at)
        for observation in sorted(done, key=lambda o: o.finished_at or 0.0):
            bandit.observe(observation)
    estimate = bandit.learning.bucket_concurrency[("m", "4-15")]
    assert 3.5 <= estimate <= 5.0, estimate
    assert bandit.learning.in_flight("m") == 0


def test_a_failed_over_request_leaves_the_batch_it_was_routed_to() -> None:
    clock = [100.0]
    bandit = policy(clock)
    for _ in range(20):
        bandit.served(BUSY, NGRAM, False, clock[0])
        clock[0] += 1.0
        # n-gram's pool had no instance up: the gateway served it on the off pool.
        bandit.observe(finished(OFF, clock[0] - 0.5, routed=NGRAM))
    assert bandit.learning.in_flight("m") == 0
