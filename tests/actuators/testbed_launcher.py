"""The managed actuator's ``Launcher`` on the real testbed: each launch is a real
``VllmServer`` (tiny target, loopback port, own process group)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from controller.actuators.managed import Instance, SpecConfig
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
    launched: list[SpecConfig] = field(default_factory=list)
    """Every config a start was attempted with, in order."""
    servers: list[VllmServer] = field(default_factory=list)

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        self.launched.append(config)
        server = VllmServer(self.env, self.models, config)
        self.servers.append(server)
        await asyncio.to_thread(server.start, timeout_s)  # stops itself if it fails
        return RealVllmInstance(server)

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()
