"""`specpilot demo`: the whole loop on the embedded default, no GPU and no setup.

What runs, all in this process:

- a simulated vLLM fleet (``simulator.server.SimFleet``): one pool per speculative config
  (off, and each proposer of the demo scenario), speaking vLLM's HTTP protocols;
- the gateway in front of it, routing every request by the policy's choice for its
  (model, class, concurrency bucket), and feeding what each request measured back;
- the real service: SQLite in ``--data-dir``, the control loop with specpilot's bandit,
  and the REST API on ``--port`` (the same API as ``specpilot serve``);
- a closed-loop load generator playing the demo scenario (quiet, rush, quiet);
- a live table of the decisions per context.

A second start with the same ``--data-dir`` continues from the learned state, overrides
and decisions the first one left.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.contexts import Context, context_order
from controller.runtime import assemble
from controller.settings import TOKEN_ENV, Settings, apply_token_env
from controller.store.db import StoreUnavailable
from controller.wiring import BanditControlPolicy
from policies.arms import OFF, Arm
from policies.bandit import SpecPilotPolicy
from simulator.load import LoadOptions, run_load
from simulator.scenario import Scenario, load_scenario
from simulator.server import PoolSpec, SimFleet, default_pools

DEMO_SCENARIO = Path(__file__).resolve().parent.parent / "simulator" / "scenarios" / "demo.yaml"

# vLLM method names and (simulated) draft weights for the simulator's proposer names.
_VLLM_METHOD = {"eagle3": "eagle3", "eagle": "eagle", "draft": "draft_model"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="the whole loop on a simulated fleet: SQLite, no GPU, no setup"
    )
    parser.add_argument("--port", type=int, default=8077, help="the REST API's port")
    parser.add_argument("--data-dir", type=Path, default=Path("specpilot-data"))
    parser.add_argument("--scenario", type=Path, default=DEMO_SCENARIO)
    parser.add_argument(
        "--speed", type=float, default=10.0, help="scenario seconds per wall-clock second"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: scenario end)"
    )
    parser.set_defaults(func=run)


def pool_arm(pool: PoolSpec) -> Arm:
    config = pool.config
    return OFF if config.proposer is None else Arm(config.proposer, config.gamma)


def demo_settings(
    scenario: Scenario,
    pools: tuple[PoolSpec, ...],
    urls: Mapping[str, list[str]],
    args: Any,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The settings ``serve`` would read from a file, for the simulated fleet."""
    fleet: dict[str, Any] = {}
    for pool in pools:
        arm = pool_arm(pool)
        entry: dict[str, Any] = {"model": scenario.model.name, "instances": urls[pool.name]}
        if arm.proposer is not None:
            method = _VLLM_METHOD.get(arm.proposer, arm.proposer)
            proposer: dict[str, Any] = {"method": method, "gamma": [arm.gamma, arm.gamma]}
            if method != "ngram":
                proposer["model"] = f"sim/{arm.proposer}"
            entry["proposers"] = {arm.proposer: proposer}
            entry["speculative_config"] = {
                **{k: v for k, v in proposer.items() if k != "gamma"},
                "num_speculative_tokens": arm.gamma,
            }
        fleet[pool.name] = entry
    data: dict[str, Any] = {
        "data_dir": args.data_dir,
        "api": {"port": args.port},
        "classes": list(scenario.classes),
        "scrape_interval_s": 1.0,
        "policy": {"min_dwell_s": 10.0, "measure_after_s": 20.0},
        "actuators": {"mode": "routing"},
        "fleet": {"pools": fleet},
    }
    # Built from data, not read from a file: the token must be applied as load_settings
    # does, or writes are refused with the variable set.
    apply_token_env(data, os.environ if environ is None else environ)
    return Settings.model_validate(data)


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def render(
    policy: SpecPilotPolicy,
    contexts: set[Context],
    scenario: Scenario,
    elapsed_s: float,
    speed: float,
) -> str:
    """The live table: the policy's committed arm for every context traffic has reached."""
    sim_t = elapsed_s * speed
    phase = scenario.phase_at(min(sim_t, scenario.duration_s - 1e-9))
    lines = [
        f"specpilot demo  t={elapsed_s:6.1f}s (scenario {sim_t:5.0f}s, "
        f"{scenario.concurrency_at(min(sim_t, scenario.duration_s - 1e-9))} streams, phase {phase})"
        f"  explore {policy.explore_fraction:.2f}",
        *learned_costs(policy),
        f"{'class':10s} {'bucket':7s} {'arm':10s} {'reason':11s} {'pred. speed-up':>15s}",
    ]
    for context in sorted(contexts, key=context_order):
        decision = policy.decide(context)
        speedup = decision.predicted_speedup
        shown = f"{speedup:.2f}" if speedup is not None else "-"
        lines.append(
            f"{context.workload_class:10s} {context.bucket:7s} {decision.arm!s:10s} "
            f"{decision.reason:11s} {shown:>15s}"
        )
    return "\n".join(lines)


