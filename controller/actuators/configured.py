"""The actuators a settings file asks for, each paced by the policy's dwell time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from controller.actuators.base import Actuator
from controller.actuators.file import FileActuator
from controller.actuators.k8s import DeploymentTarget, KubernetesActuator
from controller.actuators.launcher import CommandLauncher
from controller.actuators.managed import (
    CanarySettings,
    Instance,
    Launcher,
    ManagedActuator,
    ManagedSettings,
    SpecConfig,
)
from controller.actuators.pacing import Paced
from controller.actuators.preflight import Preflight
from controller.actuators.rolling import RollingRestarts
from controller.actuators.webhook import RetrySettings, WebhookActuator
from controller.builtin import load_factory
from controller.fleet import PoolConfig
from controller.settings import LaunchSettings, ManagedActuatorSettings, Settings
from controller.store.db import Store

ConfigSwitch = Callable[[str, tuple[str, ...], SpecConfig], Awaitable[None] | None]
"""Told ``(pool, base URLs, config they run)`` when a managed pool's instances change."""


def actuators_from(
    settings: Settings,
    *,
    on_switch: ConfigSwitch | None = None,
    leases: Store | None = None,
) -> list[Actuator]:
    """File (unless turned off), webhook, Kubernetes and managed, as configured; none in
    routing mode (pools keep their configs). Pushes that may restart instances are
    paced per pool by ``policy.min_dwell_s`` so a flapping decision never becomes a
    restart storm. ``on_switch`` hears where a managed pool's traffic must go now.
    ``leases``: the store, where the per-pod topology's replicas take turns to restart."""
    wanted = settings.actuators
    if wanted.mode == "routing":
        return []
    preflight = Preflight(target_models=dict(wanted.target_models))
    actuators: list[Actuator] = []
    if wanted.file:
        actuators.append(FileActuator(settings.actuator_dir, preflight))
    if wanted.webhook is not None:
        hook = wanted.webhook
        webhook = WebhookActuator(
            str(hook.url),
            retry=RetrySettings(attempts=hook.attempts, timeout_s=hook.timeout_s),
            headers=dict(hook.headers),
            preflight=preflight,
        )
        actuators.append(Paced(webhook, settings.policy.min_dwell_s))
    if wanted.kubernetes is not None:
        targets = {
            pool: DeploymentTarget(d.namespace, d.deployment, d.container)
            for pool, d in wanted.kubernetes.deployments.items()
        }
        kubernetes = KubernetesActuator(
            targets, patch_type=wanted.kubernetes.patch_type, preflight=preflight
        )
        actuators.append(Paced(kubernetes, settings.policy.min_dwell_s))
    managed = wanted.managed
    if managed is not None and managed.pod_pool is not None:
        if leases is None:
            raise ValueError("the per-pod topology takes its restart leases from the store")
        pool = managed.pod_pool
        rolling = RollingRestarts(
            managed_actuator(settings, managed, preflight, on_switch, pools=(pool,)),
            leases,
            pool=pool,
            replica=managed.replica,
            max_unavailable=managed.max_unavailable,
            ttl_s=managed.lease_ttl_s,
            poll_s=settings.leader.check_interval_s,
        )
        actuators.append(Paced(OnlyPools(rolling, (pool,)), settings.policy.min_dwell_s))
    elif managed is not None:
        only = OnlyPools(
            managed_actuator(settings, managed, preflight, on_switch), tuple(managed.pools)
        )
        actuators.append(Paced(only, settings.policy.min_dwell_s))
    return actuators


def managed_actuator(
    settings: Settings,
    managed: ManagedActuatorSettings,
    preflight: Preflight,
    on_switch: ConfigSwitch | None = None,
    *,
    pools: Sequence[str] | None = None,
) -> ManagedActuator:
    """The supervisor of the managed pools (``pools``: only these), each started by its
    own launcher. Keys left out take ``ManagedSettings``' and ``CanarySettings``' defaults."""
    timing = managed.model_dump(
        exclude_unset=True,
        exclude={"pools", "canary", "pod", "max_unavailable", "lease_ttl_s"},
    )
    canary = CanarySettings(**managed.canary.model_dump(exclude_unset=True))
    launchers = {
        pool: launcher_from(settings, pool, spec)
        for pool, spec in managed.pools.items()
        if pools is None or pool in pools
    }
    actuator = ManagedActuator(
        PoolLaunchers(launchers),
        settings=ManagedSettings(**timing, canary=canary),
        preflight=preflight,
    )
    if on_switch is not None:
        actuator.on_switch = lambda pool, urls: on_switch(pool, urls, actuator.config(pool))
    return actuator


def launcher_from(settings: Settings, pool: str, spec: LaunchSettings) -> Launcher:
    if spec.launcher is not None:
        launcher: Launcher = load_factory(spec.launcher)(settings, pool)
        return launcher
    assert spec.command is not None  # one of the two, checked by the settings
    return CommandLauncher(
        command=tuple(spec.command),
        served_model=spec.served_model or settings.fleet.pools[pool].model,
        host=spec.host,
        port=spec.port,
        environment=dict(spec.environment),
        log_dir=spec.log_dir or settings.data_dir / "vllm-logs",
    )


class PoolLaunchers:
    """One ``Launcher`` per pool, behind the one the managed actuator calls."""

    def __init__(self, launchers: dict[str, Launcher]) -> None:
        self.launchers = launchers

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        return await self.launchers[pool].launch(pool, config, timeout_s)


class OnlyPools:
    """Hands ``inner`` only the pools it serves (the loop hands every actuator all)."""

    def __init__(self, inner: Actuator, pools: Sequence[str]) -> None:
        self.inner = inner
        self.name = inner.name
        self.pools = frozenset(pools)

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        mine = [config for config in configs if config.pool in self.pools]
        if mine:
            await self.inner.apply(mine)

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()
