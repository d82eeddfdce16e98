"""A managed ``Launcher`` that starts simulated vLLM servers (``simulator.server``) instead
of vLLM: each launch is a one-instance ``FleetThread`` running the launched config, so
``specpilot serve`` can supervise "processes" in a test without a GPU or vLLM.

Name it in settings as ``launcher: "tests.actuators.sim_launcher:make"``. Every launch
and stop is appended to ``<data_dir>/sim-launches.jsonl`` for the test to read.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from controller.actuators.managed import Instance, SpecConfig
from controller.settings import Settings
from simulator.instance import SpecConfig as SimConfig
from simulator.scenario import Scenario, load_scenario
from simulator.server import FleetThread, PoolSpec

SCENARIO = Path(__file__).resolve().parents[2] / "simulator" / "scenarios" / "demo.yaml"
SPEED = 50.0
"""Simulated seconds per wall second: a short completion takes milliseconds."""


def record(journal: Path, event: str, url: str, config: str) -> None:
    with journal.open("a") as out:
        out.write(json.dumps({"event": event, "url": url, "config": config}) + "\n")


@dataclass
class SimProcess:
    fleet: FleetThread
    served_model: str
    journal: Path

    @property
    def base_url(self) -> str:
        return self.fleet.urls()[0]

    async def stop(self) -> None:
        url, config = self.base_url, str(next(iter(self.fleet.fleet.instances.values())).config)
        await asyncio.to_thread(self.fleet.close)
        record(self.journal, "stop", url, config)


@dataclass
class SimLauncher:
    scenario: Scenario
    journal: Path

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        # In a thread of its own: its HTTP server must not take serve's signal handlers.
        spec = PoolSpec(pool, SimConfig.from_vllm(config))
        fleet = FleetThread(self.scenario, [spec], speed=SPEED)
        await asyncio.to_thread(fleet.__enter__)
        process = SimProcess(fleet, self.scenario.model.name, self.journal)
        record(self.journal, "launch", process.base_url, str(spec.config))
        return process


def make(settings: Settings, pool: str) -> SimLauncher:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return SimLauncher(load_scenario(SCENARIO), settings.data_dir / "sim-launches.jsonl")
