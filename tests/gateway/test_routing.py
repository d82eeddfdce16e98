"""Routing, balancing and ejection: pure logic, tested with a fake clock (no servers)."""

from __future__ import annotations

import pytest

from controller.gateway.routing import (
    EjectionPolicy,
    Fleet,
    NoInstanceAvailable,
    Pool,
    RouteKey,
    StaticRoutingTable,
)
from policies.arms import ConcurrencyBuckets


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(clock: FakeClock, **kwargs: object) -> Fleet:
    pools = [
        Pool("off", "off", ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]),
        Pool("ngram", "ngram:4", ["http://127.0.0.1:9003"]),
    ]
    return Fleet(pools, clock=clock, **kwargs)  # type: ignore[arg-type]


def test_gateway_buckets_are_the_policys() -> None:
    buckets = ConcurrencyBuckets((1, 2, 4, 16))
    labels = [buckets.bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 1000)]
    assert labels == ["1", "2-3", "2-3", "4-15", "4-15", "16+", "16+", "16+"]
    with pytest.raises(ValueError):
        ConcurrencyBuckets((4, 2))


def test_routing_table_prefers_exact_then_any_model_then_default() -> None:
    table = StaticRoutingTable("off")
    assert table.pool_for("m", "code", "1") == "off"
    table.replace(
        {
            RouteKey("m", "code", "1"): "ngram",
            RouteKey(None, "code", "2"): "ngram",
        }
    )
    assert table.pool_for("m", "code", "1") == "ngram"
    assert table.pool_for("other", "code", "2") == "ngram"
    assert table.pool_for("m", "code", "16") == "off"
    assert table.pool_for("m", "prose", "1") == "off"
    table.replace({}, default_pool="ngram")
    assert table.pool_for("m", "code", "1") == "ngram"
    assert table.default_pool == "ngram"


def test_least_in_flight_inside_the_pool() -> None:
    clock = FakeClock()
    f = fleet(clock)
    pool, first = f.pick("off")
    f.acquire(pool, first)
    _, second = f.pick("off")
    assert second is not first, "the idle instance wins over the busy one"
    f.acquire(pool, second)
    f.acquire(pool, second)
    _, third = f.pick("off")
    assert third is first
    assert pool.in_flight == 3
    f.release(pool, second, ok=True)
    f.release(pool, second, ok=True)
    f.release(pool, first, ok=True)
    assert pool.in_flight == 0 and first.in_flight == 0 and second.in_flight == 0


def test_failure_ejects_until_cooldown_then_readmits_with_backoff() -> None:
    clock = FakeClock()
    f = fleet(clock, ejection=EjectionPolicy(failures_to_eject=2, cooldown_s=5.0))
    pool, bad = f.pick("off")
    for _ in range(2):
        f.acquire(pool, bad)
        f.release(pool, bad, ok=False)
    assert all(f.pick("off")[1] is not bad for _ in range(3))
    clock.now += 5.0
    assert f.pick("off")[1] is bad, "re-admitted after the cool-down"
    for _ in range(2):
        f.acquire(pool, bad)
        f.release(pool, bad, ok=False)
    clock.now += 5.0
    assert f.pick("off")[1] is not bad, "a second ejection lasts twice as long"
    clock.now += 5.0
    assert f.pick("off")[1] is bad
    f.acquire(pool, bad)
    f.release(pool, bad, ok=True)
    assert bad.ejections == 0 and bad.consecutive_failures == 0


def test_exclusion_and_fallback_to_default_pool() -> None:
    clock = FakeClock()
    f = fleet(clock)
    ngram, only = f.pick("ngram")
    f.acquire(ngram, only)
    f.release(ngram, only, ok=False)
    pool, instance = f.pick("ngram")
    assert pool.name == "off", "a pool with nothing available falls back to the default"
    assert f.pick("no-such-pool")[0].name == "off"
    off = f.pools["off"]
    with pytest.raises(NoInstanceAvailable):
        f.pick("off", exclude=off.instances)
    assert instance in off.instances


def test_a_default_pool_with_nothing_left_falls_back_to_another_pool_of_its_model() -> None:
    """The default pool is the routed one too (nothing to fall back to before): once its
    one instance was tried, the request goes to another pool serving the same model,
    never to a pool of another model."""
    pools = [
        Pool("ngram", "ngram:4", ["http://127.0.0.1:9003"], model="m"),
        Pool("other-model", "off", ["http://127.0.0.1:9004"], model="n"),
        Pool("off", "off", ["http://127.0.0.1:9001"], model="m"),
    ]
    f = Fleet(pools, clock=FakeClock())
    ngram = f.pools["ngram"]
    pool, instance = f.pick("ngram", exclude=ngram.instances)
    assert pool.name == "off" and instance in pool.instances
    with pytest.raises(NoInstanceAvailable):
        f.pick("ngram", exclude=[*ngram.instances, instance])
    # Pools that do not know their model fall back to the default pool only.
    bare = Fleet([Pool("a", "off", ["http://127.0.0.1:9005"]), Pool("b", "off", ["http://h:1"])],
                 clock=FakeClock())  # fmt: skip
    with pytest.raises(NoInstanceAvailable):
        bare.pick("a", exclude=bare.pools["a"].instances)


def test_model_in_flight_counts_requests_per_model() -> None:
    f = fleet(FakeClock())
    assert f.begin("a") == 1
    assert f.begin("a") == 2
    assert f.begin(None) == 1
    f.end("a")
    assert f.model_in_flight("a") == 1
    f.end("a")
    assert f.model_in_flight("a") == 0


def test_instance_urls_are_validated() -> None:
    with pytest.raises(ValueError):
        Pool("p", "off", ["https://example.invalid"])
    with pytest.raises(ValueError):
        Pool("p", "off", [])
    with pytest.raises(ValueError):
        Fleet([Pool("a", "off", ["http://127.0.0.1:1"])], default_pool="b", clock=FakeClock())


def test_when_everything_is_ejected_the_first_to_recover_is_tried_anyway() -> None:
    clock = FakeClock()
    f = fleet(clock)
    for name in ("ngram", "off"):
        for instance in f.pools[name].instances:
            f.acquire(f.pools[name], instance)
            f.release(f.pools[name], instance, ok=False)
            clock.now += 1.0
    pool, instance = f.pick("ngram")
    assert pool.name == "ngram", "the chosen pool's own instance, not a 503"
    assert instance is f.pools["ngram"].instances[0]
    with pytest.raises(NoInstanceAvailable):
        f.pick("ngram", exclude=[*f.pools["ngram"].instances, *f.pools["off"].instances])
