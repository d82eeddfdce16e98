"""Routing mode: a context's committed arm carries its traffic but for the declared
exploration share. The real bandit (as routing mode builds it) publishes routes, the
gateway's own sampler (``SampledRouting``) routes requests by them, and the policy
learns from what came back, as the loop and the workers do; then, per context, the
requests routed while an arm was committed are counted."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np

from collectors.observations import RequestObservation, SpecDecodeRequestStats
from controller.contexts import Context
from controller.gateway.routing import RouteKey
from controller.gateway.table import SampledRouting
from controller.ports import Routed
from controller.wiring import BanditControlPolicy
from policies.arms import Arm, ConcurrencyBuckets
from policies.bandit import BanditConfig, SpecPilotPolicy

CAP = 0.08
CLASSES = {"code": 0.6, "chat": 0.3, "creative": 0.1}
"""Each class's share of the requests: creative is the rare one."""
ACCEPTANCE = {
    ("code", "ngram"): 0.7, ("code", "eagle"): 0.85,
    ("chat", "ngram"): 0.2, ("chat", "eagle"): 0.7,
    ("creative", "ngram"): 0.05, ("creative", "eagle"): 0.15,
}  # fmt: skip
ARMS = {"off": "pool-off", "ngram:2": "pool-ngram", "eagle:4": "pool-eagle"}
STEP_S = 0.01
REQUESTS_PER_TABLE = 25
"""Requests the workers route by one published table (a loop interval's worth)."""


def observation(cls: str, arm: str, at: float, draws: np.random.Generator) -> RequestObservation:
    """A request of ``cls`` served on ``arm``: 64 tokens, per-position acceptance drawn
    from the class's acceptance, step time of an unloaded engine."""
    tokens, spec, steps = 64, None, 64
    parsed = Arm.parse(arm)
    if parsed.proposer is not None:
        alpha = ACCEPTANCE[(cls, parsed.proposer)]
        steps = int(tokens / (1 + alpha * parsed.gamma * 0.8))
        counts = [steps]
        for _ in range(parsed.gamma):  # position k accepted only after k - 1 was
            counts.append(int(draws.binomial(counts[-1], alpha)))
        per_position = tuple(counts[1:])
        spec = SpecDecodeRequestStats(
            num_drafts=steps,
            num_draft_tokens=steps * parsed.gamma,
            num_accepted_tokens=sum(per_position),
            accepted_per_position=per_position,
        )
    step = STEP_S * (1.0 + (0.05 * parsed.gamma if parsed.proposer else 0.0))
    return RequestObservation(
        model="m", prompt_tokens=50, output_tokens=tokens, ttft_s=STEP_S, mean_itl_s=step,
        generation_time_s=step * steps, spec=spec, workload_class=cls, pool=ARMS[arm],
        arm=arm, concurrency=1, finished_at=at, e2e_s=step * steps + STEP_S,
    )  # fmt: skip


def test_a_committed_arm_carries_all_but_the_declared_exploration_share() -> None:
    now = [1000.0]
    config = BanditConfig(  # as ``wiring.bandit_config`` builds it for routing mode
        buckets=ConcurrencyBuckets((1, 4)),
        topology="per_arm",
        explore_cap=CAP,
        dwell_s=10.0,
        cold_proposer="ngram",
    )
    bandit = SpecPilotPolicy(
        [Arm("ngram", 2), Arm("eagle", 4)],
        clock=lambda: now[0],
        rng=np.random.default_rng(5),
        config=config,
    )
    control = BanditControlPolicy(bandit)
    routed: list[tuple[str, str, str]] = []
    sampler = SampledRouting(
        ARMS,
        default_model="m",
        rng=random.Random(9),
        on_routed=lambda model, cls, bucket, arm, reason: routed.append((cls, arm, reason)),
    )
    contexts = {cls: Context("m", cls, "1-3") for cls in CLASSES}
    pick = random.Random(2)
    draws = np.random.default_rng(4)
    # Per context: requests routed, and how many of them went to the arm committed then.
    requests: Counter[str] = Counter()
    on_committed: Counter[str] = Counter()
    for _ in range(240):  # tables, as the loop publishes them
        table = {cls: control.route(context) for cls, context in contexts.items()}
        for route in table.values():
            assert sum(share for _, share, _ in route.explore) <= CAP + 1e-12, route
        sampler.replace({RouteKey("m", cls, "1-3"): route for cls, route in table.items()})
        # What the workers routed and what came back meanwhile reaches the policy at
        # the loop's next iteration, routed requests first.
        sent: list[Routed] = []
        back: list[RequestObservation] = []
        at = now[0]
        for _ in range(REQUESTS_PER_TABLE):
            at += 0.04
            cls = pick.choices(list(CLASSES), weights=list(CLASSES.values()))[0]
            sampler.pool_for("m", cls, "1-3")
            _, arm, reason = routed[-1]
            requests[cls] += 1
            on_committed[cls] += arm == table[cls].arm
            sent.append(Routed(contexts[cls], arm, reason, at))
            back.append(observation(cls, arm, at + 0.02, draws))
        now[0] = at + 0.05
        for request in sent:
            control.routed(request)
        for finished in back:
            control.observe(finished)
        for context in contexts.values():
            control.decide(context, list(ARMS), "off")
    explored = sum(1 for _, _, reason in routed if reason in {"explore", "probe", "trial"})
    assert explored > 0, "the run never explored: it shows nothing about the cap"
    for cls, n in requests.items():
        # The committed share of n routed requests, each elsewhere with probability at
        # most CAP: three binomial standard deviations of slack, no more.
        floor = 1.0 - CAP - 3.0 * math.sqrt(CAP * (1.0 - CAP) / n)
        assert on_committed[cls] / n >= floor, (cls, n, on_committed[cls], floor)
