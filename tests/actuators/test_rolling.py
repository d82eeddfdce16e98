"""Rolling restarts of the per-pod topology: replicas of one pool, each a managed actuator
of fake instances (``tests/actuators/fakes.py``, to isolate the rollout logic), take
turns through restart leases in the real store, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.managed import (
    CanarySettings,
    Instance,
    ManagedActuator,
    ManagedSettings,
    RolloutFailed,
    SpecConfig,
)
from controller.actuators.rolling import RollingRestarts
from controller.exactness import config_text
from controller.fleet import PoolConfig
from controller.store.db import Store
from controller.store.records import LeaseRecord
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.controller.conftest import private_pg

POOL = "code"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
NGRAM_2 = {**NGRAM, "num_speculative_tokens": 2}


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        opened = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
        yield opened
        opened.close()
        return
    with private_pg() as database:
        opened = Store.open(database.url)
        yield opened
        opened.close()


@dataclass
class Restarts:
    """When each replica's launches began and ended (wall clock), and what the pod's
    readiness said while its new instance started."""

    starts: list[tuple[str, float, float]] = field(default_factory=list)
    readiness: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    """What the pod's readiness said while its old instance drained."""


class SlowLauncher(FakeLauncher):
    """A fake launch that takes ``seconds``, so that overlapping restarts would show."""

    def __init__(self, name: str, restarts: Restarts, seconds: float = 0.05, **kw: Any):
        super().__init__(FakeClock(), **kw)
        self.name, self.restarts, self.seconds = name, restarts, seconds
        self.pod: RollingRestarts | None = None
        self.launching = asyncio.Event()

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        began = time.time()
        self.launching.set()
        if self.pod is not None:
            self.restarts.readiness.append(self.pod.readiness())
        await asyncio.sleep(self.seconds)
        try:
            return await super().launch(pool, config, timeout_s)
        finally:
            self.restarts.starts.append((self.name, began, time.time()))

    async def in_flight(self, instance: Instance) -> int:
        if self.pod is not None:
            self.restarts.draining.append(self.pod.readiness())
        return await super().in_flight(instance)


def replica(
    name: str,
    store: Store,
    restarts: Restarts,
    *,
    max_unavailable: int = 1,
    ttl_s: float = 5.0,
    **launcher: Any,
) -> tuple[RollingRestarts, SlowLauncher]:
    fake = SlowLauncher(name, restarts, **launcher)
    managed = ManagedActuator(
        fake,
        settings=ManagedSettings(
            mode="in_place",
            switch_grace_s=0.0,
            drain_poll_s=0.0,
            canary=CanarySettings(requests=1, max_slowdown=None, exactness=False),
        ),
        in_flight=fake.in_flight,
        timer=fake.clock,
        transport=fake.transport(),
    )
    pod = RollingRestarts(
        managed,
        store,
        pool=POOL,
        replica=name,
        max_unavailable=max_unavailable,
        ttl_s=ttl_s,
        poll_s=0.02,
    )
    fake.pod = pod
    return pod, fake


def push(config: SpecConfig) -> list[PoolConfig]:
    return [PoolConfig(POOL, config, ())]


def log(store: Store) -> list[LeaseRecord]:
    return list(reversed(store.leases(POOL)))


def overlapping(leases: list[LeaseRecord]) -> list[tuple[int, int]]:
    ends = {lease.id: lease.released_at or lease.expires_at for lease in leases}
    return [
        (a.id, b.id)
        for a in leases
        for b in leases
        if a.id < b.id and a.acquired_at < ends[b.id] and b.acquired_at < ends[a.id]
    ]


