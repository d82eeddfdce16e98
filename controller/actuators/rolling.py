"""The per-pod sidecar topology's restarts: every replica applies its pool's decision to
its own pod's vLLM, at most ``max_unavailable`` replicas of a pool at once.

Each replica wraps the managed actuator of its pod (``in_place``: a pod holds one
instance) in ``RollingRestarts``. Handed a config its vLLM does not run, a replica:

1. asks the store for a restart lease of its pool (``Store.acquire_lease``), one
   transaction serialised per pool: granted while fewer than ``max_unavailable`` other
   replicas hold an open one; a lease not renewed for ``lease_ttl_s`` (its replica died)
   no longer counts. Until granted it polls, and each time takes the pool's newest wish
   (``target``), so a replica that waited through a newer decision restarts once, into
   the newest config;
2. restarts its vLLM with the lease renewed every third of ``lease_ttl_s``: drain (the
   managed actuator's ``phases`` make ``/readyz`` 503 first, so the pod's Service routes
   around it), stop, start, canary;
3. releases the lease as ``done``, or, when the start or canary failed and the old
   config was started again, as ``failed`` *holding* the pool: no other replica starts
   that config, and the failure is raised (``RolloutFailed``, which the loop records as
   ``ActuatorFailed``). The hold lifts once the pool is handed another config.

A replica whose pod has no vLLM yet (its first start) starts it without a lease: there
is nothing serving to take away. The leases are the rollout's log (``Store.leases``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal, ParamSpec, TypeVar

from controller.actuators.managed import ManagedActuator
from controller.exactness import config_text
from controller.fleet import PoolConfig
from controller.store.db import Store, is_unavailable
from controller.store.records import LeaseOutcome, LeaseRecord

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

Readiness = Literal["ok", "starting", "draining", "restarting", "stopped"]


class RollingRestarts:
    name = "managed"
    every_replica = True
    """Every replica applies decisions through it (its own pod's vLLM), not the leader only."""

    def __init__(
        self,
        inner: ManagedActuator,
        book: Store,
        *,
        pool: str,
        replica: str,
        max_unavailable: int = 1,
        ttl_s: float = 30.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``book``: the store the pool's replicas share; ``poll_s``: how often a replica
        waiting for a lease asks again."""
        self.inner, self.book = inner, book
        self.pool, self.replica = pool, replica
        self.max_unavailable, self.ttl_s, self.poll_s = max_unavailable, ttl_s, poll_s
        self.clock = clock
        self.target: Callable[[str], PoolConfig] | None = None
        """The pool's newest wish (the loop's arms); None: what ``apply`` was handed."""
        self._starting = False
        self._one_at_a_time = asyncio.Lock()
        """A second ``apply`` (pacing's timer beside the loop) waits for the first: one
        replica holds at most one lease, and its own open lease would read as a
        previous life's."""

    def readiness(self) -> Readiness:
        """Whether this pod serves: ``ok``, or why not (``/readyz`` answers 503)."""
        phase = self.inner.phases.get(self.pool)
        if phase is not None:
            return phase
        if not self.inner.urls(self.pool):
            return "starting" if self._starting else "stopped"
        return "ok"

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        for pool_config in configs:
            if pool_config.pool == self.pool:
                async with self._one_at_a_time:
                    await self._apply_one(pool_config)

    async def _apply_one(self, wanted: PoolConfig) -> None:
        await self._store_call(self.book.lift_holds, self.pool, config_text(wanted.config))
        if not self.inner.urls(self.pool):
            self._starting = True
            try:
                await self.inner.apply([wanted])
            finally:
                self._starting = False
            return
        granted = await self._wait_for_lease(wanted)
        if granted is None:
            return
        lease, wanted = granted
        text = config_text(wanted.config)
        log.info("pool %s: replica %s restarts into %s", self.pool, self.replica, text)
        renewing = asyncio.create_task(self._renew(lease))
        try:
            await self.inner.apply([wanted])
        except asyncio.CancelledError:
            await self._release(lease, "abandoned", "the replica stopped mid-restart", text)
            raise
        except Exception as exc:
            await self._release(lease, "failed", str(exc), text, holds=True)
            log.error(
                "pool %s: %s failed on replica %s; the rest of the pool stays where it is",
                self.pool,
                text,
                self.replica,
            )
            raise
        else:
            await self._release(lease, "done", None, text)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing

    async def _wait_for_lease(self, wanted: PoolConfig) -> tuple[LeaseRecord, PoolConfig] | None:
        """A lease to restart into the pool's newest wish, or None: its vLLM runs it
        already, or a failed restart of it holds the pool."""
        waiting_for: tuple[str, ...] | None = None
        while True:
            if self.target is not None:
                wanted = self.target(self.pool)
            if self.inner.config(self.pool) == wanted.config:
                return None
            text = config_text(wanted.config)
            grant = await self._store_call(
                self.book.acquire_lease,
                self.pool,
                self.replica,
                text,
                self.clock,
                self.ttl_s,
                self.max_unavailable,
            )
            if grant is not None and grant.lease is not None:
                if self.target is not None:
                    wanted = self.target(self.pool)  # it may have moved while we asked
                return grant.lease, wanted
            if grant is not None and grant.held is not None:
                held = grant.held
                log.warning(
                    "pool %s: %s is held (it failed on replica %s: %s); staying on %s",
                    self.pool,
                    text,
                    held.replica,
                    held.detail,
                    config_text(self.inner.config(self.pool)),
                )
                return None
            holders = grant.holders if grant is not None else ()
            if holders != waiting_for:
                waiting_for = holders
                log.info(
                    "pool %s: replica %s waits to restart (restarting: %s)",
                    self.pool,
                    self.replica,
                    ", ".join(holders) or "store unreachable",
                )
            await asyncio.sleep(self.poll_s)

    async def _renew(self, lease: LeaseRecord) -> None:
        """Keep ``lease`` open while the restart runs: renewed every third of
        ``ttl_s``, so one late or failed renewal still leaves it open."""
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                renewed = await self._store_call(
                    self.book.renew_lease, lease.id, self.clock(), self.ttl_s
                )
            except Exception:
                # A renewal that raises must not end the renewing: the lease would
                # expire mid-restart and the next replica restart beside this one.
                log.exception("pool %s: renewing restart lease %d failed", self.pool, lease.id)
                continue
            if renewed is False:
                log.error(
                    "pool %s: replica %s's restart lease %d expired before the restart "
                    "ended; another replica may restart beside it",
                    self.pool,
                    self.replica,
                    lease.id,
                )
            elif renewed:
                now = time.monotonic()
                if now - renewed_at > self.ttl_s * 2 / 3:
                    log.warning(
                        "pool %s: restart lease %d renewed %.1f s after the previous "
                        "renewal (lease_ttl_s %.0f): this process or its store is slow",
                        self.pool,
                        lease.id,
                        now - renewed_at,
                        self.ttl_s,
                    )
                renewed_at = now

    async def _release(
        self,
        lease: LeaseRecord,
        outcome: LeaseOutcome,
        detail: str | None,
        config: str,
        *,
        holds: bool = False,
    ) -> None:
        # Unreleased, the lease expires by itself after lease_ttl_s.
        def release() -> None:
            self.book.release_lease(
                lease.id, self.clock(), outcome, detail, holds=holds, config=config
            )

        await self._store_call(release)

    async def _store_call(
        self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T | None:
        """``call`` in a worker thread; None while the store cannot be reached."""
        try:
            return await asyncio.to_thread(call, *args, **kwargs)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("pool %s: restart leases: store unreachable: %s", self.pool, exc)
            return None

    async def aclose(self) -> None:
        await self.inner.aclose()
