"""``SpecpilotOverridePoolDown``: an operator's override pins an arm that no healthy
instance serves.

An override is valid when made (some pool runs its config), but the pool that would
serve it can die afterwards: in routing mode the gateway then fails the pinned
requests over to another pool (another config than the one pinned), in push mode the
pinned config runs nowhere. Either way the pin is not what serves, and nothing else
says so: the override itself stays in force. The loop asks, every iteration, which
pools serve each override in force (routing mode: the one running the pinned arm;
push mode: the pools of the contexts it pins) and which pools have no instance up
(``InstanceHealth.pools_down``); a pair that stays so for ``down_after_s`` (as
``SpecpilotInstanceDown`` waits) raises a warning with context
``pool=NAME,override=ID``, handed to the notifier again each iteration while it holds,
and resolved when the pool has an instance up again or the override ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from controller.store.records import AlertRecord

OVERRIDE_POOL_DOWN = "SpecpilotOverridePoolDown"
SEVERITY = "warning"


@dataclass(frozen=True, slots=True)
class PinnedPools:
    """One override in force: what it pins and the pools that would serve it."""

    override_id: str
    reason: str
    arm: str
    pools: frozenset[str]


@dataclass(slots=True)
class OverridePoolAlerts:
    raised: list[AlertRecord] = field(default_factory=list)
    firing: list[AlertRecord] = field(default_factory=list)
    """Still holding: handed to the notifier again, so that Alertmanager's copy lasts."""
    resolved: list[tuple[str, str]] = field(default_factory=list)
    """(context, why it resolved)."""


def alert_context(pool: str, override_id: str) -> str:
    return f"pool={pool},override={override_id}"


class OverridePools:
    """Which override × pool pairs are down, since when, and which fire."""

    def __init__(self, down_after_s: float) -> None:
        self.down_after_s = down_after_s
        self._since: dict[str, float] = {}
        self._firing: set[str] = set()

    def restore(self, unresolved: Iterable[AlertRecord]) -> None:
        """Alerts that fired when the service stopped fire on (not raised twice) until
        the first judgement finds they no longer hold."""
        for alert in unresolved:
            if alert.name == OVERRIDE_POOL_DOWN and alert.context:
                self._firing.add(alert.context)

    def judge(
        self, pinned: Iterable[PinnedPools], down: Mapping[str, str], now: float
    ) -> OverridePoolAlerts:
        """``down``: pools with no instance up → why (one line)."""
        out = OverridePoolAlerts()
        holding: dict[str, AlertRecord] = {}
        overrides = set()
        for pin in pinned:
            overrides.add(pin.override_id)
            for pool in sorted(pin.pools & set(down)):
                context = alert_context(pool, pin.override_id)
                since = self._since.setdefault(context, now)
                message = (
                    f"override {pin.override_id} ({pin.reason}) pins {pin.arm}, but pool "
                    f"{pool} has no instance up ({down[pool]}) for {now - since:.0f} s: "
                    "what it pins is not what serves"
                )
                holding[context] = AlertRecord(now, OVERRIDE_POOL_DOWN, SEVERITY, message, context)
        for context in [c for c in self._since if c not in holding]:
            del self._since[context]
        for context, alert in holding.items():
            if context in self._firing:
                out.firing.append(alert)
            elif now - self._since[context] >= self.down_after_s:
                self._firing.add(context)
                out.raised.append(alert)
        for context in sorted(self._firing - set(holding)):
            self._firing.discard(context)
            ended = context.rpartition("override=")[2] not in overrides
            out.resolved.append(
                (context, "the override ended" if ended else "the pool has an instance up again")
            )
        return out