def test_replicas_of_a_pool_restart_one_at_a_time_each_inside_its_lease(store: Store) -> None:
    restarts = Restarts()
    pods = [replica(name, store, restarts) for name in ("a", "b", "c")]

    async def scenario() -> None:
        # First starts need no lease: nothing serves yet that a restart would take away.
        await asyncio.gather(*(pod.apply(push(None)) for pod, _ in pods))
        assert store.leases(POOL) == []
        assert [pod.readiness() for pod, _ in pods] == ["ok"] * 3
        await asyncio.gather(*(pod.apply(push(NGRAM)) for pod, _ in pods))

    asyncio.run(scenario())
    leases = log(store)
    assert [lease.outcome for lease in leases] == ["done"] * 3
    assert sorted(lease.replica for lease in leases) == ["a", "b", "c"]
    assert {lease.config for lease in leases} == {config_text(NGRAM)}
    assert overlapping(leases) == []
    for name, began, ended in restarts.starts[3:]:
        [lease] = [lease for lease in leases if lease.replica == name]
        assert lease.released_at is not None
        assert lease.acquired_at <= began and ended <= lease.released_at
    assert [pod.inner.config(POOL) for pod, _ in pods] == [NGRAM] * 3
    assert restarts.readiness[3:] == ["restarting"] * 3  # the pod was out of its Service
    assert restarts.draining and set(restarts.draining) == {"draining"}


def test_max_unavailable_lets_that_many_restart_together(store: Store) -> None:
    restarts = Restarts()
    pods = [replica(name, store, restarts, max_unavailable=2, seconds=0.3) for name in "ab"]

    async def scenario() -> None:
        await asyncio.gather(*(pod.apply(push(None)) for pod, _ in pods))
        await asyncio.gather(*(pod.apply(push(NGRAM)) for pod, _ in pods))

    asyncio.run(scenario())
    leases = log(store)
    assert [lease.outcome for lease in leases] == ["done", "done"]
    assert len(overlapping(leases)) == 1


def test_a_failed_restart_rolls_back_and_holds_the_rest_of_the_pool(store: Store) -> None:
    restarts = Restarts()
    failing, failing_launcher = replica("a", store, restarts, fail_start={"ngram": "no such GPU"})
    other, other_launcher = replica("b", store, restarts)

    async def scenario() -> None:
        await failing.apply(push(None))
        await other.apply(push(None))
        with pytest.raises(RolloutFailed, match="start failed"):
            await failing.apply(push(NGRAM))
        assert failing.inner.config(POOL) is None and failing.readiness() == "ok"  # rolled back
        await other.apply(push(NGRAM))  # held: no start
        await failing.apply(push(NGRAM))  # its own retry is held too
        assert other.inner.config(POOL) is None
        assert other_launcher.events.count("launch ngram") == 0
        assert failing_launcher.events.count("launch ngram") == 1
        # Handed another config, the pool moves on: the hold lifts.
        await other.apply(push(NGRAM_2))
        assert other.inner.config(POOL) == NGRAM_2

    asyncio.run(scenario())
    leases = log(store)
    assert [(lease.replica, lease.outcome) for lease in leases] == [
        ("a", "failed"),
        ("b", "done"),
    ]
    assert "no such GPU" in (leases[0].detail or "")
    assert not leases[0].holds  # lifted


def test_a_dead_replicas_lease_frees_the_pool_once_it_expires(store: Store) -> None:
    restarts = Restarts()
    pod, _ = replica("b", store, restarts, ttl_s=5.0)
    dead = store.acquire_lease(POOL, "a", config_text(NGRAM), time.time, 0.5, 1).lease
    assert dead is not None

    async def scenario() -> None:
        await pod.apply(push(None))
        await pod.apply(push(NGRAM))

    asyncio.run(scenario())
    first, second = log(store)
    assert (first.replica, first.outcome, first.released_at) == ("a", "expired", dead.expires_at)
    assert (second.replica, second.outcome) == ("b", "done")
    assert second.acquired_at >= dead.expires_at
    assert pod.inner.config(POOL) == NGRAM


