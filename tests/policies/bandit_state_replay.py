"""The steps ``fixtures/make_bandit_state_v1.py`` replayed after restoring its state,
shared with the test that replays them on today's code."""

from __future__ import annotations

from typing import Any

from collectors.observations import WindowObservation
from policies.arms import Arm, Context
from policies.bandit import SpecPilotPolicy

# Other arms: eagle3 up to 6 and ngram 8 new, ngram 2 gone; or no eagle3 at all.
WIDER = [Arm("eagle3", g) for g in range(1, 7)] + [Arm("ngram", g) for g in (4, 6, 8)]
NGRAM_ONLY = [Arm("ngram", g) for g in (2, 4, 6)]
CONTEXTS = [
    Context("sim-model", cls, bucket)
    for cls in ("code", "chat")
    for bucket in ("1", "2-3", "8-15", "16-31")
]


def replay(policy: SpecPilotPolicy) -> dict[str, Any]:
    """Decisions, selections and learning after a restore, on a clock of its own."""
    # (At a219f69 this read the same time from the flat state: state_dict()["shares_at"].)
    now = [float(policy.learning.shares_at.get("sim-model", 0.0))]
    policy.clock = lambda: now[0]
    steps: list[Any] = []
    for i in range(40):
        now[0] += 2.5
        for ctx in CONTEXTS:
            decided = policy.decide(ctx)
            chosen = policy.choose(ctx)
            steps.append(
                [str(decided.arm), decided.reason, str(chosen.arm), chosen.reason, chosen.explored]
            )
        arm = Arm("ngram", 2) if i % 2 else Arm("eagle3", 3)
        policy.observe_window(
            WindowObservation(
                model="sim-model",
                started_at=now[0] - 2.5,
                finished_at=now[0],
                duration_s=2.5,
                requests=4.0,
                generation_tokens=480.0,
                drafts=150.0,
                draft_tokens=150.0 * arm.gamma,
                accepted_per_position=tuple(150.0 * 0.7 ** (k + 1) for k in range(arm.gamma)),
                step_s=0.021,
                tpot_s=0.012,
                running=float(1 + i % 20),
                workload_class="code" if i % 3 else "chat",
                arm=str(arm),
            )
        )
    return {"steps": steps, "estimates": policy.estimates(), "selected": policy.selected}
