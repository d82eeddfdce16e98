"""The per-pod topology in the control loop: two replicas on one PostgreSQL, each with its
own pod's vLLM. The follower hands its windows to the leader, the leader decides, and
each replica applies the decision to its own vLLM, one after the other.

The policy, the source and the vLLM instances are fakes (``tests/controller/fakes.py``,
``tests/actuators/fakes.py``), to isolate the loop's part; store, leases, leadership and
the actuator stack (pacing, pool filter, rolling restarts, managed) are real.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from collectors.observations import WindowObservation
from controller.actuators.configured import OnlyPools
from controller.actuators.managed import CanarySettings, ManagedActuator, ManagedSettings
from controller.actuators.pacing import Paced
from controller.actuators.rolling import RollingRestarts
from controller.api import create_app
from controller.contexts import Context
from controller.exactness import config_text
from controller.ports import Collected
from controller.service import Service, build_service
from controller.settings import Settings
from controller.store.leader import AdvisoryLockLeader
from controller.store.records import WindowStatRecord
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.controller.conftest import PgDatabase
from tests.controller.fakes import QueueSource, ScriptedPolicy

POOL = "code"
NGRAM_3 = {"method": "ngram", "num_speculative_tokens": 3}


def pod_settings(data_dir: Path, url: str, replica: str) -> Settings:
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "store": {"url": url},
            "classes": ["code"],
            "buckets": [1],
            "scrape_interval_s": 0.05,
            "policy": {"min_dwell_s": 0},
            "actuators": {
                "file": False,
                "managed": {
                    "mode": "in_place",
                    "pod": {"replica": replica},
                    "pools": {POOL: {"command": ["vllm", "serve", "/m"], "port": 8000}},
                },
            },
            "fleet": {
                "pools": {
                    POOL: {"model": "m", "proposers": {"ngram": {"method": "ngram"}}},
                }
            },
        }
    )


class Replica:
    def __init__(self, settings: Settings, url: str) -> None:
        self.launcher = FakeLauncher(FakeClock())
        self.policy = ScriptedPolicy(settings.buckets)
        self.source = QueueSource(exclusive=True)
        managed = ManagedActuator(
            self.launcher,
            settings=ManagedSettings(
                mode="in_place",
                switch_grace_s=0.0,
                drain_poll_s=0.0,
                canary=CanarySettings(requests=1, max_slowdown=None, exactness=False),
            ),
            in_flight=self.launcher.in_flight,
            transport=self.launcher.transport(),
        )
        self.managed = managed
        self.service: Service = build_service(
            settings,
            self.policy,
            self.source,
            actuators=[],
            leadership=AdvisoryLockLeader(url),
        )
        rolling = RollingRestarts(
            managed,
            self.service.store,
            pool=POOL,
            replica=settings.actuators.managed.replica,  # type: ignore[union-attr]
        )
        rolling.poll_s = 0.02
        rolling.target = self.service.loop.pool_target
        self.service.loop.actuators = [Paced(OnlyPools(rolling, (POOL,)), 0.0)]
        self.service.pod = rolling
        self.loop = self.service.loop

    async def readyz(self) -> tuple[int, dict[str, str]]:
        app = create_app(self.service.settings, self.service, run_loop=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            response = await client.get("/readyz")
        return response.status_code, response.json()["checks"]

    async def tick(self) -> None:
        await self.loop.tick()
        if self.loop._pushing is not None:
            await self.loop._pushing  # the restart the tick started, to its end

    def close(self) -> None:
        self.service.close()


def window(finished_at: float) -> WindowObservation:
    return WindowObservation(
        model="m",
        started_at=finished_at - 1.0,
        finished_at=finished_at,
        duration_s=1.0,
        requests=4.0,
        generation_tokens=400.0,
        drafts=0.0,
        draft_tokens=0.0,
        accepted_per_position=(),
        step_s=0.02,
        tpot_s=0.02,
        running=1.0,
        workload_class="code",
        pool=POOL,
        instance="http://127.0.0.1:8000#b",
        arm="off",
    )


def test_follower_hands_its_windows_over_and_applies_the_leaders_decision(
    tmp_path: Path, pg: PgDatabase
) -> None:
    leader = Replica(pod_settings(tmp_path / "a", pg.url, "a"), pg.url)
    follower = Replica(pod_settings(tmp_path / "b", pg.url, "b"), pg.url)

    async def scenario() -> None:
        for replica in (leader, follower):
            await replica.loop.start()
            assert (await replica.readyz())[0] == 503  # no vLLM yet
            await replica.tick()
            status, checks = await replica.readyz()
            assert (status, checks["vllm"]) == (200, "ok"), checks
        assert leader.loop.is_leader and not follower.loop.is_leader
        # Each replica started its own pod's vLLM with the pool's config, without a lease.
        assert leader.managed.urls(POOL) and follower.managed.urls(POOL)
        assert leader.managed.config(POOL) is None and follower.managed.config(POOL) is None
        stat = WindowStatRecord(
            ts=1000.0, pool=POOL, instance="http://127.0.0.1:8000#b", model="m", window_s=1.0
        )
        follower.source.batches.append(
            Collected(windows=(stat,), window_observations=(window(1000.0),))
        )
        await follower.tick()
        assert follower.policy.windows == []  # a follower does not learn
        [stored] = follower.service.store.latest_window_stats()
        assert stored.instance == "http://127.0.0.1:8000#b"
        leader.policy.script[Context("m", "code", "1+")] = "ngram:3"
        await leader.tick()
        assert [w.instance for w in leader.policy.windows] == ["http://127.0.0.1:8000#b"]
        assert leader.managed.config(POOL) == NGRAM_3
        await follower.tick()
        assert follower.managed.config(POOL) == NGRAM_3

    try:
        asyncio.run(scenario())
        leases: list[Any] = list(reversed(leader.service.store.leases(POOL)))
    finally:
        follower.close()
        leader.close()
    assert [(lease.replica, lease.outcome) for lease in leases] == [("a", "done"), ("b", "done")]
    assert {lease.config for lease in leases} == {config_text(NGRAM_3)}
    assert leases[0].released_at is not None
    assert leases[0].released_at <= leases[1].acquired_at
