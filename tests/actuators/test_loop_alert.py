"""A rollout the managed actuator rolls back reaches the operator as an alert, through
the control loop's own path (a raising actuator → ``ActuatorFailed`` in the store)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from controller.actuators.managed import CanarySettings, ManagedActuator, ManagedSettings
from controller.service import build_service
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.controller.conftest import make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy


def test_rolled_back_rollout_is_recorded_as_an_alert(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"status": 500}})
    managed = ManagedActuator(
        launcher,
        settings=ManagedSettings(switch_grace_s=0.0, canary=CanarySettings(requests=1)),
        in_flight=launcher.in_flight,
        timer=launcher.clock,
        transport=launcher.transport(),
    )
    policy = ScriptedPolicy(settings.buckets)
    service = build_service(settings, policy, QueueSource(), actuators=[managed])
    try:

        async def scenario() -> None:
            await service.loop.start()
            await service.loop.tick()  # first push: the pool's running config (off)
            assert managed.running() == {"p": None}
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:3"
            await service.loop.tick()
            alerts = service.store.alerts()
            assert [(a.name, a.severity) for a in alerts] == [("ActuatorFailed", "critical")]
            assert "managed: pool 'p': canary failed" in alerts[0].message
            assert "old instance kept serving" in alerts[0].message
            assert alerts[0].context == "actuator=managed" and alerts[0].resolved_at is None
            assert managed.running() == {"p": None} and managed.urls("p") == ("http://i1",)
            await service.loop.tick()  # failing still (retried): one alert, not one a push
            assert len(service.store.alerts()) == 1
            # The operator fixes what broke the canary: the next push resolves it.
            launcher.behaviour.pop("ngram")
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:2"
            await service.loop.tick()
            for _ in range(100):  # the push runs beside the loop; wait for its end
                [alert] = service.store.alerts()
                if alert.resolved_at is not None:
                    break
                await asyncio.sleep(0.05)
            assert managed.running()["p"] is not None
            assert alert.resolved_at is not None

        asyncio.run(scenario())
    finally:
        service.close()
