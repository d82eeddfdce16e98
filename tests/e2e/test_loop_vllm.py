"""The closed loop on real vLLM: two real pools (n-gram γ=4 and off) behind the gateway.

No simulator: the gateway proxies to real vLLM-CPU servers, their per-request spec
metrics feed the real bandit through the real control loop, and routing follows its
choice. One stream of self-repeating code prompts should settle on n-gram; sixteen
concurrent streams should settle on off (speculation costs a saturated engine). Both
servers run with the testbed's compute knee (``testbed.server.KNEE_TOKENS``), without
which the tiny model on this CPU gains from n-gram at any load.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import uvicorn

from controller.api import create_app
from controller.contexts import Context
from controller.gateway.server import GatewayServer
from controller.routed import routed_gateway
from controller.service import build_service
from controller.settings import Settings
from controller.wiring import QueuedObservations, bandit_policy
from testbed.server import KNEE_TOKENS, SERVED_MODEL
from testbed.traffic import run_streams
from tests.conftest import VllmServers

# Left out of scripts/test-all: which pool is faster at 16 streams changes from run to run
# on this VM even with the knee (docs/testbed.md); it passed 2 of 4 runs on 29 Nov 2026.
pytestmark = [pytest.mark.vllm, pytest.mark.convergence]


def settings_for(ngram_url: str, off_url: str, data_dir: Path) -> Settings:
    ngram = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": ["code"],
            "scrape_interval_s": 0.5,
            "policy": {"min_dwell_s": 5.0, "measure_after_s": 10.0},
            "api": {"port": 0},
            "fleet": {
                "pools": {
                    "ngram": {
                        "model": SERVED_MODEL,
                        "instances": [ngram_url],
                        "speculative_config": {**ngram, "num_speculative_tokens": 4},
                        "proposers": {
                            "ngram": {
                                "method": "ngram",
                                "gamma": [4, 4],
                                "tuning": {"prompt_lookup_max": 4, "prompt_lookup_min": 2},
                            }
                        },
                    },
                    "off": {"model": SERVED_MODEL, "instances": [off_url]},
                }
            },
        }
    )


def test_loop_settles_on_ngram_alone_and_off_under_load(
    vllm_servers: VllmServers, tmp_path: Path
) -> None:
    ngram = vllm_servers.get("ngram:4", batch_tokens=KNEE_TOKENS)
    off = vllm_servers.get("off", batch_tokens=KNEE_TOKENS)
    settings = settings_for(ngram.base_url, off.base_url, tmp_path / "data")
    control = bandit_policy(settings, topology="per_arm")
    queue = QueuedObservations()
    service = build_service(settings, control, queue, actuators=[])
    gateway, _ = routed_gateway(settings, control.policy, queue.put)

    async def scenario() -> tuple[str, str]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        api = uvicorn.Server(
            uvicorn.Config(create_app(settings, service), log_level="warning", lifespan="on")
        )
        api_task = asyncio.create_task(api.serve(sockets=[sock]))
        # The gateway on its own front end, as `specpilot gateway` runs it.
        front = await GatewayServer.start(gateway, host="127.0.0.1", port=0)
        while not api.started:
            assert not api_task.done(), "the API server failed to start"
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{front.port}"
        try:
            await run_streams(url, count=1, requests_each=80)
            alone = str(control.policy.decide(Context(SERVED_MODEL, "code", "1")).arm)
            await run_streams(url, count=16, requests_each=12)
            busy = str(control.policy.decide(Context(SERVED_MODEL, "code", "16-31")).arm)
        finally:
            api.should_exit = True
            # Also closes the gateway's upstream connections, inside this event loop.
            await front.close(grace_s=5.0)
            await asyncio.gather(api_task, return_exceptions=True)
        return alone, busy

    try:
        alone, busy = asyncio.run(scenario())
    finally:
        service.close()
    assert (alone, busy) == ("ngram:4", "off"), control.policy.estimates()
