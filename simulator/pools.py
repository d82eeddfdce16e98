"""Routing mode for the fast simulator: one engine per arm.

When every speculative config runs in its own pool (specpilot's routing mode), a
request's steps are paced by the requests in its own pool only. ``PerArmEngines`` keeps
one :class:`~simulator.engine.Engine` per arm on one time line, with the same interface
as a single engine, so :func:`simulator.run.simulate` runs any policy against that
world unchanged. Engines take whole steps, so a busy engine may run up to one step
ahead of the shared clock; the times in its observations are its own.
"""

from __future__ import annotations

from policies.arms import Arm
from policies.fleet import CostParams
from simulator.engine import Completion, Engine, SimRequest


class PerArmEngines:
    """One batch per arm, each stepping at the cost of its own composition."""

    def __init__(self, cost: CostParams, model_name: str, position_decay: float) -> None:
        self.cost = cost
        self.model_name = model_name
        self.position_decay = position_decay
        self.now = 0.0
        self.engines: dict[Arm, Engine] = {}

    @property
    def in_flight(self) -> int:
        return sum(engine.in_flight for engine in self.engines.values())

    def emitted_tokens(self) -> int:
        return sum(engine.emitted_tokens() for engine in self.engines.values())

    def add(self, request: SimRequest, arm: Arm, concurrency: int | None = None) -> None:
        engine = self.engines.get(arm)
        if engine is None:
            engine = self.engines[arm] = Engine(self.cost, self.model_name, self.position_decay)
        if not engine.in_flight:
            engine.now = max(engine.now, self.now)
        engine.add(request, arm, concurrency)

    def advance(self, until: float) -> list[Completion]:
        """Advance every busy engine to the first finish anywhere, or to ``until``."""
        busy = [engine for engine in self.engines.values() if engine.in_flight]
        target = min([until, *(engine.next_finish_at() for engine in busy)])
        finished: list[Completion] = []
        for engine in busy:
            if engine.now < target:
                finished.extend(engine.advance(target))
        ends = [c.observation.finished_at or target for c in finished]
        self.now = max([self.now, target, *ends])
        return finished
