"""``specpilot bench loop``: specpilot's routing vs. each static pool, on real vLLM.

Two real vLLM-CPU pools from the testbed, n-gram γ=4 and off, serve the same mixed
traffic three times: straight to the n-gram pool, straight to the off pool, and through
specpilot's gateway routing by the bandit's choice (a fresh policy: its learning and
exploration are part of the bill). The traffic has phases, as production does: one
stream of self-repeating code prompts, then sixteen concurrent streams, then one again.
Goodput is completion tokens per wall-clock second over the whole run.

JSON: ``{"pools": {name: goodput}, "specpilot": goodput,
"ratios": {"vs_best_static_pool": …}, "phases": …}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.gateway.server import GatewayServer
from controller.routed import routed_gateway
from controller.settings import Settings
from controller.wiring import bandit_policy
from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import SERVED_MODEL, VllmServer, parse_spec
from testbed.traffic import run_streams

RESULT = Path("bench/results/loop.json")


@dataclass(frozen=True)
class Phase:
    streams: int
    requests_each: int


PHASES = (Phase(1, 40), Phase(16, 8), Phase(1, 40))


def pool_settings(ngram_url: str, off_url: str, data_dir: Path) -> Settings:
    """Two pools of the tiny model: n-gram γ=4 and no speculation."""
    tuning = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": ["code"],
            "policy": {"min_dwell_s": 5.0},
            "fleet": {
                "pools": {
                    "ngram": {
                        "model": SERVED_MODEL,
                        "instances": [ngram_url],
                        "speculative_config": {
                            "method": "ngram", "num_speculative_tokens": 4, **tuning,
                        },
                        "proposers": {
                            "ngram": {"method": "ngram", "gamma": [4, 4], "tuning": tuning}
                        },
                    },
                    "off": {"model": SERVED_MODEL, "instances": [off_url]},
                }
            },
        }
    )  # fmt: skip


async def play(url: str) -> tuple[float, list[dict[str, float]]]:
    """Run every phase against ``url``; overall goodput and per-phase figures."""
    tokens_total, seconds_total, phases = 0, 0.0, []
    for index, phase in enumerate(PHASES):
        started = time.perf_counter()
        tokens = await run_streams(url, phase.streams, phase.requests_each, seed=index * 100)
        seconds = time.perf_counter() - started
        tokens_total, seconds_total = tokens_total + tokens, seconds_total + seconds
        phases.append({"streams": phase.streams, "goodput": tokens / seconds})
    return tokens_total / seconds_total, phases


async def play_through_specpilot(settings: Settings) -> tuple[float, list[dict[str, float]]]:
    control = bandit_policy(settings)
    # The policy learns from every request as it completes (the service's loop would hand
    # the same observations over once per interval).
    gateway, _ = routed_gateway(settings, control.policy, control.observe)
    # The gateway's own front end, as `specpilot gateway` runs it.
    server = await GatewayServer.start(gateway, host="127.0.0.1", port=0)
    try:
        return await play(f"http://127.0.0.1:{server.port}")
    finally:
        await server.close(grace_s=5.0)  # also closes the gateway's upstream connections


def run_benchmark() -> dict[str, Any]:
    env, models = VllmEnvironment.default().ensure(), ModelSet.default()
    models.ensure(env)
    with (
        VllmServer(env, models, parse_spec("ngram:4", models)) as ngram,
        VllmServer(env, models, parse_spec("off", models)) as off,
        tempfile.TemporaryDirectory() as data_dir,
    ):
        settings = pool_settings(ngram.base_url, off.base_url, Path(data_dir))
        # Warm both servers so the first measured run does not pay their first requests.
        asyncio.run(run_streams(ngram.base_url, 2, 2, seed=10_000))
        asyncio.run(run_streams(off.base_url, 2, 2, seed=10_000))
        pools, phases = {}, {}
        for name, server in (("ngram", ngram), ("off", off)):
            pools[name], phases[name] = asyncio.run(play(server.base_url))
        specpilot, phases["specpilot"] = asyncio.run(play_through_specpilot(settings))
    best = max(pools, key=lambda name: pools[name])
    return {
        "pools": pools,
        "specpilot": specpilot,
        "best_static_pool": best,
        "ratios": {"vs_best_static_pool": specpilot / pools[best]},
        "phases": phases,
        "workload": [{"streams": p.streams, "requests_each": p.requests_each} for p in PHASES],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.set_defaults(func=run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``loop`` to the ``bench`` sub-command group."""
    add_arguments(
        subparsers.add_parser("loop", help="specpilot routing vs. static pools, real vLLM")
    )


def run(args: argparse.Namespace) -> int:
    result = run_benchmark()
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for name, goodput in result["pools"].items():
        print(f"static pool {name:6s} {goodput:8.1f} tokens/s")
    print(f"specpilot          {result['specpilot']:8.1f} tokens/s")
    ratio = result["ratios"]["vs_best_static_pool"]
    print(f"specpilot / best static pool ({result['best_static_pool']}) = {ratio:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