def test_a_replica_waiting_for_its_turn_restarts_once_into_the_newest_wish(store: Store) -> None:
    restarts = Restarts()
    pod, launcher = replica("b", store, restarts)
    wish = {"now": push(NGRAM)[0]}
    pod.target = lambda pool: wish["now"]
    busy = store.acquire_lease(POOL, "a", config_text(NGRAM), time.time, 60.0, 1).lease
    assert busy is not None

    async def scenario() -> None:
        await pod.apply(push(None))
        waiting = asyncio.create_task(pod.apply(push(NGRAM)))
        await asyncio.sleep(0.2)
        assert not waiting.done() and pod.readiness() == "ok"  # serves while it waits
        wish["now"] = push(NGRAM_2)[0]  # a newer decision arrived meanwhile
        store.release_lease(busy.id, time.time(), "done")
        await waiting

    asyncio.run(scenario())
    assert [e for e in launcher.events if e.startswith("launch")] == ["launch off", "launch ngram"]
    assert pod.inner.config(POOL) == NGRAM_2
    assert log(store)[-1].config == config_text(NGRAM_2)


def test_a_replica_stopped_mid_restart_gives_its_lease_up(store: Store) -> None:
    restarts = Restarts()
    pod, _ = replica("a", store, restarts, seconds=30.0)

    async def scenario() -> None:
        pod.inner.settings = ManagedSettings(
            mode="in_place", switch_grace_s=0.0, drain_poll_s=0.0, start_timeout_s=60.0
        )
        launcher: Any = pod.inner.launcher
        launcher.seconds = 0.0
        await pod.apply(push(None))
        launcher.seconds = 30.0
        launcher.launching.clear()
        restart = asyncio.create_task(pod.apply(push(NGRAM)))
        await launcher.launching.wait()
        assert pod.readiness() == "restarting"
        restart.cancel()
        with pytest.raises(asyncio.CancelledError):
            await restart

    asyncio.run(scenario())
    [lease] = log(store)
    assert lease.outcome == "abandoned" and not lease.holds


def test_two_pushes_to_one_replica_take_turns(store: Store) -> None:
    """Pacing's timer may push beside the loop: the replica still holds one lease."""
    restarts = Restarts()
    pod, _ = replica("a", store, restarts)

    async def scenario() -> None:
        await pod.apply(push(None))
        await asyncio.gather(pod.apply(push(NGRAM)), pod.apply(push(NGRAM_2)))

    asyncio.run(scenario())
    leases = log(store)
    assert [(lease.outcome, lease.config) for lease in leases] == [
        ("done", config_text(NGRAM)),
        ("done", config_text(NGRAM_2)),
    ]
    assert overlapping(leases) == []
    assert pod.inner.config(POOL) == NGRAM_2


def test_a_renewal_that_raises_does_not_end_the_renewing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart longer than the lease's TTL keeps its lease though one renewal raised:
    the other replica's turn comes only after it."""
    restarts = Restarts()
    slow, _ = replica("a", store, restarts, ttl_s=0.6, seconds=1.5)
    other, _ = replica("b", store, restarts, ttl_s=0.6)
    renew = store.renew_lease
    raised: list[int] = []

    def renew_once_raising(lease_id: int, now: float, ttl_s: float) -> bool:
        if not raised:
            raised.append(lease_id)
            raise RuntimeError("a driver error nobody expected")
        return renew(lease_id, now, ttl_s)

    monkeypatch.setattr(store, "renew_lease", renew_once_raising)

    async def scenario() -> None:
        await slow.apply(push(None))
        await other.apply(push(None))
        task = asyncio.create_task(slow.apply(push(NGRAM)))
        await asyncio.sleep(0.3)  # a holds the lease and is restarting
        await other.apply(push(NGRAM))
        await task

    asyncio.run(scenario())
    leases = log(store)
    assert raised
    assert [(lease.replica, lease.outcome) for lease in leases] == [("a", "done"), ("b", "done")]
    assert overlapping(leases) == []
