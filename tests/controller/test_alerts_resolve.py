"""Every alert the loop raises resolves when its condition clears: here
``OverrideNotRunnable``, once the override it names is no longer in force (it expired,
was deleted) or runs again, and after a restart too. (``AcceptanceDrift``:
tests/controller/test_drift_alerts.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.service import build_service
from controller.store.records import OverrideRecord, Scope
from controller.wiring import bandit_policy
from tests.controller.fakes import QueueSource
from tests.controller.test_drift_alerts import Clock, settings

NOT_RUNNABLE = {"method": "draft_model", "model": "/drafts/none", "num_speculative_tokens": 2}
"""A config no pool of ``settings`` can run (its pool has n-gram only)."""


def unresolved(service: object) -> list[str]:
    store = service.store  # type: ignore[attr-defined]
    return [a.name for a in store.alerts(unresolved_only=True)]


def test_override_not_runnable_resolves_when_the_override_ends(tmp_path: Path) -> None:
    config = settings(tmp_path)
    clock = Clock()
    service = build_service(
        config, bandit_policy(config, clock=clock), QueueSource(), actuators=[], clock=clock
    )
    loop = service.loop
    try:
        asyncio.run(loop.start())
        scope = Scope("*", "code", "*")
        service.store.add_override(
            OverrideRecord("o1", clock.now, clock.now + 100, scope, NOT_RUNNABLE, "incident")
        )
        clock.now += 1
        asyncio.run(loop.tick())
        asyncio.run(loop.tick())
        assert unresolved(service) == ["OverrideNotRunnable"]
        [alert] = service.store.alerts()
        assert alert.context == "*/code/*"
        clock.now += 200  # expired
        asyncio.run(loop.tick())
        assert unresolved(service) == []
    finally:
        service.close()


def test_a_restart_resolves_what_no_longer_holds_and_keeps_what_does(tmp_path: Path) -> None:
    config = settings(tmp_path)
    clock = Clock()
    first = build_service(
        config, bandit_policy(config, clock=clock), QueueSource(), actuators=[], clock=clock
    )
    try:
        asyncio.run(first.loop.start())
        for name, scope in (("gone", Scope("*", "code", "1")), ("kept", Scope("*", "code", "*"))):
            first.store.add_override(
                OverrideRecord(name, clock.now, clock.now + 1000, scope, NOT_RUNNABLE, name)
            )
        clock.now += 1
        asyncio.run(first.loop.tick())
        assert sorted(a.context or "" for a in first.store.alerts()) == ["*/code/*", "*/code/1"]
        first.store.delete_override("gone", clock.now)
        asyncio.run(first.loop.shutdown())
    finally:
        first.close()
    second = build_service(
        config, bandit_policy(config, clock=clock), QueueSource(), actuators=[], clock=clock
    )
    try:
        asyncio.run(second.loop.start())
        clock.now += 1
        asyncio.run(second.loop.tick())
        open_alerts = second.store.alerts(unresolved_only=True)
        assert {a.context for a in open_alerts} == {"*/code/*"}, open_alerts
    finally:
        second.close()
