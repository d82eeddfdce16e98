"""A per-pool minimum interval between pushes, so a flapping decision never becomes a
restart storm.

The loop's dwell guard limits how often one context changes arm, but a pool's config is
built from several contexts (one per concurrency bucket), and a failed push is handed
over again at the next iteration. For actuators whose push restarts vLLM (managed,
Kubernetes, an orchestrator watching files), ``Paced`` wraps the actuator and hands a
pool over at most once per ``min_interval_s``: a change that comes too early is held
and pushed when the interval has passed (by a timer, and at any later ``apply``), and
the newest wish replaces an older held one, so a flap inside the interval pushes
nothing at all. Re-handing the config a pool already got is not a new push; re-handing
one whose push failed is a retry, held like any other push until the interval passed.
A failure names its pools with a ``pools`` attribute (``RolloutFailed`` does); an
error without one counts against every pool of that push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from controller.actuators.base import Actuator
from controller.fleet import PoolConfig

log = logging.getLogger(__name__)
Clock = Callable[[], float]
ErrorHook = Callable[[Exception], None]


def _log_error(error: Exception) -> None:
    log.error("held speculative config could not be pushed: %s", error)


class Paced:
    def __init__(
        self,
        inner: Actuator,
        min_interval_s: float,
        *,
        clock: Clock = time.monotonic,
        on_error: ErrorHook = _log_error,
    ) -> None:
        """``min_interval_s``: seconds between two pushes to one pool (the policy's
        ``min_dwell_s`` is the natural value). ``on_error`` hears failures of pushes the
        timer makes; failures inside ``apply`` are raised to the caller as usual."""
        self.inner, self.min_interval_s, self.clock, self.on_error = (
            inner,
            min_interval_s,
            clock,
            on_error,
        )
        self.name = inner.name
        self._pushed: dict[str, PoolConfig] = {}
        """What each pool was last handed; compared by its ``config`` only (which buckets
        chose it does not change what vLLM runs)."""
        self._pushed_at: dict[str, float] = {}
        self._failed: set[str] = set()
        self._held: dict[str, PoolConfig] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def held(self) -> tuple[PoolConfig, ...]:
        """Configs waiting for their pool's interval to pass."""
        return tuple(self._held[pool] for pool in sorted(self._held))

    def due_in(self, pool: str) -> float:
        """Seconds until ``pool`` may be pushed again (0: now)."""
        last = self._pushed_at.get(pool)
        return 0.0 if last is None else max(0.0, last + self.min_interval_s - self.clock())

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        for config in configs:
            pushed = self._pushed.get(config.pool)
            if (
                pushed is not None
                and pushed.config == config.config
                and config.pool not in self._failed
            ):
                self._held.pop(config.pool, None)  # back to what runs: the flap cancels out
            else:
                self._held[config.pool] = config
        await self._push_due()

    async def _push_due(self) -> None:
        due = [c for pool, c in sorted(self._held.items()) if self.due_in(pool) == 0.0]
        for config in due:
            del self._held[config.pool]
            # An attempt counts, even a failed one: retrying a config vLLM refuses is a
            # restart too.
            self._pushed[config.pool], self._pushed_at[config.pool] = config, self.clock()
        try:
            if due:
                await self.inner.apply(due)
        except Exception as exc:
            named = getattr(exc, "pools", None)
            failed = set(named) if named is not None else {c.pool for c in due}
            self._failed = (self._failed - {c.pool for c in due}) | failed
            for config in due:
                # Retried by the timer once the interval has passed, unless a newer
                # wish for the pool arrived meanwhile.
                if config.pool in failed:
                    self._held.setdefault(config.pool, config)
            raise
        else:
            self._failed -= {c.pool for c in due}
        finally:
            self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        delay = min(self.due_in(pool) for pool in self._held)
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(self._push_held())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push_held(self) -> None:
        try:
            await self._push_due()
        except Exception as exc:
            self.on_error(exc)

    async def aclose(self) -> None:
        """Cancel the timer, wait for a push it started, then close the inner actuator
        (if it has ``aclose``: the managed one stops the instances it started)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()
