"""Test doubles for the policy and the collector, to isolate the controller's own logic.

They stand in for ``policies/`` and ``collectors/`` (built on other branches) and are
deliberately simple and deterministic: ``ScriptedPolicy`` learns mean time per output
token per (context, arm) and picks the fastest observed arm unless a test scripts its
choice; ``QueueSource`` hands out batches the test queued; ``SyntheticSource`` (for the
``serve`` process tests, wired through ``settings.wiring``) makes seeded observations in
which n-gram γ=3 beats no speculation for code.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from collectors.observations import RequestObservation, SpecDecodeRequestStats, WindowObservation
from controller.contexts import Context
from controller.ports import ArmChoice, ArmEstimate, Collected, DriftEvent
from controller.settings import Settings


def key(context: Context, arm: str) -> str:
    return f"{context}|{arm}"


class ScriptedPolicy:
    def __init__(self, edges: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> None:
        self.edges = edges
        self.tpot: dict[str, list[float]] = {}
        self.script: dict[Context, str] = {}
        self.pins: dict[Context, str] = {}
        self.observed = 0
        self.windows: list[WindowObservation] = []
        self.drift_events: list[DriftEvent] = []

    def observe(self, observation: RequestObservation) -> None:
        from controller.loop import context_of

        self.observed += 1
        if observation.tpot_s is None or observation.arm is None:
            return
        entry = self.tpot.setdefault(
            key(context_of(observation, self.edges), observation.arm), [0, 0]
        )
        entry[0] += observation.tpot_s
        entry[1] += 1

    def observe_window(self, window: WindowObservation) -> None:
        self.windows.append(window)

    def drift(self) -> Sequence[DriftEvent]:
        events, self.drift_events = self.drift_events, []
        return events

    def mean(self, context: Context, arm: str) -> float | None:
        entry = self.tpot.get(key(context, arm))
        return entry[0] / entry[1] if entry and entry[1] else None

    def decide(self, context: Context, allowed_arms: Sequence[str], current: str) -> ArmChoice:
        if context in self.script:
            return ArmChoice(self.script[context], "scripted", 1.5)
        means = {a: m for a in allowed_arms if (m := self.mean(context, a)) is not None}
        if not means:
            return ArmChoice(current, "no data")
        best = min(means, key=lambda a: means[a])
        off = self.mean(context, "off")
        return ArmChoice(best, "fastest observed", off / means[best] if off else None)

    def set_pins(self, pins: Mapping[Context, str]) -> None:
        self.pins = dict(pins)

    def estimates(self, context: Context) -> Sequence[ArmEstimate]:
        off = self.mean(context, "off")
        out = []
        for k, (total, count) in sorted(self.tpot.items()):
            ctx, _, arm = k.partition("|")
            if ctx == str(context) and count:
                speedup = off / (total / count) if off else None
                interval = (speedup * 0.9, speedup * 1.1) if speedup else None
                out.append(ArmEstimate(arm, 0.6, (0.5, 0.7), speedup, interval, int(count)))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"tpot": {k: list(v) for k, v in self.tpot.items()}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.tpot = {k: list(v) for k, v in state.get("tpot", {}).items()}


class QueueSource:
    def __init__(self, *, exclusive: bool = False) -> None:
        self.batches: deque[Collected] = deque()
        self.closed = False
        self.exclusive = exclusive
        """As ``controller.ports.ObservationSource`` says: only this replica sees it."""

    async def collect(self) -> Collected:
        return self.batches.popleft() if self.batches else Collected()

    async def aclose(self) -> None:
        self.closed = True


def observation(
    arm: str,
    tpot_s: float,
    *,
    model: str = "m",
    workload_class: str = "code",
    concurrency: int = 1,
    finished_at: float | None = None,
) -> RequestObservation:
    output = 101
    return RequestObservation(
        model=model,
        prompt_tokens=50,
        output_tokens=output,
        ttft_s=0.05,
        mean_itl_s=tpot_s,
        generation_time_s=tpot_s * (output - 1),
        spec=None if arm == "off" else SpecDecodeRequestStats(40, 120, 60),
        workload_class=workload_class,
        arm=arm,
        concurrency=concurrency,
        finished_at=finished_at,
    )


class SyntheticSource:
    """Seeded observations for every model × class at concurrency 1: ngram:3 is 30 %
    faster than off for code, slower for the rest."""

    def __init__(self, settings: Settings, seed: int = 7) -> None:
        self.settings = settings
        self.rng = random.Random(seed)

    async def collect(self) -> Collected:
        batch = []
        for model in self.settings.models:
            for cls in self.settings.classes:
                for arm, base in (("off", 0.020), ("ngram:3", 0.014 if cls == "code" else 0.026)):
                    tpot = base * self.rng.uniform(0.95, 1.05)
                    batch.append(observation(arm, tpot, model=model, workload_class=cls))
        return Collected(tuple(batch))

    async def aclose(self) -> None:
        pass


def make_policy(settings: Settings) -> ScriptedPolicy:
    return ScriptedPolicy(settings.buckets)


def make_source(settings: Settings) -> SyntheticSource:
    return SyntheticSource(settings)
