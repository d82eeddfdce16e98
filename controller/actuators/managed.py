"""Supervise local vLLM processes and move each pool to a new speculative config safely.

vLLM fixes ``--speculative-config`` at start, so a new config means a new process. For
each pool whose config changed (blue/green, the default):

1. preflight (schema, draft tokenizer) — a refused config starts nothing;
2. start an instance with the new config (``Launcher``) and wait for health;
3. canary: real completions on it, because vLLM 0.32 on CPU can report healthy and die
   at the first request (``rejection_sample_method: synthetic``); with ``max_slowdown``
   set, the same requests go to the old instance too and the new one must not be slower
   by more than that fraction (median latency over the canary window);
4. switch traffic: the pool's instance list changes and ``on_switch`` hears it (the
   gateway's routing table, or anything that routes);
5. drain the old instance (its running + waiting requests reach 0, read from its own
   ``/metrics``) and stop it.

If the new instance fails to start, fails the canary or is slower, it is stopped, the
old one keeps serving (it was never taken out of traffic) and the pool is reported in a
``RolloutFailed`` error, which the control loop records as an ``ActuatorFailed`` alert.
With ``in_place`` (only one instance fits on the node) the old instance is drained and
stopped first, and a failed start is rolled back by starting the old config again.

When one config must serve every concurrency level, the pool's config already carries
the learned γ-by-concurrency table as ``num_speculative_tokens_per_batch_size`` (built by
``controller.fleet.Fleet.pool_config``); this actuator starts vLLM with it as is.

Hand the loop ``Paced(managed, settings.policy.min_dwell_s)``
(``controller.actuators.pacing``): one restart per pool per interval, whatever the
decisions do.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
from opentelemetry import trace

from collectors.exposition import ExpositionError, parse_exposition
from controller.actuators.preflight import Preflight, PreflightError
from controller.exactness import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPTS,
    ExactnessBroken,
    ExactnessResult,
    ExactnessUnavailable,
    TokenIds,
    compare,
    config_text,
    greedy_tokens,
)
from controller.fleet import PoolConfig

log = logging.getLogger(__name__)

SpecConfig = dict[str, Any] | None


class Instance(Protocol):
    """A running, healthy vLLM server the supervisor started."""

    @property
    def base_url(self) -> str: ...

    @property
    def served_model(self) -> str: ...

    async def stop(self) -> None:
        """Stop the server and everything it spawned; return when it is gone."""


class Launcher(Protocol):
    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        """Start vLLM for ``pool`` with ``config`` (None: no speculation) and return it once
        ``/health`` answers; raise (and leave nothing running) if it exits or times out."""


TrafficSwitch = Callable[[str, tuple[str, ...]], Awaitable[None] | None]
"""Told ``(pool, base URLs)`` whenever the instances serving a pool change."""
InFlightProbe = Callable[[Instance], Awaitable[int]]
"""Requests an instance is still working on (running + waiting)."""
Timer = Callable[[], float]


@dataclass(frozen=True, slots=True)
class CanarySettings:
    requests: int = 3
    """Completions sent to the new instance (and, to compare, to the old one)."""
    prompt: str = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    max_tokens: int = 16
    timeout_s: float = 60.0
    max_slowdown: float | None = 0.25
    """Roll back if the new instance's median canary latency exceeds the old one's by more
    than this fraction (0.25: 25 % slower). None: do not compare. The old instance also
    carries live traffic, so the comparison favours the new one; it catches a config
    that is plainly slower, not a few percent."""
    exactness: bool = True
    """Greedy output must match the pool's no-speculation reference token for token
    (``controller.exactness``): checked after each start and every ``interval_s``."""
    exactness_prompts: tuple[str, ...] = DEFAULT_PROMPTS
    exactness_max_tokens: int = DEFAULT_MAX_TOKENS
    interval_s: float | None = DEFAULT_INTERVAL_S
    """Seconds between exactness checks of a running speculating instance (None: only
    after pushes)."""


@dataclass(frozen=True, slots=True)
class ManagedSettings:
    mode: Literal["blue_green", "in_place"] = "blue_green"
    """``blue_green``: the new instance runs beside the old one until it has proven itself.
    ``in_place``: only one fits (memory, GPU): stop the old one first."""
    start_timeout_s: float = 300.0
    switch_grace_s: float = 1.0
    """After the switch, requests already routed to the old instance may still be on
    their way; it is drained only after this many seconds."""
    drain_timeout_s: float = 300.0
    """The old instance is stopped after this long even if requests remain (seconds)."""
    drain_poll_s: float = 0.5
    canary: CanarySettings = field(default_factory=CanarySettings)


Stage = Literal["preflight", "start", "canary", "slower", "exactness", "rollback"]
Phase = Literal["draining", "restarting"]
"""Where an in-place restart is: the old instance draining, or the pool's instance
stopped and its successor (or the rollback) starting and being canaried."""


@dataclass(frozen=True, slots=True)
class RolloutFailure:
    """A pool that did not move to its new config; ``serving`` says what serves it now."""

    pool: str
    config: SpecConfig
    stage: Stage
    reason: str
    serving: SpecConfig
    still_serving: bool
    exactness: ExactnessBroken | None = None
    """Set when the new instance's greedy output differed from the reference."""

    def describe(self) -> str:
        after = "old instance kept serving" if self.still_serving else "pool has NO instance"
        return f"pool {self.pool!r}: {self.stage} failed ({self.reason}); {after}"