def learned_costs(policy: SpecPilotPolicy) -> list[str]:
    """Why an arm that pays when quiet costs in a rush, as the policy has it: a pool's
    step slows once its streams verify more tokens per step than the knee."""
    out = []
    for cost in policy.estimates()["cost"]:
        drafting = ", ".join(f"{p} {c:.2f}" for p, c in sorted(cost["draft_cost"].items()))
        out.append(
            f"learned: a pool's step slows past {cost['knee_tokens']:.0f} verified tokens "
            f"(streams × (γ + 1)); drafting per position, of a plain step: {drafting}"
        )
    return out


async def run_demo(args: Any) -> int:
    scenario = load_scenario(args.scenario)
    pools = default_pools(scenario)
    sim = SimFleet(scenario, pools, speed=args.speed)
    await sim.start()
    urls = {pool.name: sim.urls(pool.name) for pool in pools}
    settings = demo_settings(scenario, pools, urls, args)
    try:
        runtime = assemble(settings)
    except StoreUnavailable as exc:
        await sim.stop()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    control, front = runtime.service.policy, runtime.gateway
    assert isinstance(control, BanditControlPolicy) and front is not None
    api_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # no Nagle
    api_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    api_sock.bind((settings.api.host, settings.api.port))
    await runtime.start(api_sock, _free_socket(), log_level="warning")
    gateway_url = f"http://127.0.0.1:{runtime.gateway_port}"

    print(f"specpilot demo: data in {settings.data_dir.resolve()}")
    print(
        f"  REST API   http://{settings.api.host}:{settings.api.port}/v1/policy  (/docs, /metrics)"
    )
    print(f"  gateway    {gateway_url}/v1/completions  (OpenAI-compatible)")
    for pool in pools:
        print(f"  pool {pool.name:7s} {pool_arm(pool)!s:9s} {', '.join(urls[pool.name])}")
    if settings.api.token is None:
        print(f"  (set {TOKEN_ENV} to allow writes such as POST /v1/overrides)")
    print()

    wall_s = args.seconds if args.seconds is not None else scenario.duration_s / args.speed
    started = time.monotonic()
    load = asyncio.create_task(
        run_load(
            gateway_url,
            scenario,
            LoadOptions(speed=args.speed, max_requests=1_000_000, max_duration_s=wall_s),
            rng=random.Random(scenario.seed),
        )
    )
    interactive = sys.stdout.isatty()
    try:
        while not load.done():
            await asyncio.wait({load}, timeout=2.0 if interactive else 10.0)
            # In turn with the loop, which plans in its worker thread meanwhile.
            seen, elapsed = set(front.seen), time.monotonic() - started
            table = await runtime.service.loop.consult(
                functools.partial(render, control.policy, seen, scenario, elapsed, args.speed)
            )
            print(("\x1b[H\x1b[J" if interactive else "") + table + "\n", flush=True)
        report = load.result()
        print(
            f"done: {len(report.results)} requests through the gateway; "
            f"decisions in {settings.data_dir / 'specpilot.db'}"
        )
    finally:
        await runtime.stop(grace_s=5.0)
        runtime.close()
        await sim.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(run_demo(args))
    except KeyboardInterrupt:
        return 130