class RolloutFailed(RuntimeError):
    """One or more pools were rolled back; the message is one line per pool."""

    def __init__(self, failures: Sequence[RolloutFailure]) -> None:
        super().__init__("; ".join(f.describe() for f in failures))
        self.failures = tuple(failures)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(f.pool for f in self.failures)


@dataclass(frozen=True, slots=True)
class _Refused:
    """Why a new instance was not taken (it is stopped by then)."""

    stage: Stage
    reason: str
    exactness: ExactnessBroken | None = None


@dataclass(frozen=True, slots=True)
class _Reference:
    """Greedy token ids of the canary prompts, and where they came from."""

    tokens: tuple[TokenIds, ...]
    source: str


class _CanaryError(Exception):
    def __init__(self, stage: Literal["canary", "slower"], reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


async def metrics_in_flight(instance: Instance) -> int:
    """Running + waiting requests from the instance's own ``/metrics``; 0 when it does
    not answer (a dead instance has nothing left to drain)."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(f"{instance.base_url}/metrics")
        response.raise_for_status()
        snapshot = parse_exposition(response.text)
    except (httpx.HTTPError, ExpositionError):
        return 0
    return round(sum((e.running or 0.0) + (e.waiting or 0.0) for e in snapshot.engines.values()))


@dataclass(slots=True)
class _Running:
    instance: Instance
    config: SpecConfig


class ManagedActuator:
    name = "managed"

    def __init__(
        self,
        launcher: Launcher,
        *,
        settings: ManagedSettings | None = None,
        preflight: Preflight | None = None,
        on_switch: TrafficSwitch | None = None,
        in_flight: InFlightProbe = metrics_in_flight,
        timer: Timer = time.perf_counter,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``timer`` measures canary latency (seconds); ``transport`` carries the canary
        requests (None: the network)."""
        self.launcher = launcher
        self.settings = settings or ManagedSettings()
        self.preflight = preflight or Preflight()
        self.on_switch = on_switch
        self.in_flight = in_flight
        self.timer = timer
        self.transport = transport
        self._running: dict[str, _Running] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._references: dict[str, _Reference] = {}
        """Per pool: what an instance without speculation answered (the reference)."""
        self._inexact: dict[str, set[str]] = {}
        """Per pool: configs whose greedy output differed (refused without a start)."""
        self._checked_at: dict[str, float] = {}
        self.phases: dict[str, Phase] = {}
        """Per pool, while an in-place restart takes its instance out of service."""

    # -- what serves each pool -----------------------------------------------------------

    def urls(self, pool: str) -> tuple[str, ...]:
        """Base URLs serving ``pool`` now (the instance list a gateway routes to)."""
        running = self._running.get(pool)
        return (running.instance.base_url,) if running else ()

    def config(self, pool: str) -> SpecConfig:
        running = self._running.get(pool)
        return running.config if running else None

    def running(self) -> Mapping[str, SpecConfig]:
        return {pool: r.config for pool, r in sorted(self._running.items())}

    async def _switch(self, pool: str) -> None:
        if self.on_switch is not None:
            result = self.on_switch(pool, self.urls(pool))
            if inspect.isawaitable(result):
                await result

    # -- apply ---------------------------------------------------------------------------

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        """Move every pool to its config; raise ``RolloutFailed`` naming the pools that
        stayed on (or went back to) their old config."""
        # One pool after the other: blue/green needs room for one extra instance only.
        failures = [f for c in configs if (f := await self._apply_one(c)) is not None]
        if failures:
            raise RolloutFailed(failures)

    async def _apply_one(self, pool_config: PoolConfig) -> RolloutFailure | None:
        pool, config = pool_config.pool, pool_config.config
        async with self._locks.setdefault(pool, asyncio.Lock()):
            current = self._running.get(pool)
            if current is not None and current.config == config:
                return None
            try:
                self.preflight.check(pool_config)
            except PreflightError as exc:
                return self._failure(pool, config, "preflight", str(exc))
            if config_text(config) in self._inexact.get(pool, set()):
                reason = "its greedy output differed from the reference at an earlier push"
                return self._failure(pool, config, "exactness", reason)
            self._checked_at.pop(pool, None)
            if current is not None and self.settings.mode == "in_place":
                return await self._replace_in_place(pool, config, current)
            return await self._blue_green(pool, config, current)

    def _failure(
        self,
        pool: str,
        config: SpecConfig,
        stage: Stage,
        reason: str,
        exactness: ExactnessBroken | None = None,
    ) -> RolloutFailure:
        current = self._running.get(pool)
        failure = RolloutFailure(
            pool,
            config,
            stage,
            reason,
            serving=current.config if current else None,
            still_serving=current is not None,
            exactness=exactness,
        )
        log.error("rollout failed: %s", failure.describe())
        return failure

    async def _blue_green(
        self, pool: str, config: SpecConfig, current: _Running | None
    ) -> RolloutFailure | None:
        baseline = await self._baseline(pool, current)
        started = await self._start_proven(pool, config, current, baseline)
        if isinstance(started, _Refused):
            return self._failure(pool, config, started.stage, started.reason, started.exactness)
        self._running[pool] = _Running(started, config)
        await self._switch(pool)
        if current is not None:
            await self._drain(current.instance)
            await current.instance.stop()
        log.info("pool %s now runs %s at %s", pool, config, started.base_url)
        return None

    async def _replace_in_place(
        self, pool: str, config: SpecConfig, current: _Running
    ) -> RolloutFailure | None:
        baseline = await self._baseline(pool, current)  # before the old one stops
        self.phases[pool] = "draining"
        try:
            return await self._restart(pool, config, current, baseline)
        finally:
            del self.phases[pool]

    async def _restart(
        self, pool: str, config: SpecConfig, current: _Running, baseline: _Reference | None
    ) -> RolloutFailure | None:
        del self._running[pool]
        await self._switch(pool)
        await self._drain(current.instance)
        self.phases[pool] = "restarting"
        await current.instance.stop()
        started = await self._start_proven(pool, config, None, baseline)
        if not isinstance(started, _Refused):
            self._running[pool] = _Running(started, config)
            await self._switch(pool)
            return None
        # Roll back: the old config ran before, so start it again.
        restored = await self._start_proven(pool, current.config, None, None)
        if isinstance(restored, _Refused):
            return self._failure(
                pool,
                config,
                "rollback",
                f"{started.reason}; restarting the old config failed too: {restored.reason}",
            )
        self._running[pool] = _Running(restored, current.config)
        await self._switch(pool)
        return self._failure(pool, config, started.stage, started.reason, started.exactness)

    async def _start_proven(
        self,
        pool: str,
        config: SpecConfig,
        compare_with: _Running | None,
        baseline: _Reference | None,
    ) -> Instance | _Refused:
        """A new instance that started and passed the canary, or why not (stopped)."""
        try:
            instance = await self.launcher.launch(pool, config, self.settings.start_timeout_s)
        except Exception as exc:
            return _Refused("start", _one_line(exc))
        try:
            await self._canary(instance, compare_with.instance if compare_with else None)
            await self._check_new(pool, config, instance, baseline)
        except _CanaryError as exc:
            await instance.stop()
            return _Refused(exc.stage, str(exc))
        except ExactnessBroken as exc:
            await instance.stop()
            self._inexact.setdefault(pool, set()).add(config_text(config))
            return _Refused("exactness", str(exc), exc)
        except BaseException:
            await instance.stop()  # cancelled mid-canary: never leave an orphan
            raise
        return instance

    # -- canary and drain ----------------------------------------------------------------

    async def _canary(self, new: Instance, old: Instance | None) -> None:
        canary = self.settings.canary
        compare = old is not None and canary.max_slowdown is not None
        new_s: list[float] = []
        old_s: list[float] = []
        async with httpx.AsyncClient(timeout=canary.timeout_s, transport=self.transport) as client:
            for _ in range(canary.requests):
                new_s.append(await self._timed_completion(client, new, strict=True))
                if compare and old is not None:
                    old_s.append(await self._timed_completion(client, old, strict=False))
        old_s = [
            s for s in old_s if s == s
        ]  # NaN: the old one did not answer; not the new one's fault
        if compare and old_s and canary.max_slowdown is not None:
            new_median, old_median = statistics.median(new_s), statistics.median(old_s)
            if new_median > old_median * (1.0 + canary.max_slowdown):
                raise _CanaryError(
                    "slower",
                    f"canary median {new_median * 1000:.0f} ms vs {old_median * 1000:.0f} ms "
                    f"on the old config (allowed +{canary.max_slowdown:.0%})",
                )

    async def _timed_completion(
        self, client: httpx.AsyncClient, instance: Instance, *, strict: bool
    ) -> float:
        canary = self.settings.canary
        body = {
            "model": instance.served_model,
            "prompt": canary.prompt,
            "max_tokens": canary.max_tokens,
            "temperature": 0.0,
        }
        started = self.timer()
        try:
            response = await client.post(f"{instance.base_url}/v1/completions", json=body)
            response.raise_for_status()
            payload = response.json()
            text = payload["choices"][0]["text"]
            tokens = payload["usage"]["completion_tokens"]
            if not isinstance(text, str) or not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"no completion in {str(payload)[:200]}")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            if strict:
                raise _CanaryError("canary", f"canary request failed: {_one_line(exc)}") from exc
            return float("nan")
        return self.timer() - started

    # -- exactness -----------------------------------------------------------------------

    async def _greedy(self, instance: Instance) -> tuple[TokenIds, ...]:
        canary = self.settings.canary
        async with httpx.AsyncClient(timeout=canary.timeout_s, transport=self.transport) as client:
            return await greedy_tokens(
                client,
                instance.base_url,
                instance.served_model,
                canary.exactness_prompts,
                canary.exactness_max_tokens,
            )

    async def _baseline(self, pool: str, current: _Running | None) -> _Reference | None:
        """What a new instance of ``pool`` must answer: the pool's no-speculation
        reference, else what the instance serving it now answers (before the push)."""
        if not self.settings.canary.exactness:
            return None
        reference = self._references.get(pool)
        if reference is not None or current is None:
            return reference
        try:
            tokens = await self._greedy(current.instance)
        except (httpx.HTTPError, ExactnessUnavailable) as exc:
            log.warning("pool %s: no exactness baseline from the old instance: %s", pool, exc)
            return None
        source = f"the instance before the push ({config_text(current.config)})"
        if current.config is None:
            self._references[pool] = _Reference(tokens, "no speculation")
            return self._references[pool]
        return _Reference(tokens, source)

    async def _check_new(
        self, pool: str, config: SpecConfig, instance: Instance, baseline: _Reference | None
    ) -> None:
        """Raise ``ExactnessBroken`` if the new instance's greedy tokens differ from the
        baseline; an instance without speculation becomes the pool's reference."""
        if not self.settings.canary.exactness:
            return
        try:
            tokens = await self._greedy(instance)
        except httpx.HTTPError as exc:
            raise _CanaryError("canary", f"exactness request failed: {_one_line(exc)}") from exc
        except ExactnessUnavailable as exc:
            log.warning("pool %s: exactness not checked: %s", pool, exc)
            _exactness_event(pool, config, "unavailable")
            return
        if config is None:
            self._references[pool] = _Reference(tokens, "no speculation")
            _exactness_event(pool, config, "reference")
            return
        if baseline is None:
            log.warning(
                "pool %s: %s starts unverified: no instance without speculation to compare "
                "with yet (exactness is checked once the pool has run one)",
                pool,
                config_text(config),
            )
            _exactness_event(pool, config, "unverified")
            return
        divergences = compare(baseline.tokens, tokens)
        _exactness_event(pool, config, "broken" if divergences else "exact", len(divergences))
        if divergences:
            raise ExactnessBroken(pool, config, baseline.source, divergences)

    async def check_due(self, now: float) -> list[ExactnessResult]:
        """The loop's periodic check: each speculating pool with a reference, every
        ``canary.interval_s`` (the first call only starts the clock)."""
        canary = self.settings.canary
        if not canary.exactness or canary.interval_s is None:
            return []
        results = []
        for pool, running in sorted(self._running.items()):
            reference = self._references.get(pool)
            lock = self._locks.setdefault(pool, asyncio.Lock())
            if running.config is None or reference is None or lock.locked():
                continue
            last = self._checked_at.setdefault(pool, now)
            if now - last < canary.interval_s:
                continue
            self._checked_at[pool] = now
            async with lock:
                try:
                    tokens = await self._greedy(running.instance)
                except (httpx.HTTPError, ExactnessUnavailable) as exc:
                    log.warning("pool %s: exactness check skipped: %s", pool, exc)
                    continue
            divergences = compare(reference.tokens, tokens)
            broken = (
                ExactnessBroken(pool, running.config, reference.source, divergences)
                if divergences
                else None
            )
            if broken is not None:
                log.error("%s", broken)
            results.append(ExactnessResult(f"pool={pool}", broken))
        return results

    async def _drain(self, instance: Instance) -> None:
        """Wait until ``instance`` has no request left (two quiet readings in a row)."""
        settings = self.settings
        await asyncio.sleep(settings.switch_grace_s)
        deadline = time.monotonic() + settings.drain_timeout_s
        quiet = 0
        while quiet < 2:
            if time.monotonic() >= deadline:
                log.warning(
                    "%s still busy after %.0f s; stopping it",
                    instance.base_url,
                    settings.drain_timeout_s,
                )
                return
            quiet = quiet + 1 if await self.in_flight(instance) == 0 else 0
            if quiet < 2:
                await asyncio.sleep(settings.drain_poll_s)

    async def aclose(self) -> None:
        """Stop every instance this actuator started."""
        running, self._running = self._running, {}
        for pool in sorted(running):
            await running[pool].instance.stop()
            await self._switch(pool)


def _exactness_event(pool: str, config: SpecConfig, outcome: str, differing: int = 0) -> None:
    """On the current span (the push's actuator span when tracing; else a no-op)."""
    trace.get_current_span().add_event(
        "specpilot.exactness",
        {
            "specpilot.pool": pool,
            "specpilot.config": config_text(config),
            "specpilot.exactness.outcome": outcome,
            "specpilot.exactness.differing_prompts": differing,
        },
    )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    head = text[0] if text else type(error).__name__
    tail = text[-1] if len(text) > 1 else ""
    return f"{head} … {tail}" if tail else head
